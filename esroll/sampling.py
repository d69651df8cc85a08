"""Autoregressive generation: one prefill, then a KV-cache decode loop that stops once every row has finished.

Rows may belong to different ES population members: `perturb` (an `esroll.models.Perturbation`) is handed to every
forward, prefill and decode alike, so each row sees its member's weights in every matmul of every step. The factors
are whatever the caller built, once per call; nothing here draws or rebuilds them.

Shapes (batch, padded prompt length, `max_new_tokens`) and the sampling settings are static; parameters, factors,
keys, EOS ids and the pad id are traced. A training run thus compiles `generate` once per prompt-length bucket
(`pad_prompts`), not once per step.

Shape letters (see `esroll`): B rows, P padded prompt length, N new tokens, T positions, S cache slots, V vocabulary.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from esroll.models import STACKED, KVCache, ModelConfig, Perturbation, forward, init_cache, unstack_layers
from esroll.models.layers import fuse_matmuls

Array = jax.Array


class Generation(NamedTuple):
    """What `generate` returns. Columns after a row's EOS hold `pad_id` and log-probability 0.

    `logprobs` is log-softmax of the model's raw logits (temperature 1, no top-k/top-p filtering) at each sampled
    token: the policy's own probability, which GRPO needs as π_old, not the probability under the sampler's
    tempered and truncated distribution.
    """

    tokens: Array  # [B, N] int32
    logprobs: Array  # [B, N] float32
    lengths: Array  # [B] int32: tokens generated, EOS included
    steps: Array  # int32 scalar: decode steps run (< N when every row hit EOS early)


def pad_prompts(
    prompts: Sequence[Sequence[int]], *, multiple: int = 16, rows: int | None = None, pad_id: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad token-id lists into (tokens [rows, P] int32, mask [rows, P] bool).

    P is the longest prompt rounded up to a multiple of `multiple`, so varying prompt lengths fall into a few
    buckets and each bucket compiles once; a large `multiple` (the dataset's longest prompt) gives one compile.
    With `rows`, the batch is filled up with empty rows (all mask False), which `generate` treats as finished.
    """
    rows = len(prompts) if rows is None else rows
    if len(prompts) > rows:
        raise ValueError(f"{len(prompts)} prompts do not fit in {rows} rows")
    longest = max((len(p) for p in prompts), default=1)
    length = multiple * max(1, math.ceil(longest / multiple))
    tokens = np.full((rows, length), pad_id, np.int32)
    mask = np.zeros((rows, length), bool)
    for i, p in enumerate(prompts):
        if len(p):
            tokens[i, length - len(p) :] = p
            mask[i, length - len(p) :] = True
    return tokens, mask


def generate(
    cfg: ModelConfig,
    params: dict,
    prompt_BxP: Array,
    key: Array,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_ids: Sequence[int] = (),
    prompt_mask: Array | None = None,
    perturb: Perturbation | None = None,
    pad_id: int = 0,
    cache_dtype=None,
    fuse: bool | None = None,
) -> Generation:
    """Sample up to `max_new_tokens` per row after left-padded prompts (`prompt_mask` False on pads).

    temperature 0 is greedy; top_k 0 and top_p 1 disable those filters. A row finishes at its first token in
    `eos_ids`; the loop exits when all rows have. Rows whose prompt is all padding count as finished from the start.
    The KV cache is kept in `cache_dtype` (default: the embedding's dtype).

    `fuse` chooses how the decode loop runs its matmuls: True prepares fused weights once per call
    (`esroll.models.layers.fuse_matmuls`: projections that share an input side by side, small populations' low-rank
    factors folded in), which pays on a CPU, where per-GEMM overhead dominates a decode step of a small model; False
    runs every weight as it is stored, with per-row low-rank terms (no extra copies of the weights, the accelerator
    path). None (default) picks True on the CPU backend and False elsewhere. Both give the same tokens up to float
    rounding.

    When `prompt_BxP` is split by rows over a mesh (a NamedSharding whose first dimension is sharded), each device
    decodes its own rows in its own loop (`shard_map`): no value crosses devices until the loop ends, and a device
    whose rows have all finished stops early. Sampling noise is drawn per (key, row, step), so the output is the same
    however the rows are split.
    """
    B, P = prompt_BxP.shape
    mesh, axis = _row_split(prompt_BxP)
    mask_BxP = jnp.ones((B, P), bool) if prompt_mask is None else jnp.asarray(prompt_mask, bool)
    return _generate(
        cfg,
        params,
        jnp.asarray(prompt_BxP, jnp.int32),
        mask_BxP,
        key,
        perturb,
        eos_ids=jnp.asarray(list(eos_ids) or [-1], jnp.int32),
        pad_id=jnp.int32(pad_id),
        max_new_tokens=int(max_new_tokens),
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k),
        cache_dtype=jnp.dtype(cache_dtype or params["embed"].dtype),
        fuse=jax.default_backend() == "cpu" if fuse is None else bool(fuse),
        mesh=mesh,
        axis=axis,
    )


def _row_split(x) -> tuple[Mesh | None, str | tuple | None]:
    """The mesh and axis (or axes) that split `x`'s rows over more than one device; (None, None) otherwise."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or not sharding.spec or sharding.spec[0] is None:
        return None, None
    axis = sharding.spec[0]
    names = axis if isinstance(axis, tuple) else (axis,)
    if math.prod(sharding.mesh.shape[n] for n in names) == 1:
        return None, None
    return sharding.mesh, axis


_STATIC = ("cfg", "max_new_tokens", "temperature", "top_p", "top_k", "cache_dtype", "fuse", "mesh", "axis")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _generate(
    cfg,
    params,
    prompt_BxP,
    mask_BxP,
    key,
    perturb,
    *,
    eos_ids,
    pad_id,
    max_new_tokens,
    temperature,
    top_p,
    top_k,
    cache_dtype,
    fuse,
    mesh,
    axis,
) -> Generation:
    decode = functools.partial(
        _decode,
        cfg,
        eos_ids=eos_ids,
        pad_id=pad_id,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        cache_dtype=cache_dtype,
        fuse=fuse,
        axis=axis,
    )
    if mesh is not None:
        rows, same = PartitionSpec(axis), PartitionSpec()
        perturb_spec = None if perturb is None else Perturbation(same, rows)
        decode = jax.shard_map(
            decode,
            mesh=mesh,
            in_specs=(same, rows, rows, same, perturb_spec),
            out_specs=Generation(rows, rows, rows, rows),
            check_vma=False,
        )
    gen = decode(params, prompt_BxP, mask_BxP, key, perturb)
    return gen._replace(steps=gen.steps.max())  # one count per device under shard_map


def _decode(
    cfg,
    params,
    prompt_BxP,
    mask_BxP,
    key,
    perturb,
    *,
    eos_ids,
    pad_id,
    max_new_tokens,
    temperature,
    top_p,
    top_k,
    cache_dtype,
    fuse,
    axis,
) -> Generation:
    """Prefill and decode loop over the rows at hand: all of them, or (under `shard_map` over `axis`) one device's
    share, which is the `axis_index`-th block of B rows."""
    B, P = prompt_BxP.shape
    N = max_new_tokens
    # Global row indices, which key each row's sampling noise: the split hands device i rows [i·B, (i+1)·B).
    rows_B = jnp.arange(B, dtype=jnp.int32) + (0 if axis is None else jax.lax.axis_index(axis) * B)
    # Per-layer weights and factors, sliced (and fused) once here rather than in every decode step.
    deltas = {} if perturb is None else perturb.deltas
    layer_deltas = deltas.get(STACKED) or {}
    layers = zip(unstack_layers(params[STACKED], cfg.num_layers), unstack_layers(layer_deltas, cfg.num_layers))
    prepare = fuse_matmuls if fuse else lambda p, d: (p, d)
    layers, layer_deltas = zip(*(prepare(p, d) for p, d in layers))
    params, deltas = prepare({**params, STACKED: list(layers)}, {**deltas, STACKED: list(layer_deltas)})
    if perturb is not None:
        perturb = perturb._replace(deltas=deltas)
    cache = init_cache(cfg, B, P - 1, cache_dtype)
    # Prefill all but the last prompt token; its logits go unused, so XLA drops the [B, P, V] head. The last prompt
    # token is the first decode step's input (left padding makes it real in every non-empty row).
    _, cache = forward(cfg, params, prompt_BxP[:, :-1], mask_BxT=mask_BxP[:, :-1], cache=cache, perturb=perturb)

    def step(state):
        t, cache, token_B, tokens_BxN, logprobs_BxN, length_B, done_B = state
        logits_Bx1xV, cache = forward(cfg, params, token_B[:, None], cache=cache, perturb=perturb)
        logits_BxV = logits_Bx1xV[:, 0]
        max_B = logits_BxV.max(-1)
        keys_B = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.fold_in(key, t), rows_B)
        new_B = _sample(logits_BxV, max_B, keys_B, temperature, top_k, top_p)
        logsumexp_B = max_B + jnp.log(jnp.exp(logits_BxV - max_B[:, None]).sum(-1))
        logprob_B = jnp.take_along_axis(logits_BxV, new_B[:, None], -1)[:, 0] - logsumexp_B
        new_B = jnp.where(done_B, pad_id, new_B)
        tokens_BxN = jax.lax.dynamic_update_slice(tokens_BxN, new_B[:, None], (0, t))
        logprobs_BxN = jax.lax.dynamic_update_slice(logprobs_BxN, jnp.where(done_B, 0.0, logprob_B)[:, None], (0, t))
        length_B = length_B + ~done_B
        done_B = done_B | jnp.isin(new_B, eos_ids)
        return t + 1, cache, new_B, tokens_BxN, logprobs_BxN, length_B, done_B

    state = (
        jnp.zeros((), jnp.int32),
        cache,
        prompt_BxP[:, -1],
        jnp.full((B, N), pad_id, jnp.int32),
        jnp.zeros((B, N), jnp.float32),
        jnp.zeros((B,), jnp.int32),
        ~mask_BxP.any(-1),
    )
    # Decode in phases, the cache growing between them: a step of phase c attends over the slots phase c can have
    # filled, not over all P - 1 + N, which cuts the keys and values read per step by about a quarter at 4 phases.
    # Each phase is its own loop (and its own copy of the step in the compiled program).
    for end in _phase_ends(N):
        t, cache, *rest = state
        state = (t, _grow(cache, P - 1 + end), *rest)
        state = jax.lax.while_loop(lambda s, end=end: (s[0] < end) & ~jnp.all(s[-1]), step, state)
    t, _, _, tokens_BxN, logprobs_BxN, length_B, _ = state
    return Generation(tokens_BxN, logprobs_BxN, length_B, t[None])


def _phase_ends(n: int, phases: int = 4, shortest: int = 16) -> list[int]:
    """Step counts at which the decode phases end: up to `phases` equal phases of at least `shortest` steps."""
    k = max(1, min(phases, n // shortest))
    return [math.ceil(n * (i + 1) / k) for i in range(k)]


def _grow(cache: KVCache, slots: int) -> KVCache:
    """The cache with room for `slots` slots (new ones empty)."""
    extra = slots - cache.valid_BxS.shape[1]
    return KVCache(
        k=tuple(jnp.pad(k, ((0, 0), (0, 0), (0, 0), (0, extra))) for k in cache.k),
        v=tuple(jnp.pad(v, ((0, 0), (0, 0), (0, extra), (0, 0))) for v in cache.v),
        valid_BxS=jnp.pad(cache.valid_BxS, ((0, 0), (0, extra))),
        index=cache.index,
    )


def _sample(logits_BxV: Array, max_B: Array, keys_B: Array, temperature: float, top_k: int, top_p: float) -> Array:
    """One token per row: argmax at temperature 0, else a draw from the tempered, top-k then top-p truncated softmax.

    `max_B` is the row maximum of the logits, which the caller needs anyway for the log-probabilities; `keys_B` one
    key per row, so that a row's draw does not depend on which other rows share its batch.
    """
    if temperature == 0:
        return _argmax(logits_BxV, max_B)
    logits_BxV = logits_BxV / temperature
    if top_k:
        kth_Bx1 = jax.lax.top_k(logits_BxV, top_k)[0][:, -1:]
        logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
    if top_p < 1:
        # Keep the smallest prefix of the descending order whose mass reaches top_p (always at least one token).
        sorted_BxV = -jnp.sort(-logits_BxV, -1)
        probs_BxV = jax.nn.softmax(sorted_BxV, -1)
        mass_before_BxV = jnp.cumsum(probs_BxV, -1) - probs_BxV
        keep_B = jnp.sum(mass_before_BxV < top_p, -1)
        cutoff_Bx1 = jnp.take_along_axis(sorted_BxV, keep_B[:, None] - 1, -1)
        logits_BxV = jnp.where(logits_BxV < cutoff_Bx1, -jnp.inf, logits_BxV)
    # The Gumbel-max trick, as jax.random.categorical draws.
    gumbel = functools.partial(jax.random.gumbel, shape=logits_BxV.shape[1:], dtype=logits_BxV.dtype)
    perturbed_BxV = logits_BxV + jax.vmap(gumbel)(keys_B)
    return _argmax(perturbed_BxV, perturbed_BxV.max(-1))


def _argmax(x_BxV: Array, max_B: Array) -> Array:
    """The first index of each row's maximum, as jnp.argmax, from two plain reductions.

    XLA's CPU backend compiles jnp.argmax (one reduction over value-index pairs) into a scalar loop that costs as much
    as a quarter of a small model's decode step; a max and a min over indices vectorise.
    """
    V = x_BxV.shape[-1]
    # Indices as float32 (exact below 2**24) so that the min is a float reduction, which XLA's CPU backend hands to
    # a vectorised library kernel; integer ones it does not.
    iota_V = jnp.arange(V, dtype=jnp.float32)
    return jnp.min(jnp.where(x_BxV == max_B[:, None], iota_V, float(V)), -1).astype(jnp.int32)


def sequence_logprobs(
    cfg: ModelConfig,
    params: dict,
    prompt_BxP: Array,
    prompt_mask_BxP: Array,
    completion_BxN: Array,
    completion_mask_BxN: Array,
    *,
    perturb: Perturbation | None = None,
) -> Array:
    """Log-probability [B, N] of each completion token given its prefix, from one full forward over prompt+completion.

    Raw logits (temperature 1), as `Generation.logprobs`; 0 where the completion mask is False. Not jitted and free
    of Python control flow on values, so GRPO can differentiate it inside its own jitted step.
    """
    P = prompt_BxP.shape[1]
    tokens_BxT = jnp.concatenate([prompt_BxP, completion_BxN], 1)
    mask_BxT = jnp.concatenate([prompt_mask_BxP, completion_mask_BxN], 1).astype(bool)
    logits_BxTxV, _ = forward(cfg, params, tokens_BxT, mask_BxT=mask_BxT, perturb=perturb)
    # The logits at position P-1+j predict completion token j.
    logprobs_BxNxV = jax.nn.log_softmax(logits_BxTxV[:, P - 1 : -1])
    logprobs_BxN = jnp.take_along_axis(logprobs_BxNxV, completion_BxN[..., None], -1)[..., 0]
    return jnp.where(completion_mask_BxN, logprobs_BxN, 0.0)
