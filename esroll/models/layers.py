"""The small building blocks of the decoder, including the one matmul helper every weight goes through.

Perturbations plug in here and nowhere else. A batch's rows may belong to different population members: `member_B`
maps each row to its member, and each perturbed weight carries per-member factors. The model knows nothing of how
those factors were drawn (that is `esroll.es`); it only applies them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


class LowRank(NamedTuple):
    """Per-member low-rank perturbation of one weight W[in, out]: member i uses W + a_i · b_iᵀ.

    `a` already carries the member's scale (for EGGROLL, ±σ/√r), so the helper needs no scalar beside it.
    Layer-stacked weights get layer-stacked factors: a [L, N, in, r], b [L, N, out, r].
    """

    a: Array  # [N, in, r]
    b: Array  # [N, out, r]


class Perturbation(NamedTuple):
    """Per-row perturbation of a whole parameter pytree.

    `deltas` mirrors the parameter dict: a `LowRank` for a perturbed matrix, an array [N, *shape] (added to the
    leaf, scale included) for a perturbed vector, and a missing key for a leaf left as it is.
    """

    deltas: dict[str, Any]
    member_B: Array  # [B] int32: row -> population member


def linear(x_BxTxI: Array, w_IxO: Array, delta: LowRank | None = None, member_B: Array | None = None) -> Array:
    """x·W, or x·W + (x·a)·bᵀ per row with each row's member's factors (contracting x with a first).

    The shared x·W is one GEMM over the whole batch; only the rank-r term is per member, and the perturbed weight
    is never formed.
    """
    y = jnp.einsum("bti,io->bto", x_BxTxI, w_IxO)
    if delta is None:
        return y
    a_BxIxR = delta.a[member_B].astype(x_BxTxI.dtype)
    b_BxOxR = delta.b[member_B].astype(x_BxTxI.dtype)
    xa_BxTxR = jnp.einsum("bti,bir->btr", x_BxTxI, a_BxIxR)
    return y + jnp.einsum("btr,bor->bto", xa_BxTxR, b_BxOxR)


def row_vector(v_D: Array, delta: Array | None, member_B: Array | None) -> Array:
    """A vector leaf (norm scale, bias) as seen by each row: [1, 1, D] unperturbed, [B, 1, D] perturbed."""
    if delta is None:
        return v_D[None, None]
    return (v_D[None] + delta[member_B].astype(v_D.dtype))[:, None]


def rms_norm(x: Array, w: Array, eps: float) -> Array:
    """RMSNorm in float32, scaled in the input dtype (as the Hugging Face reference does)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w * x32.astype(x.dtype)


def rope(x_BxTxNxH: Array, positions_BxT: Array, inv_freq: Array) -> Array:
    """Rotary embedding, rotate-half convention (as in Llama / Qwen checkpoints)."""
    angles = positions_BxT[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles).astype(x_BxTxNxH.dtype), jnp.sin(angles).astype(x_BxTxNxH.dtype)
    x1, x2 = jnp.split(x_BxTxNxH, 2, axis=-1)
    return x_BxTxNxH * cos + jnp.concatenate([-x2, x1], axis=-1) * sin
