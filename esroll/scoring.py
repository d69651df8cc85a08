"""Scoring given completions: the log-probability of each completion token under the model, from one forward over
prompt and completion, differentiable.

The values are those `esroll.sampling.generate` reports as `Generation.logprobs` (log-softmax of the raw logits:
temperature 1, no top-k or top-p), so the two compare one policy at two parameter values (GRPO's π_θ against π_old).
Not jitted and free of Python control flow on values: a caller jits and differentiates it inside its own step, `cfg`
and the keyword settings being Python values that shape the program.

Memory: the output head runs on the completion positions only, `chunk` positions at a time under `jax.checkpoint`, so
no [B, T, V] logits buffer is ever held, in the forward or in the backward pass.

Shape letters (see `esroll`): B rows, P padded prompt length, N completion tokens, T positions (P + N), D model width,
V vocabulary, C chunks of the completion tokens, Z tokens per chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from esroll.models import ModelConfig, Perturbation, forward
from esroll.models.transformer import head

Array = jax.Array


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
    Z = max(1, min(chunk, N))  # the length of a chunk
    C = -(-N // Z)  # chunks
    pad = C * Z - N
    hidden_BxNxD = jnp.pad(hidden_BxNxD, ((0, 0), (0, pad), (0, 0)))
    tokens_BxN = jnp.pad(tokens_BxN, ((0, 0), (0, pad)))
    hidden_CxBxZxD = hidden_BxNxD.reshape(B, C, Z, D).swapaxes(0, 1)
    tokens_CxBxZ = tokens_BxN.reshape(B, C, Z).swapaxes(0, 1)

    @jax.checkpoint
    def one_chunk(xs):
        h_BxZxD, tokens_BxZ = xs
        logits_BxZxV = head(cfg, params, h_BxZxD, perturb)
        lse_BxZ = jax.nn.logsumexp(logits_BxZxV, axis=-1)
        token_logit_BxZ = jnp.take_along_axis(logits_BxZxV, tokens_BxZ[..., None], -1)[..., 0]
        if not with_entropy:
            return token_logit_BxZ - lse_BxZ, None
        # H = logsumexp(z) - Σ softmax(z)·z, of the logits without their gradient (a metric).
        logits_BxZxV = jax.lax.stop_gradient(logits_BxZxV)
        sg_lse_BxZ = jax.lax.stop_gradient(lse_BxZ)
        probs_BxZxV = jnp.exp(logits_BxZxV - sg_lse_BxZ[..., None])
        entropy_BxZ = sg_lse_BxZ - jnp.sum(probs_BxZxV * logits_BxZxV, axis=-1)
        return token_logit_BxZ - lse_BxZ, entropy_BxZ

    if C == 1:
        logprobs_CxBxZ, entropy_CxBxZ = jax.tree.map(lambda y: y[None], one_chunk((hidden_CxBxZxD[0], tokens_CxBxZ[0])))
    else:
        logprobs_CxBxZ, entropy_CxBxZ = jax.lax.map(one_chunk, (hidden_CxBxZxD, tokens_CxBxZ))

    def unchunk(y_CxBxZ):
        return y_CxBxZ.swapaxes(0, 1).reshape(B, C * Z)[:, :N]

    return unchunk(logprobs_CxBxZ), None if entropy_CxBxZ is None else unchunk(entropy_CxBxZ)
