"""GRPO's loss: the clipped surrogate and the KL to the initial policy, a pure function of per-token
log-probabilities, and the token weights of each aggregation mode."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array
AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "constant_length")


def token_weights(mask_BxN: Array, aggregation: str) -> Array:
    """Weights w [B, N] with loss = Σ w·loss_t for each aggregation mode (0 on padding).

    seq_mean_token_mean (GRPO): 1 / (len_i · B);  token_mean (DAPO): 1 / Σ len;  constant_length (Dr. GRPO):
    1 / (B · N), N = max_new_tokens. Computed over a whole minibatch and then split, they make the sum of its
    microbatch losses equal the minibatch loss in every mode.
    """
    mask = jnp.asarray(mask_BxN, jnp.float32)
    B, N = mask.shape
    if aggregation == "seq_mean_token_mean":
        return mask / (jnp.maximum(mask.sum(1, keepdims=True), 1.0) * B)
    if aggregation == "token_mean":
        return mask / jnp.maximum(mask.sum(), 1.0)
    if aggregation == "constant_length":
        return mask / (B * N)
    raise ValueError(f"unknown GRPO aggregation {aggregation!r}; known: {', '.join(AGGREGATIONS)}")


def grpo_loss(
    logp_new_BxN: Array,
    logp_old_BxN: Array,
    logp_ref_BxN: Array | None,
    advantage: Array,
    mask_BxN: Array,
    *,
    eps_low: float | Array,
    eps_high: float | Array,
    beta: float,
    aggregation: str,
    weights_BxN: Array | None = None,
) -> tuple[Array, dict]:
    """Clipped surrogate −min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A) + β·(exp(d) − d − 1), d = log π_ref − log π_θ,
    aggregated by `aggregation` (or by explicit `weights_BxN`, see `token_weights`). `advantage` is one per
    completion [B] or one per token [B, N]; the half-widths are floats or per token [B, N]. The clip is active (its
    branch constant, gradient zero) only where ρ is strictly outside [1−ε_low, 1+ε_high] on the side A's sign makes
    binding (ρ < 1−ε_low with A < 0, ρ > 1+ε_high with A > 0); at ρ = 1 the gradient is the unclipped one for any
    ε ≥ 0.

    logp_ref None means no KL term (β must then be 0). Metrics are token means over this call's tokens: `kl` (the
    k3 estimate), `clip_fraction` (tokens whose clipped branch is active, so their gradient is zero).
    """
    if logp_ref_BxN is None and beta:
        raise ValueError("grpo_loss: beta > 0 needs the reference log-probabilities")
    mask = jnp.asarray(mask_BxN, bool)
    w_BxN = token_weights(mask, aggregation) if weights_BxN is None else weights_BxN
    adv_BxN = jnp.asarray(advantage, jnp.float32)
    adv_BxN = adv_BxN[:, None] if adv_BxN.ndim == 1 else adv_BxN
    ratio_BxN = jnp.exp(logp_new_BxN - logp_old_BxN)
    # min(ρA, clip(ρ)A) written as a selection: the clipped (constant) branch only where ρ is strictly outside the
    # range on the side A's sign makes binding, so a tie (ρ = 1 at ε = 0) takes the unclipped branch and its full
    # gradient; jnp.minimum / jnp.clip would split the gradient there.
    clipped_BxN = ((ratio_BxN < 1 - eps_low) & (adv_BxN < 0)) | ((ratio_BxN > 1 + eps_high) & (adv_BxN > 0))
    bound_BxN = jax.lax.stop_gradient(jnp.where(adv_BxN < 0, 1 - eps_low, 1 + eps_high))
    loss_BxN = -jnp.where(clipped_BxN, bound_BxN * adv_BxN, ratio_BxN * adv_BxN)
    kl_BxN = jnp.zeros_like(loss_BxN)
    if logp_ref_BxN is not None:
        d_BxN = logp_ref_BxN - logp_new_BxN
        kl_BxN = jnp.exp(d_BxN) - d_BxN - 1
        loss_BxN = loss_BxN + beta * kl_BxN
    n_tokens = jnp.maximum(mask.sum(), 1)
    metrics = {
        "kl": jnp.where(mask, kl_BxN, 0.0).sum() / n_tokens,
        "clip_fraction": (clipped_BxN & mask).sum() / n_tokens,
    }
    return jnp.where(mask, w_BxN * loss_BxN, 0.0).sum(), metrics
