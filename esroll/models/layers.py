"""The small building blocks of the decoder, including the one matmul helper every weight goes through.

Perturbations plug in here and nowhere else. A batch's rows may belong to different population members: `member_B`
maps each row to its member, and each perturbed weight carries per-member factors. The model knows nothing of how
those factors were drawn (that is `esroll.es`); it only applies them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
# The top-level key of the layer-stacked parameters: every leaf under it has a leading layer axis L (and a
# perturbation's deltas under it carry L before the member axis). Declared once; `esroll.models.transformer`,
# `esroll.es.noise` and the checkpoint loaders read it from here.
STACKED = "layers"


class LowRank(NamedTuple):
    """Per-member low-rank perturbation of one weight W[in, out]: member i uses W + a_i · b_iᵀ.

    `a` already carries the member's scale (for EGGROLL, ±σ/√r), so the helper needs no scalar beside it.
    Layer-stacked weights get layer-stacked factors: a [L, M, I, R], b [L, M, O, R].
    """

    a: Array  # [M, I, R]
    b: Array  # [M, O, R]


class Perturbation(NamedTuple):
    """Per-row perturbation of a whole parameter pytree.

    `deltas` mirrors the parameter dict: a `LowRank` for a perturbed matrix, an array [M, *shape] (added to the
    leaf, scale included) for a perturbed vector, and a missing key for a leaf left as it is.
    """

    deltas: dict[str, Any]
    member_B: Array | None  # [B] int32: row -> population member; None: `deltas` are already per row (leading B)

    def per_row(self) -> Perturbation:
        """The same perturbation with every row's factors gathered once (leading axis B instead of M; layer-stacked
        factors [L, B, ...]): a decode loop that runs many steps over the same rows then does no gather per step,
        and the layer scan slices each layer's per-row factors from its inputs."""
        if self.member_B is None:
            return self
        rows = {
            k: jax.tree.map(lambda x: jnp.take(x, self.member_B, axis=int(k == STACKED)), v)
            for k, v in self.deltas.items()
        }
        return Perturbation(rows, None)


def linear(x_BxTxI: Array, w_IxO: Array, delta: LowRank | None = None, member_B: Array | None = None) -> Array:
    """x·W, or x·W + (x·a)·bᵀ per row with each row's member's factors (contracting x with a first).

    The shared x·W is one GEMM over the whole batch; only the rank-r term is per member, and the perturbed weight
    is never formed.
    """
    y = jnp.einsum("bti,io->bto", x_BxTxI, w_IxO)
    return y if delta is None else y + lowrank_term(x_BxTxI, delta, member_B)


def lowrank_term(x_BxTxI: Array, delta: LowRank, member_B: Array | None = None) -> Array:
    """(x·a)·bᵀ with each row's member's factors (`member_B` None: factors already per row): the perturbation's share
    of x·(W + a·bᵀ)."""
    a_BxIxR = (delta.a if member_B is None else delta.a[member_B]).astype(x_BxTxI.dtype)
    b_BxOxR = (delta.b if member_B is None else delta.b[member_B]).astype(x_BxTxI.dtype)
    xa_BxTxR = jnp.einsum("bti,bir->btr", x_BxTxI, a_BxIxR)
    return jnp.einsum("btr,bor->bto", xa_BxTxR, b_BxOxR)


def row_vector(v: Array, delta: Array | None, member_B: Array | None = None) -> Array:
    """A vector leaf [n] (norm scale, bias) as seen by each row: [1, 1, n] unperturbed, [B, 1, n] perturbed."""
    if delta is None:
        return v[None, None]
    return (v[None] + (delta if member_B is None else delta[member_B]).astype(v.dtype))[:, None]


def rms_norm(x: Array, w: Array, eps: float) -> Array:
    """RMSNorm in float32, scaled in the input dtype (as the Hugging Face reference does)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w * x32.astype(x.dtype)


def rope_tables(positions_BxT: Array, inv_freq: np.ndarray, num_positions: int | None, dtype) -> tuple[Array, Array]:
    """cos and sin [B, T, 1, H] of the rotary angles, computed once per forward and shared by every layer.

    With `num_positions` (an upper bound on the positions, known when tracing), the values are looked up in a
    table built with NumPy at trace time: a decode step then evaluates no transcendental at all, which XLA would
    otherwise recompute inside every layer's query and key fusions. Angles are formed in float32 as the Hugging Face
    reference forms them.
    """
    inv_freq = np.asarray(inv_freq, np.float32)
    if num_positions is None:
        angles = positions_BxT[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
        cos, sin = jnp.cos(angles), jnp.sin(angles)
    else:
        angles = np.arange(num_positions, dtype=np.float32)[:, None] * inv_freq  # float32 products
        cos = jnp.asarray(np.cos(angles.astype(np.float64)), jnp.float32)[positions_BxT]
        sin = jnp.asarray(np.sin(angles.astype(np.float64)), jnp.float32)[positions_BxT]
    cos, sin = (jnp.concatenate([t, t], -1)[:, :, None, :].astype(dtype) for t in (cos, sin))
    return cos, sin


def rope(x: Array, cos_sin: tuple[Array, Array]) -> Array:
    """Rotary embedding of queries [B, T, Q, H] or keys [B, T, K, H], rotate-half convention (as in Llama / Qwen
    checkpoints), from `rope_tables`."""
    cos, sin = cos_sin
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin
