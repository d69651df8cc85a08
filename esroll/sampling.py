"""Autoregressive generation: one prefill, then a KV-cache decode loop that stops once every row has finished.

Rows may belong to different ES population members: `perturb` (an `esroll.models.Perturbation`) is handed to every
forward, prefill and decode alike, so each row sees its member's weights in every matmul of every step. The factors
are whatever the caller built, once per call; nothing here draws or rebuilds them.

Shapes (batch, padded prompt length, `max_new_tokens`) and the sampling settings are static; parameters, factors,
keys, EOS ids and the pad id are traced. A training run thus compiles `generate` once per prompt-length bucket
(`pad_prompts`), not once per step.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from esroll.models import ModelConfig, Perturbation, forward, init_cache

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
) -> Generation:
    """Sample up to `max_new_tokens` per row after left-padded prompts (`prompt_mask` False on pads).

    temperature 0 is greedy; top_k 0 and top_p 1 disable those filters. A row finishes at its first token in
    `eos_ids`; the loop exits when all rows have. Rows whose prompt is all padding count as finished from the start.
    The KV cache is kept in `cache_dtype` (default: the embedding's dtype).
    """
    B, P = prompt_BxP.shape
    mask_BxP = jnp.ones((B, P), bool) if prompt_mask is None else jnp.asarray(prompt_mask, bool)
    return _generate(
        cfg, params, jnp.asarray(prompt_BxP, jnp.int32), mask_BxP, key, perturb,
        eos_E=jnp.asarray(list(eos_ids) or [-1], jnp.int32), pad_id=jnp.int32(pad_id),
        max_new_tokens=int(max_new_tokens), temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
        cache_dtype=jnp.dtype(cache_dtype or params["embed"].dtype),
    )  # fmt: skip


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "max_new_tokens", "temperature", "top_p", "top_k", "cache_dtype"),
)
def _generate(cfg, params, prompt_BxP, mask_BxP, key, perturb, *, eos_E, pad_id, max_new_tokens, temperature, top_p,
              top_k, cache_dtype) -> Generation:  # fmt: skip
    B, P = prompt_BxP.shape
    N = max_new_tokens
    cache = init_cache(cfg, B, P - 1 + N, cache_dtype)
    # Prefill all but the last prompt token; its logits go unused, so XLA drops the [B, P, V] head. The last prompt
    # token is the first decode step's input (left padding makes it real in every non-empty row).
    _, cache = forward(cfg, params, prompt_BxP[:, :-1], mask_BxT=mask_BxP[:, :-1], cache=cache, perturb=perturb)

    def step(state):
        t, cache, token_B, tokens_BxN, logprobs_BxN, length_B, done_B = state
        logits_Bx1xV, cache = forward(cfg, params, token_B[:, None], cache=cache, perturb=perturb)
        logits_BxV = logits_Bx1xV[:, 0]
        new_B = _sample(logits_BxV, jax.random.fold_in(key, t), temperature, top_k, top_p)
        logprob_B = jnp.take_along_axis(jax.nn.log_softmax(logits_BxV), new_B[:, None], -1)[:, 0]
        new_B = jnp.where(done_B, pad_id, new_B)
        tokens_BxN = jax.lax.dynamic_update_slice(tokens_BxN, new_B[:, None], (0, t))
        logprobs_BxN = jax.lax.dynamic_update_slice(logprobs_BxN, jnp.where(done_B, 0.0, logprob_B)[:, None], (0, t))
        length_B = length_B + ~done_B
        done_B = done_B | jnp.isin(new_B, eos_E)
        return t + 1, cache, new_B, tokens_BxN, logprobs_BxN, length_B, done_B

    def running(state):
        t, *_, done_B = state
        return (t < N) & ~jnp.all(done_B)

    state = (
        jnp.zeros((), jnp.int32), cache, prompt_BxP[:, -1],
        jnp.full((B, N), pad_id, jnp.int32), jnp.zeros((B, N), jnp.float32), jnp.zeros((B,), jnp.int32),
        ~mask_BxP.any(-1),
    )  # fmt: skip
    t, _, _, tokens_BxN, logprobs_BxN, length_B, _ = jax.lax.while_loop(running, step, state)
    return Generation(tokens_BxN, logprobs_BxN, length_B, t)


def _sample(logits_BxV: Array, key: Array, temperature: float, top_k: int, top_p: float) -> Array:
    """One token per row: argmax at temperature 0, else a draw from the tempered, top-k then top-p truncated softmax."""
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
    return jax.random.categorical(key, logits_BxV, -1).astype(jnp.int32)


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
