"""esroll: evolution strategies (EGGROLL, LOO-ROLL) and a GRPO baseline for LLM post-training in JAX.

Kept import-light on purpose: `import esroll.rewards` must not pull in JAX.

Shape suffixes. An array's name ends in its axes, one capital letter each, joined by "x": `logits_BxTxV` is
[B, T, V], `fitness_M` is [M]. A digit is an axis of that size (`adv_Bx1`); letters written together are one axis
of their product (`q_BxTxQH`: every query head's H values side by side; `q_BxKxGTxH`). Docstrings write shapes the
same way in brackets ([L, M, I, R]); lowercase words in brackets ([in, out], [dim]) are sizes a function takes from
its arguments, not axes of this legend. A single capital used as a size in code (`B, T = tokens_BxT.shape`) is the
size of that axis. Each letter means one thing across the whole library:

    B  rows: sequences in a batch (a rollout's rows; in ES member-major, in GRPO prompt-major)
    T  sequence positions of one forward
    P  padded prompt length
    N  new (generated) tokens per row (of one decode: a turn's action in `esroll.agents.multiturn`)
    S  KV-cache slots
    V  vocabulary
    D  model width (hidden size)
    F  MLP width (intermediate size)
    H  head dim
    Q  query heads
    K  key/value heads
    G  query heads per key/value head (Q = K·G)
    L  layers
    I  input width of a linear (a weight is [I, O])
    O  output width of a linear
    R  rank of a low-rank perturbation
    M  members: of the ES population, or of one GRPO group (a prompt's completions; the GRPO papers' G); the
       entries one baseline is shared over (`esroll.baselines`, `esroll.grpo.advantages`)
    E  ES directions (E_k): E = M/2 antithetic (EGGROLL), E = M for LOO-ROLL
    C  chunks a long axis is scanned in: directions (`esroll.es.estimators.weighted_sum`), completion tokens
       (`esroll.scoring`)
    Z  the length of one chunk
    X  prompts (examples) of a step; the groups of `esroll.grpo.advantages`
    U  microbatches (GRPO)
    A  samples of one prompt: an ES member's `es.samples` answers to it; the fresh rollouts of a prompt and the
       continuations from the end of a step (`esroll.grpo.credit`, `steps.branches`)
    W  turns of an episode (`esroll.agents`)
    J  reasoning steps of a completion (`esroll.steps`)
    Y  the token groups a GRPO variant pools over (ACPO's probability groups, `esroll.grpo.variants`)

Mathematical symbols in docstrings (the gradient G, the noise matrix E = ABᵀ/√r, the variance V, an index k) follow
docs/theory.md and are not axes; lowercase einsum subscripts are the legend's letters (`"bti,io->bto"`).
"""
