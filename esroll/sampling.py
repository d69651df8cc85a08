"""Autoregressive generation: one prefill, then a KV-cache decode loop that stops once every row has finished.

Rows may belong to different ES population members: `perturb` (an `esroll.models.Perturbation`) is handed to every
forward, prefill and decode alike, so each row sees its member's weights in every matmul of every step. The factors
are whatever the caller built, once per call; nothing here draws or rebuilds them.

Shapes (batch, padded prompt length, `max_new_tokens`), the sampling settings, `phases` and `unroll` are static;
parameters, factors, keys, EOS ids, the pad id and the row offset are traced. A training run
thus compiles `generate` once per prompt-length bucket (`pad_prompts`) and chunk size, not once per step or chunk.

Shape letters (see `esroll`): B rows, P padded prompt length, N new tokens, T positions, S cache slots, V vocabulary.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from esroll.models import KVCache, ModelConfig, Perturbation, forward, init_cache
from esroll.models.transformer import head

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
) -> Generation:
    """Sample up to `max_new_tokens` per row after left-padded prompts (`prompt_mask` False on pads).

    temperature 0 is greedy; top_k 0 and top_p 1 disable those filters. A row finishes at its first token in
    `eos_ids`; the loop exits when all rows have. Rows whose prompt is all padding count as finished from the start.
    The KV cache is kept in `cache_dtype` (default: the embedding's dtype).

    `phases` is the number of decode phases the cache grows in (see `_phase_ends`); `unroll` the layers per iteration
    of the model's layer scan (`esroll.models.forward`: a speed knob; the values do not depend on it beyond float
    rounding). Every platform runs the same program: one layer-stacked cache, the layers under `lax.scan`, each row's
    low-rank factors gathered once per call (`Perturbation.per_row`), the weights as stored.

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


MODEL_AXIS = "model"  # the mesh axis parameters are split over (tensor parallelism), see `esroll.parallel`


def _arguments(
    cfg,
    params,
    prompt_BxP,
    key,
    *,
    max_new_tokens,
    temperature,
    top_p,
    top_k,
    eos_ids,
    prompt_mask,
    perturb,
    pad_id,
    cache_dtype,
    phases,
    row_offset,
    unroll,
) -> tuple[tuple, dict]:
    """`_generate`'s arguments (traced ones positional, static ones by keyword) from `generate`'s."""
    B, P = prompt_BxP.shape
    mesh, axis = _row_split(prompt_BxP)
    model_mesh = _model_split(prompt_BxP)
    if model_mesh is not None:  # GSPMD: `axis` is where the rows are (if anywhere), for the cache's constraints
        mesh, axis = model_mesh, prompt_BxP.sharding.spec[0] if prompt_BxP.sharding.spec else None
    if prompt_mask is None:
        prompt_mask = (
            jax.ShapeDtypeStruct((B, P), bool, sharding=prompt_BxP.sharding)
            if isinstance(prompt_BxP, jax.ShapeDtypeStruct)
            else jnp.ones((B, P), bool)
        )
    args = (
        params,
        _traced(prompt_BxP, jnp.int32),
        _traced(prompt_mask, bool),
        key,
        perturb,
        _traced(row_offset, jnp.int32),
    )
    kwargs = {
        "cfg": cfg,
        "eos_ids": jnp.asarray(list(eos_ids) or [-1], jnp.int32),
        "pad_id": jnp.int32(pad_id),
        "max_new_tokens": int(max_new_tokens),
        "temperature": float(temperature),
        "top_p": float(top_p),
        "top_k": int(top_k),
        "cache_dtype": jnp.dtype(cache_dtype or params["embed"].dtype),
        "phases": int(phases),
        "unroll": int(unroll),
        "mesh": mesh,
        "axis": axis,
        "tensor_parallel": model_mesh is not None,
    }
    return args, kwargs


def _traced(x, dtype):
    """x as an array of `dtype`; a ShapeDtypeStruct (ahead-of-time lowering) as it is, if of that dtype."""
    if isinstance(x, jax.ShapeDtypeStruct):
        if x.dtype != jnp.dtype(dtype):
            raise TypeError(f"expected a ShapeDtypeStruct of {jnp.dtype(dtype)}, got {x.dtype}")
        return x
    return jnp.asarray(x, dtype)


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


def _model_split(x) -> Mesh | None:
    """The mesh of `x`'s NamedSharding when it has a "model" axis of more than one device; None otherwise."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh.shape.get(MODEL_AXIS, 1) == 1:
        return None
    return sharding.mesh


_STATIC = (
    "cfg",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "cache_dtype",
    "phases",
    "unroll",
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
    mesh,
    axis,
    tensor_parallel,
) -> Generation:
    """`generate` proper. `mesh` and `axis`: where the rows are split (None: on one device, or replicated); with
    `tensor_parallel`, the mesh has a "model" axis and the program is partitioned by GSPMD instead of `shard_map`."""
    constrain = None
    if tensor_parallel:
        constrain = functools.partial(_constrain_cache, cfg=cfg, mesh=mesh, rows=axis)
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


def _constrain(x, *spec, mesh):
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))


def _constrain_cache(cache: KVCache, *, cfg, mesh, rows) -> KVCache:
    """The cache with its rows over `rows` (the prompt's row axis, or None) and its kv heads over the model axis
    (replicated when the model axis does not divide the kv heads, or already splits the rows), for GSPMD."""
    row_names = rows if isinstance(rows, tuple) else (rows,)
    split = cfg.num_kv_heads % mesh.shape[MODEL_AXIS] == 0 and MODEL_AXIS not in row_names
    heads = MODEL_AXIS if split else None
    at = functools.partial(_constrain, mesh=mesh)
    spec = (None, rows, None, heads, None)  # [L, B, S, K, H]
    return KVCache(at(cache.k, *spec), at(cache.v, *spec), valid_BxS=at(cache.valid_BxS, rows, None), index=cache.index)


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
    axis,
    constrain,
) -> Generation:
    """Prefill and decode loop over the rows at hand: all of them, or (under `shard_map` over `axis`) one device's
    share, which is the `axis_index`-th block of B rows. `constrain` (or None) places each new cache (GSPMD)."""
    B, P = prompt_BxP.shape
    N = max_new_tokens
    constrain = constrain or (lambda cache: cache)
    # Global row indices, which key each row's sampling noise: the split hands device i rows [i·B, (i+1)·B) of the
    # caller's, which are themselves rows [row_offset, row_offset + B·devices) of a larger batch.
    rows_B = jnp.arange(B, dtype=jnp.int32) + row_offset + (0 if axis is None else jax.lax.axis_index(axis) * B)
    if perturb is not None:  # each row's factors gathered here once, not in every layer of every decode step
        perturb = perturb.per_row()
    run = functools.partial(forward, cfg, params, perturb=perturb, unroll=unroll)
    cache = constrain(init_cache(cfg, B, P - 1, cache_dtype))
    # Prefill all but the last prompt token; its logits go unused, so XLA drops the [B, P, V] head. The last prompt
    # token is the first decode step's input (left padding makes it real in every non-empty row).
    _, cache = run(prompt_BxP[:, :-1], mask_BxT=mask_BxP[:, :-1], cache=cache)
    cache = constrain(cache)

    def step(state):
        t, cache, token_B, tokens_BxN, logprobs_BxN, length_B, done_B = state
        logits_Bx1xV, cache = run(token_B[:, None], cache=cache)
        cache = constrain(cache)
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
    for end in _phase_ends(N, phases):
        t, cache, *rest = state
        state = (t, constrain(_grow(cache, P - 1 + end)), *rest)
        state = jax.lax.while_loop(lambda s, end=end: (s[0] < end) & ~jnp.all(s[-1]), step, state)
    t, _, _, tokens_BxN, logprobs_BxN, length_B, _ = state
    return Generation(tokens_BxN, logprobs_BxN, length_B, t[None])


def _phase_ends(n: int, phases: int = 4, shortest: int = 16) -> list[int]:
    """Step counts at which the decode phases end: up to `phases` equal phases of at least `shortest` steps."""
    k = max(1, min(phases, n // shortest))
    return [math.ceil(n * (i + 1) / k) for i in range(k)]


def _grow(cache: KVCache, slots: int) -> KVCache:
    """The cache with room for `slots` slots (new ones empty): axis 2 of the keys and values [L, B, S, K, H]."""
    extra = slots - cache.valid_BxS.shape[1]

    def pad(x, axis):
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, extra)
        return jnp.pad(x, widths)

    return KVCache(pad(cache.k, 2), pad(cache.v, 2), valid_BxS=pad(cache.valid_BxS, 1), index=cache.index)


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


def sequence_logprobs(
    cfg: ModelConfig,
    params: dict,
    prompt_BxP: Array,
    prompt_mask_BxP: Array,
    completion_BxN: Array,
    completion_mask_BxN: Array,
    *,
    perturb: Perturbation | None = None,
    remat: str | None = None,
    chunk: int = 0,
    with_entropy: bool = False,
    layer_params=None,
    unroll: int = 1,
) -> Array | tuple[Array, Array]:
    """Log-probability [B, N] of each completion token given its prefix, from one full forward over prompt+completion;
    with `with_entropy`, also the entropy [B, N] of the whole next-token distribution at each completion position.

    Raw logits (temperature 1), as `Generation.logprobs`; 0 where the completion mask is False. Not jitted and free
    of Python control flow on values, so GRPO can differentiate it inside its own jitted step.

    Memory: the decoder runs to its final hidden states only (`forward(return_hidden=True)`), and the head is applied
    to the N positions that predict completion tokens (P-1 .. P+N-2; never the prompt's), `chunk` positions at a time
    (0 = all N at once), each chunk under `jax.checkpoint`: the largest logits buffer is [B, chunk, V] float32, in the
    forward and in the backward pass (which recomputes a chunk's logits instead of keeping them). At V ~ 150k the
    whole-sequence [B, T, V] float32 logits and log-softmax would dominate the step's memory. `remat` is the decoder's
    per-layer rematerialisation (`esroll.models.transformer.REMAT_POLICIES`), `layer_params` its per-layer map of the
    weights, `unroll` its layers per scan iteration (`forward`). The entropy is a
    metric: it carries no gradient.
    """
    P, N = prompt_BxP.shape[1], completion_BxN.shape[1]
    tokens_BxT = jnp.concatenate([prompt_BxP, completion_BxN], 1)
    mask_BxT = jnp.concatenate([prompt_mask_BxP, completion_mask_BxN], 1).astype(bool)
    hidden_BxTxD, _ = forward(
        cfg,
        params,
        tokens_BxT,
        mask_BxT=mask_BxT,
        perturb=perturb,
        remat=remat,
        return_hidden=True,
        layer_params=layer_params,
        unroll=unroll,
    )
    # The hidden state at position P-1+j predicts completion token j.
    logprobs_BxN, entropy_BxN = _completion_logprobs(
        cfg, params, hidden_BxTxD[:, P - 1 : -1], completion_BxN, perturb, chunk or N, with_entropy
    )
    logprobs_BxN = jnp.where(completion_mask_BxN, logprobs_BxN, 0.0)
    if not with_entropy:
        return logprobs_BxN
    return logprobs_BxN, jnp.where(completion_mask_BxN, entropy_BxN, 0.0)


def _completion_logprobs(
    cfg: ModelConfig,
    params: dict,
    hidden_BxNxD: Array,
    tokens_BxN: Array,
    perturb: Perturbation | None,
    chunk: int,
    with_entropy: bool,
) -> tuple[Array, Array | None]:
    """log softmax(head(h))[token] and, with_entropy, the entropy of softmax(head(h)), [B, N] each, over chunks of
    `chunk` positions (a `lax.map`; N is zero-padded up to a multiple, and the padding sliced off). Each chunk runs
    under `jax.checkpoint`, so only its hidden states and outputs outlive it."""
    B, N, D = hidden_BxNxD.shape
    C = max(1, min(chunk, N))
    n_chunks = -(-N // C)
    pad = n_chunks * C - N
    hidden_BxNxD = jnp.pad(hidden_BxNxD, ((0, 0), (0, pad), (0, 0)))
    tokens_BxN = jnp.pad(tokens_BxN, ((0, 0), (0, pad)))
    hidden_KxBxCxD = hidden_BxNxD.reshape(B, n_chunks, C, D).swapaxes(0, 1)
    tokens_KxBxC = tokens_BxN.reshape(B, n_chunks, C).swapaxes(0, 1)

    @jax.checkpoint
    def one_chunk(xs):
        h_BxCxD, tokens_BxC = xs
        logits_BxCxV = head(cfg, params, h_BxCxD, perturb)
        lse_BxC = jax.nn.logsumexp(logits_BxCxV, axis=-1)
        token_logit_BxC = jnp.take_along_axis(logits_BxCxV, tokens_BxC[..., None], -1)[..., 0]
        if not with_entropy:
            return token_logit_BxC - lse_BxC, None
        # H = logsumexp(z) - Σ softmax(z)·z, of the logits without their gradient (a metric).
        logits_BxCxV = jax.lax.stop_gradient(logits_BxCxV)
        sg_lse_BxC = jax.lax.stop_gradient(lse_BxC)
        probs_BxCxV = jnp.exp(logits_BxCxV - sg_lse_BxC[..., None])
        entropy_BxC = sg_lse_BxC - jnp.sum(probs_BxCxV * logits_BxCxV, axis=-1)
        return token_logit_BxC - lse_BxC, entropy_BxC

    if n_chunks == 1:
        logprobs_KxBxC, entropy_KxBxC = jax.tree.map(lambda y: y[None], one_chunk((hidden_KxBxCxD[0], tokens_KxBxC[0])))
    else:
        logprobs_KxBxC, entropy_KxBxC = jax.lax.map(one_chunk, (hidden_KxBxCxD, tokens_KxBxC))

    def unchunk(y_KxBxC):
        return y_KxBxC.swapaxes(0, 1).reshape(B, n_chunks * C)[:, :N]

    return unchunk(logprobs_KxBxC), None if entropy_KxBxC is None else unchunk(entropy_KxBxC)
