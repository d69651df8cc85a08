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

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from esroll.models import ModelConfig, Perturbation, forward
from esroll.models.transformer import head

Array = jax.Array


class Divergence(NamedTuple):
    """What GKD's divergence reads of a teacher (`sequence_logprobs(divergence=…)`): its model config (a Python value
    that shapes the program), its head's weights (`esroll.teacher.teacher_head`), its final-normed hidden states at
    the completion positions [B, N, D_T] (position n: the state that predicts completion token n), and β."""

    cfg: ModelConfig
    head: dict
    hidden_BxNxD: Array
    beta: float


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
    divergence: Divergence | None = None,
) -> Array | tuple[Array, ...]:
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

    divergence: a teacher's final hidden states at the completion positions and its head (`Divergence`): also GKD's
    generalised JSD [B, N] between the teacher's and the model's whole next-token distribution at each completion
    position (`generalized_jsd`), both heads applied chunk by chunk beside the log-probabilities (so neither [B, N, V]
    log-distribution is ever held: at a real vocabulary the teacher's would be 150k floats per token, its hidden
    state a few thousand), with its gradient (none reaches the teacher). Returns log-probabilities, then the entropy
    (with `with_entropy`), then the divergence (with `divergence`): a tuple when there is more than the first.
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
    logprobs_BxN, entropy_BxN, divergence_BxN = _completion_logprobs(
        cfg, params, hidden_BxTxD[:, P - 1 : -1], completion_BxN, perturb, chunk or N, with_entropy, divergence
    )
    outs = [jnp.where(completion_mask_BxN, logprobs_BxN, 0.0)]
    if with_entropy:
        outs.append(jnp.where(completion_mask_BxN, entropy_BxN, 0.0))
    if divergence is not None:
        outs.append(jnp.where(completion_mask_BxN, divergence_BxN, 0.0))
    return outs[0] if len(outs) == 1 else tuple(outs)


def _completion_logprobs(
    cfg: ModelConfig,
    params: dict,
    hidden_BxNxD: Array,
    tokens_BxN: Array,
    perturb: Perturbation | None,
    chunk: int,
    with_entropy: bool,
    divergence: Divergence | None = None,
) -> tuple[Array, Array | None, Array | None]:
    """log softmax(head(h))[token], with_entropy the entropy of softmax(head(h)), and with `divergence` (a teacher's
    hidden states and head) the generalised JSD to the teacher's distribution, [B, N] each, over chunks of `chunk`
    positions (a `lax.map`; N is zero-padded up to a multiple, and the padding sliced off). Each chunk runs under
    `jax.checkpoint`, so only its hidden states and outputs outlive it."""
    B, N, D = hidden_BxNxD.shape
    Z = max(1, min(chunk, N))  # the length of a chunk
    C = -(-N // Z)  # chunks
    pad = C * Z - N

    def chunked(x_BxN):  # [B, N, ...] -> [C, B, Z, ...], N zero-padded to C·Z
        x_BxN = jnp.pad(x_BxN, ((0, 0), (0, pad)) + ((0, 0),) * (x_BxN.ndim - 2))
        return x_BxN.reshape(B, C, Z, *x_BxN.shape[2:]).swapaxes(0, 1)

    xs = [chunked(hidden_BxNxD), chunked(tokens_BxN)]
    if divergence is not None:
        # The padding positions' teacher hidden states are 0 (a uniform distribution); their divergence is sliced off
        # below, and they get no gradient.
        xs.append(chunked(divergence.hidden_BxNxD))

    @jax.checkpoint
    def one_chunk(xs):
        h_BxZxD, tokens_BxZ = xs[:2]
        logits_BxZxV = head(cfg, params, h_BxZxD, perturb)
        lse_BxZ = jax.nn.logsumexp(logits_BxZxV, axis=-1)
        token_logit_BxZ = jnp.take_along_axis(logits_BxZxV, tokens_BxZ[..., None], -1)[..., 0]
        div_BxZ = None
        if divergence is not None:
            h_T = xs[2].astype(next(iter(divergence.head.values())).dtype)  # the teacher's head in its own dtype
            teacher_logits_BxZxV = jax.lax.stop_gradient(head(divergence.cfg, divergence.head, h_T))
            teacher_BxZxV = jax.nn.log_softmax(teacher_logits_BxZxV, axis=-1)
            div_BxZ = generalized_jsd(teacher_BxZxV, logits_BxZxV - lse_BxZ[..., None], divergence.beta)
        if not with_entropy:
            return token_logit_BxZ - lse_BxZ, None, div_BxZ
        # H = logsumexp(z) - Σ softmax(z)·z, of the logits without their gradient (a metric).
        logits_BxZxV = jax.lax.stop_gradient(logits_BxZxV)
        sg_lse_BxZ = jax.lax.stop_gradient(lse_BxZ)
        probs_BxZxV = jnp.exp(logits_BxZxV - sg_lse_BxZ[..., None])
        entropy_BxZ = sg_lse_BxZ - jnp.sum(probs_BxZxV * logits_BxZxV, axis=-1)
        return token_logit_BxZ - lse_BxZ, entropy_BxZ, div_BxZ

    if C == 1:
        outs_C = jax.tree.map(lambda y: y[None], one_chunk([x[0] for x in xs]))
    else:
        outs_C = jax.lax.map(one_chunk, xs)

    def unchunk(y_CxBxZ):
        return None if y_CxBxZ is None else y_CxBxZ.swapaxes(0, 1).reshape(B, C * Z)[:, :N]

    return tuple(unchunk(y) for y in outs_C)


def completion_logprobs(cfg: ModelConfig, params: dict, hidden_BxNxD: Array, tokens_BxN: Array, chunk: int = 0):
    """[B, N]: log softmax(head(h))[token] of final-normed hidden states `hidden_BxNxD` (position n: the state that
    predicts token n), the head applied `chunk` positions at a time (0: all N), as `sequence_logprobs` does after its
    forward."""
    return _completion_logprobs(cfg, params, hidden_BxNxD, tokens_BxN, None, chunk or tokens_BxN.shape[1], False)[0]


@functools.partial(jax.jit, static_argnums=(0, 6, 7))
def _completion_logprobs_jit(cfg, params, prompt_BxP, prompt_mask_BxP, tokens_BxN, mask_BxN, with_entropy, chunk):
    return sequence_logprobs(
        cfg, params, prompt_BxP, prompt_mask_BxP, tokens_BxN, mask_BxN, with_entropy=with_entropy, chunk=chunk
    )


def rollout_logprobs(cfg: ModelConfig, params: dict, out, with_entropy: bool = False, chunk: int = 0):
    """[B, N] float32: log π of each token of the rollout `out`'s completions (an `esroll.rollout.Rollout` with its
    completions) under the model (`cfg`, `params`), given the prompt and the tokens before it, from one jitted
    cache-free forward, the head applied `chunk` positions at a time (0: all; `sequence_logprobs`); 0 past each
    completion's length. With `with_entropy`, (log-probabilities, the entropy [B, N] of the whole next-token
    distribution at each position)."""
    N = out.tokens_BxN.shape[1]
    mask_BxN = np.arange(N)[None, :] < np.asarray(out.length_B)[:, None]
    args = (out.prompt_BxP, out.prompt_mask_BxP, out.tokens_BxN, mask_BxN, with_entropy, chunk)
    got = _completion_logprobs_jit(cfg, params, *args)
    return tuple(np.asarray(x, np.float32) for x in got) if with_entropy else np.asarray(got, np.float32)


def generalized_jsd(log_teacher_V, log_student_V, beta: float):
    """[...]: GKD's generalised JSD of the distributions over the last axis (log-probabilities, each row summing to 1),
    teacher P and student Q, mixture M = β·P + (1 − β)·Q:

        JSD_β(P‖Q) = β·KL(P‖M) + (1 − β)·KL(Q‖M)

    It tends to β·KL(P‖Q) as β → 0 and to (1 − β)·KL(Q‖P) as β → 1, so β = 0 is taken as the forward KL, KL(P‖Q),
    and β = 1 as the reverse KL, KL(Q‖P) (TRL's `GKDTrainer` reads β the same way). β = 0.5 is the usual JSD.
    Differentiable in both; GKD's loss differentiates it through the student's only."""
    p, q = jnp.asarray(log_teacher_V, jnp.float32), jnp.asarray(log_student_V, jnp.float32)

    def kl(a, b):  # Σ e^a (a − b), a term 0 where e^a is 0 (a teacher's −inf log-probability)
        return jnp.sum(jnp.where(a > -jnp.inf, jnp.exp(a) * (a - b), 0.0), axis=-1)

    if beta == 0.0:
        return kl(p, q)
    if beta == 1.0:
        return kl(q, p)
    m = jax.nn.logsumexp(jnp.stack([p + jnp.log(beta), q + jnp.log1p(-beta)]), axis=0)
    return beta * kl(p, m) + (1 - beta) * kl(q, m)
