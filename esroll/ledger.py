"""FLOPs of the decoder's passes, counted from the model's shapes (`esroll.models.ModelConfig`).

What is counted: matrix products, each as 2·m·n·k (one multiply and one add per term), namely
    the weight matmuls of every layer, q [D, Q·H], k and v [D, K·H], o [Q·H, D], gate and up [D, F], down [F, D]:
        2·(2·D·Q·H + 2·D·K·H + 3·D·F) per token per layer (grouped-query attention: k and v have K heads);
    attention, per layer, query head and (query, key) pair: the score q·k and the value sum p·v, 2·H each,
        4·Q·H per pair (each of the Q query heads reads its group's key and value, so K does not enter);
    the LM head, 2·D·V per position whose logits are computed (tied or not: x·embedᵀ costs what x·lm_head does);
    optionally an ES member's rank-r perturbation of the layer matrices, (x·a)·bᵀ: 2·r·(I + O) per token per
        matrix (`perturb_rank`; the seven layer matrices, as `esroll.es.ESConfig`'s defaults perturb them).
What is not: norms (the Qwen3 q/k norms too), RoPE, softmax, the activation and gating, biases, residual adds,
sampling and every other elementwise or reduction op, and the embedding lookup (a gather). These are O(D + F) per
token against the matmuls' O(D² + D·F), and O(1) per attention pair against 4·Q·H; XLA's own count
(`cost_analysis()["flops"]`) includes them, at one FLOP per element per op, so it exceeds this count by a few
percent on small widths and by less as the model widens.

Attention pairs. `causal=True` counts each query against the keys it can see, its own position included: T(T+1)/2
pairs for a full sequence of T tokens, P + t for decode step t after a prompt of P. That is the work a
causal-aware kernel does, and what `generate_flops` counts (attention over the growing cache). `causal=False`
counts every (query, slot) pair of the buffer, T² for a full sequence: what a dense kernel computes before masking,
as `esroll.models.forward`'s attention does (`jax.nn.dot_product_attention`'s XLA implementation without a
cache; `esroll.models.transformer.attend` over every cached slot and the new ones with one).

Padding is counted as tokens: every row runs all its positions (left-padded prompts included), since the
programs' shapes are fixed.

Shape letters (see `esroll`): D width, F MLP width, Q query heads, K key/value heads, H head dim, V vocabulary,
L layers, P prompt length, N new tokens, T positions.
"""

from __future__ import annotations

from esroll.models import ModelConfig

REMAT = (None, "none", "full", "dots")  # `esroll.models.transformer.REMAT_POLICIES`, and None as "none"


def _check(**sizes: int) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


def _layer_matrices(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of the seven weight matrices of one layer."""
    D, F, QH, KH = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [(D, QH), (D, KH), (D, KH), (QH, D), (D, F), (D, F), (F, D)]


def layer_flops_per_token(cfg: ModelConfig, perturb_rank: int = 0) -> int:
    """The weight matmuls of all L layers for one token: L·Σ 2·I·O over q, k, v, o, gate, up, down, plus
    L·Σ 2·r·(I + O) for a rank-`perturb_rank` member perturbation of each (0: none)."""
    _check(perturb_rank=perturb_rank)
    per_layer = sum(2 * i * o + 2 * perturb_rank * (i + o) for i, o in _layer_matrices(cfg))
    return cfg.num_layers * per_layer


def attention_flops(cfg: ModelConfig, rows: int, queries: int, cached: int = 0, *, causal: bool = True) -> int:
    """Scores and value sums of `queries` consecutive new positions per row after `cached` earlier slots, all layers:
    4·L·Q·H per (query, key) pair. causal: query j (0-based) sees cached + j + 1 keys; not causal: every query
    sees all cached + queries slots."""
    _check(rows=rows, queries=queries, cached=cached)
    if causal:
        pairs = queries * cached + queries * (queries + 1) // 2
    else:
        pairs = queries * (cached + queries)
    return 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * rows * pairs


def head_flops(cfg: ModelConfig, rows: int, positions: int) -> int:
    """The LM head (x·lm_head, or x·embedᵀ when tied) at `positions` positions per row: 2·D·V each."""
    _check(rows=rows, positions=positions)
    return 2 * cfg.hidden_size * cfg.vocab_size * rows * positions


def forward_flops(
    cfg: ModelConfig,
    rows: int,
    context: int,
    *,
    head_positions: int | None = None,
    causal: bool = True,
    perturb_rank: int = 0,
) -> int:
    """One cache-free forward over `rows` sequences of `context` tokens: every layer at every position, attention
    among the sequence's own positions, and the head at `head_positions` positions per row (default all `context`,
    as `esroll.models.forward` returns every position's logits; `esroll.scoring.sequence_logprobs` applies it to the
    N completion positions only)."""
    _check(rows=rows, context=context)
    head_positions = context if head_positions is None else head_positions
    return (
        rows * context * layer_flops_per_token(cfg, perturb_rank)
        + attention_flops(cfg, rows, context, causal=causal)
        + head_flops(cfg, rows, head_positions)
    )


def prefill_flops(cfg: ModelConfig, rows: int, prompt_len: int, *, perturb_rank: int = 0) -> int:
    """`esroll.sampling.generate`'s prefill: the prompt but its last token (P − 1 positions) written into the
    cache, causal attention among them, no head (their logits are unused; the last prompt token is the first decode
    step's input)."""
    _check(rows=rows, prompt_len=prompt_len)
    pre = max(prompt_len - 1, 0)
    return rows * pre * layer_flops_per_token(cfg, perturb_rank) + attention_flops(cfg, rows, pre, causal=True)


def decode_flops(cfg: ModelConfig, rows: int, prompt_len: int, new_tokens: int, *, perturb_rank: int = 0) -> int:
    """`new_tokens` KV-cache decode steps after a prompt of `prompt_len` tokens: step t (0-based) runs one token per
    row through every layer, attends over the P + t slots filled so far (its own included) and applies the head.
    Counts all N steps (the upper bound: the loop stops earlier once every row has produced EOS)."""
    _check(rows=rows, prompt_len=prompt_len, new_tokens=new_tokens)
    P, N = prompt_len, new_tokens
    pairs = N * P + N * (N - 1) // 2  # Σ_t (P + t)
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * rows * pairs
    return rows * N * layer_flops_per_token(cfg, perturb_rank) + attention + head_flops(cfg, rows, N)


def generate_flops(cfg: ModelConfig, rows: int, prompt_len: int, new_tokens: int, *, perturb_rank: int = 0) -> int:
    """Prefill plus decode (`prefill_flops` + `decode_flops`) of `rows` prompts of `prompt_len` tokens (padded
    length) and `new_tokens` new tokens each.

    With a KV cache every position goes through the layers once, so this is the causal forward over the P + N − 1
    positions that generation feeds in, with the head at the N that sample: forward_flops(cfg, rows, P + N − 1,
    head_positions=N, causal=True). `rows` are all the sequences decoded (ES: members × prompts × samples each).
    """
    return prefill_flops(cfg, rows, prompt_len, perturb_rank=perturb_rank) + decode_flops(
        cfg, rows, prompt_len, new_tokens, perturb_rank=perturb_rank
    )


def train_flops(
    cfg: ModelConfig,
    rows: int,
    prompt_len: int,
    new_tokens: int,
    *,
    causal: bool = True,
    remat: str | None = None,
) -> int:
    """One forward and backward pass of `rows` scored sequences (GRPO's loss: `esroll.scoring.sequence_logprobs`
    over prompt + completion, P + N positions, the head at the N completion positions).

    Convention: the backward pass costs twice the forward, so the total is 3 × forward_flops(cfg, rows, P + N,
    head_positions=N): each product Y = X·W of the forward has two products of its size in the backward, the input
    gradient dX = dY·Wᵀ and the weight gradient dW = Xᵀ·dY, and likewise the attention products (dQ, dK from the
    scores' gradient, dP and dV from the values'). `remat` (`esroll.models.transformer.REMAT_POLICIES`) adds what the
    backward pass recomputes: "full" every layer's forward but its `down` projection, whose output the backward pass
    never reads (it needs that product's input and its output's gradient only); "dots" the attention products (the
    weight matmuls' outputs are saved). GRPO's other passes are separate: the π_old / reference scoring forwards and
    `inner_iterations` passes over the batch multiply or add to this as the trainer runs them.
    """
    _check(rows=rows, prompt_len=prompt_len, new_tokens=new_tokens)
    if remat not in REMAT:
        raise ValueError(f"unknown remat policy {remat!r}; known: none, full, dots")
    T = prompt_len + new_tokens
    total = 3 * forward_flops(cfg, rows, T, head_positions=new_tokens, causal=causal)
    attention = attention_flops(cfg, rows, T, causal=causal)
    if remat == "full":
        D, F = cfg.hidden_size, cfg.intermediate_size
        total += rows * T * (layer_flops_per_token(cfg) - cfg.num_layers * 2 * F * D) + attention
    elif remat == "dots":
        total += attention
    return total


def rollout_flops(cfg: ModelConfig, prompt_len: int, lengths, *, perturb_rank: int = 0) -> int:
    """A rollout of len(lengths) rows of a `prompt_len`-token (padded) prompt: every row's prefill, then each row's
    own decode steps, `lengths[b]` of them (its tokens up to and including EOS): the work of the tokens a rollout
    produced, not of the steps a batched decode loop also runs for rows that have already stopped."""
    lengths = [int(n) for n in lengths]
    total = prefill_flops(cfg, len(lengths), prompt_len, perturb_rank=perturb_rank)
    counts: dict[int, int] = {}
    for n in lengths:
        counts[n] = counts.get(n, 0) + 1
    for n, rows in counts.items():
        total += decode_flops(cfg, rows, prompt_len, n, perturb_rank=perturb_rank)
    return total


def es_update_flops(cfg: ModelConfig, directions: int, rank: int) -> int:
    """ES's `tell` on the layer matrices: Σ_k w_k·A_k·B_kᵀ over `directions` rank-`rank` terms, one [I, O] product of
    inner size E·r per matrix and layer, 2·I·O·E·r (the weighting and the optimizer's elementwise update are not
    counted)."""
    _check(directions=directions, rank=rank)
    return cfg.num_layers * sum(2 * i * o * directions * rank for i, o in _layer_matrices(cfg))
