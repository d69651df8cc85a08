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

The alphabet is used up, so two letters have a second meaning inside one place only, said there:
`Perturbation.tables` and `lowrank_term` (`esroll.models.layers`) write G for the row blocks of a member table and U
for its slots; neither function has query heads or microbatches.

Mathematical symbols in docstrings (the gradient G, the noise matrix E = ABᵀ/√r, the variance V, an index k) follow
docs/theory.md and are not axes; lowercase einsum subscripts are the legend's letters (`"bti,io->bto"`).
"""

import glob as _glob
import importlib.util as _util
import os as _os
import sys as _sys


def quiet_tpu_probe() -> None:
    """With libtpu installed (the `plan` extra) on a host without a TPU, JAX's start-up probe prints a screen of errors
    before falling back to the CPU: skip the probe there, keeping any other accelerator JAX would pick. Done when
    esroll is imported (before JAX is, it sets JAX_PLATFORMS=cpu, without importing JAX; after, it sets JAX's
    `jax_platforms`). A host with TPU chips (/dev/accel*, /dev/vfio/N), one with a CUDA plugin, and an explicit
    JAX_PLATFORMS are left alone."""
    if _os.environ.get("JAX_PLATFORMS") or _util.find_spec("libtpu") is None:
        return
    if _glob.glob("/dev/accel*") or _glob.glob("/dev/vfio/[0-9]*"):
        return
    if any(_util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13)):
        return  # a GPU machine: JAX's own choice (the probe's noise is the lesser harm than losing the GPU)
    if "jax" not in _sys.modules:
        _os.environ["JAX_PLATFORMS"] = "cpu"
        return
    jax = _sys.modules["jax"]
    if not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")


quiet_tpu_probe()
