"""Autoregressive generation: one prefill, then a KV-cache decode loop that stops once every row has finished.

Rows may belong to different ES population members: `perturb` (an `esroll.models.Perturbation`) is handed to every
forward, prefill and decode alike, so each row sees its member's weights in every matmul of every step. The factors
are whatever the caller built, once per call; nothing here draws or rebuilds them.

Shapes (batch, padded prompt length, `max_new_tokens`), the sampling settings, `phases` and `unroll` are static;
parameters, factors, keys, EOS ids, the pad id and the row offset are traced. A training run
thus compiles `generate` once per prompt-length bucket (`pad_prompts`) and chunk size, not once per step or chunk.

The scoring of given completions (`sequence_logprobs`) is `esroll.scoring`; how
`generate`'s arguments split into traced and static ones, and where its rows and KV cache sit on a mesh, is
`esroll.sampling_layout`.

Shape letters (see `esroll`): B rows, P padded prompt length, N new tokens, T positions, S cache slots, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from esroll.models import ModelConfig, Perturbation, forward, init_cache
from esroll.sampling_layout import _arguments, _constrain, _constrain_cache, _shards

__all__ = ["Generation", "draw", "generate", "lower_generate", "pad_prompts"]

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
    phases: int = 4,
    row_offset: int | Array = 0,
    unroll: int = 1,
    member_slots: int | None = None,
) -> Generation:
    """Sample up to `max_new_tokens` per row after left-padded prompts (`prompt_mask` False on pads).

    temperature 0 is greedy; top_k 0 and top_p 1 disable those filters. A row finishes at its first token in
    `eos_ids`; the loop exits when all rows have. Rows whose prompt is all padding count as finished from the start.
    The KV cache is kept in `cache_dtype` (default: the embedding's dtype).

    `phases` is the number of decode phases, each attending over the cache slots it can have filled (`_phase_ends`); `unroll` the layers per iteration
    of the model's layer scan (`esroll.models.forward`: a speed knob; the values do not depend on it beyond float
    rounding). Every platform runs the same program: one layer-stacked cache, the layers under `lax.scan`, the
    perturbation's factors gathered once per call (below), the weights as stored.

    A member-level `perturb` is turned, once per call, into member tables (`Perturbation.tables`): each device's rows
    read the factors of the distinct members among them, U of them (`member_slots`), once per decode step, however
    many rows each member has. U is computed from `perturb.member_B` when its values are at hand (the most distinct
    members on any device, `esroll.models.member_slots`); a caller that decodes a larger batch in chunks passes the
    bound of all its chunks, so that they share one compilation, and lowering ahead of time needs it given. A U that
    the rows at hand exceed is refused. 0 (or a bound not below a device's rows) gathers each row's factors instead
    (`Perturbation.per_row`).

    Sampling noise is drawn per (key, global row index, step), the global index of row b being `row_offset` + b: a
    caller that decodes rows [o, o + B) of a larger batch in chunks passes row_offset=o and gets exactly the tokens
    the whole batch's call gives those rows. `row_offset` is traced, so chunks of one shape share one compilation.

    When `prompt_BxP` is split by rows over a mesh (a NamedSharding whose first dimension is sharded) and the mesh has
    no "model" axis of more than one device, each device decodes its own rows in its own loop (`shard_map`): no value
    crosses devices until the loop ends, and a device whose rows have all finished stops early. When the mesh does
    have such a model axis (tensor parallelism: parameters, and so their per-device shards, split over "model"),
    `shard_map`'s per-device program, which assumes whole parameters, does not apply: the prefill and decode loop run
    as one program partitioned by XLA (GSPMD) from the inputs' shardings, rows as the prompt's, parameters as theirs,
    and the KV cache constrained to rows over the prompt's row axis and kv heads over "model" (replicated when the
    kv heads do not divide evenly). Either way the output is the same however the rows are split.
    """
    args, kwargs = _arguments(
        cfg,
        params,
        prompt_BxP,
        key,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        eos_ids=eos_ids,
        prompt_mask=prompt_mask,
        perturb=perturb,
        pad_id=pad_id,
        cache_dtype=cache_dtype,
        phases=phases,
        row_offset=row_offset,
        unroll=unroll,
        member_slots=member_slots,
    )
    return _generate(*args, **kwargs)


def lower_generate(cfg: ModelConfig, params: dict, prompt_BxP, key, **kwargs) -> jax.stages.Lowered:
    """The program `generate` runs for these arguments, lowered ahead of time (`.compile()` it, or read its text).

    Takes what `generate` takes (its keyword arguments included), and also `jax.ShapeDtypeStruct`s in place of
    arrays (params, prompt, mask, key, perturbation, row_offset), with their shardings: how the rows are split, and
    whether by a "model" axis, is read from the prompt's sharding as `generate` reads it. For a deviceless target
    (`jax.experimental.topologies`) pass a mesh of the topology's devices in the shardings.
    """
    bound = inspect.signature(generate).bind(cfg, params, prompt_BxP, key, **kwargs)
    bound.apply_defaults()  # generate's defaults, declared once
    args, kw = _arguments(**bound.arguments)
    return _generate.lower(*args, **kw)


_STATIC = (
    "cfg",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "cache_dtype",
    "phases",
    "unroll",
    "slots",
    "mesh",
    "axis",
    "tensor_parallel",
)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _generate(
    params,
    prompt_BxP,
    mask_BxP,
    key,
    perturb,
    row_offset,
    *,
    cfg,
    eos_ids,
    pad_id,
    max_new_tokens,
    temperature,
    top_p,
    top_k,
    cache_dtype,
    phases,
    unroll,
    slots,
    mesh,
    axis,
    tensor_parallel,
) -> Generation:
    """`generate` proper. `mesh` and `axis`: where the rows are split (None: on one device, or replicated); with
    `tensor_parallel`, the mesh has a "model" axis and the program is partitioned by GSPMD instead of `shard_map`.
    `slots`: the member tables' size (0: per-row factors)."""
    constrain = None
    if tensor_parallel:
        constrain = functools.partial(_constrain_cache, cfg=cfg, mesh=mesh, rows=axis)
    elif mesh is not None:  # a per-device program: the prefill's attention kernel runs as it is, on its rows
        cfg = dataclasses.replace(cfg, attention=cfg.attention.local())
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
        phases=phases,
        unroll=unroll,
        slots=slots,
        blocks=_shards(mesh, axis) if tensor_parallel else 1,
        axis=None if tensor_parallel else axis,
        constrain=constrain,
    )
    if mesh is not None and not tensor_parallel:
        rows, same = PartitionSpec(axis), PartitionSpec()
        perturb_spec = None if perturb is None else Perturbation(same, rows)
        decode = jax.shard_map(
            decode,
            mesh=mesh,
            in_specs=(same, rows, rows, same, perturb_spec, same),
            out_specs=Generation(rows, rows, rows, rows),
            check_vma=False,
        )
    gen = decode(params, prompt_BxP, mask_BxP, key, perturb, row_offset)
    if tensor_parallel:  # the rows of the outputs where the prompt's were
        at = functools.partial(_constrain, mesh=mesh)
        gen = gen._replace(
            tokens=at(gen.tokens, axis, None), logprobs=at(gen.logprobs, axis, None), lengths=at(gen.lengths, axis)
        )
    return gen._replace(steps=gen.steps.max())  # one count per device under shard_map


def _decode(
    cfg,
    params,
    prompt_BxP,
    mask_BxP,
    key,
    perturb,
    row_offset,
    *,
    eos_ids,
    pad_id,
    max_new_tokens,
    temperature,
    top_p,
    top_k,
    cache_dtype,
    phases,
    unroll,
    slots,
    blocks,
    axis,
    constrain,
) -> Generation:
    """Prefill and decode loop over the rows at hand: all of them, or (under `shard_map` over `axis`) one device's
    share, which is the `axis_index`-th block of B rows. `constrain` (or None) places each new cache (GSPMD) and
    the member tables (`slots` entries for each of `blocks` blocks of rows: the devices the rows split over)."""
    B, P = prompt_BxP.shape
    N = max_new_tokens
    constrain = constrain or (lambda cache: cache)
    # Global row indices, which key each row's sampling noise: the split hands device i rows [i·B, (i+1)·B) of the
    # caller's, which are themselves rows [row_offset, row_offset + B·devices) of a larger batch.
    rows_B = jnp.arange(B, dtype=jnp.int32) + row_offset + (0 if axis is None else jax.lax.axis_index(axis) * B)
    if perturb is not None:  # the factors gathered here once, not in every layer of every decode step
        perturb = perturb.tables(slots, blocks) if slots and perturb.member_B is not None else perturb.per_row()
        if perturb.slot_B is not None:
            perturb = constrain(perturb)
    run = functools.partial(forward, cfg, params, perturb=perturb, unroll=unroll)
    # One cache of every slot the call can fill, allocated once: no phase copies it into a larger one.
    cache = constrain(init_cache(cfg, B, P - 1 + N, cache_dtype))
    # Prefill all but the last prompt token (reading no cached slot); its logits go unused, so XLA drops the
    # [B, P, V] head. The last prompt token is the first decode step's input (left padding makes it real in every
    # non-empty row).
    _, cache = run(prompt_BxP[:, :-1], mask_BxT=mask_BxP[:, :-1], cache=cache, attend_slots=0)
    cache = constrain(cache)

    def step(state, slots):
        t, cache, token_B, tokens_BxN, logprobs_BxN, length_B, done_B = state
        logits_Bx1xV, cache = run(token_B[:, None], cache=cache, attend_slots=slots)
        cache = constrain(cache)
        new_B, logprob_B = draw(logits_Bx1xV[:, 0], jax.random.fold_in(key, t), rows_B, temperature, top_k, top_p)
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
    # Decode in phases: a step of phase c attends over the slots phase c can have filled (the cache's first
    # P - 1 + end), not over all P - 1 + N, which cuts the keys and values read per step by about a quarter at 4
    # phases. Each phase is its own loop (and its own copy of the step in the compiled program).
    for end in _phase_ends(N, phases):
        phase = functools.partial(step, slots=P - 1 + end)
        state = jax.lax.while_loop(lambda s, end=end: (s[0] < end) & ~jnp.all(s[-1]), phase, state)
    t, _, _, tokens_BxN, logprobs_BxN, length_B, _ = state
    return Generation(tokens_BxN, logprobs_BxN, length_B, t[None])


def _phase_ends(n: int, phases: int = 4, shortest: int = 16) -> list[int]:
    """Step counts at which the decode phases end: up to `phases` equal phases of at least `shortest` steps."""
    k = max(1, min(phases, n // shortest))
    return [math.ceil(n * (i + 1) / k) for i in range(k)]


def draw(
    logits_BxV: Array,
    key: Array,
    rows_B: Array,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    given_B: Array | None = None,
) -> tuple[Array, Array]:
    """One decode step's token per row (`_sample`, each row's noise keyed by `key` and its global row index), or
    `given_B` when given (teacher forcing), and its log-probability under the raw logits (temperature 1, no
    filtering: the policy's own, as `Generation.logprobs`)."""
    max_B = logits_BxV.max(-1)
    if given_B is None:
        keys_B = jax.vmap(jax.random.fold_in, (None, 0))(key, rows_B)
        given_B = _sample(logits_BxV, max_B, keys_B, temperature, top_k, top_p)
    logsumexp_B = max_B + jnp.log(jnp.exp(logits_BxV - max_B[:, None]).sum(-1))
    return given_B, jnp.take_along_axis(logits_BxV, given_B[:, None], -1)[:, 0] - logsumexp_B


def _sample(logits_BxV: Array, max_B: Array, keys_B: Array, temperature: float, top_k: int, top_p: float) -> Array:
    """One token per row: argmax at temperature 0, else a draw from the tempered, top-k then top-p truncated softmax.

    `max_B` is the row maximum of the logits, which the caller needs anyway for the log-probabilities; `keys_B` one
    key per row, so that a row's draw does not depend on which other rows share its batch.
    """
    if temperature == 0:
        return jnp.argmax(logits_BxV, -1).astype(jnp.int32)
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
    return jnp.argmax(perturbed_BxV, -1).astype(jnp.int32)
