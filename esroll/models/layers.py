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
        """The same perturbation with every row's factors gathered once (leading axis B instead of M): a decode loop
        that runs many steps over the same rows then does no gather per step."""
        if self.member_B is None:
            return self
        return Perturbation(jax.tree.map(lambda x: x[self.member_B], self.deltas), None)


def linear(x_BxTxI: Array, w_IxO: Array, delta: LowRank | None = None, member_B: Array | None = None) -> Array:
    """x·W, or x·W + (x·a)·bᵀ per row with each row's member's factors (contracting x with a first).

    The shared x·W is one GEMM over the whole batch; only the rank-r term is per member, and the perturbed weight
    is never formed.
    """
    y = jnp.einsum("bti,io->bto", x_BxTxI, w_IxO)
    return y if delta is None else y + lowrank_term(x_BxTxI, delta, member_B)


def lowrank_term(x_BxTxI: Array, delta: LowRank, member_B: Array) -> Array:
    """(x·a)·bᵀ with each row's member's factors (`member_B` None: factors already per row): the perturbation's share
    of x·(W + a·bᵀ)."""
    a_BxIxR = (delta.a if member_B is None else delta.a[member_B]).astype(x_BxTxI.dtype)
    b_BxOxR = (delta.b if member_B is None else delta.b[member_B]).astype(x_BxTxI.dtype)
    xa_BxTxR = jnp.einsum("bti,bir->btr", x_BxTxI, a_BxIxR)
    return jnp.einsum("btr,bor->bto", xa_BxTxR, b_BxOxR)


def linears(x_BxTxI: Array, p: dict, d: dict, names: tuple[str, ...], member_B: Array | None) -> list[Array]:
    """`linear` for the weights `names` that read the same input, as one GEMM when `fuse_matmuls` prepared them:
    p[fused_key(names)] then holds [W₁ | … | W_n] side by side, and each weight's low-rank term (if any) is added to
    its share of the output. Unprepared groups go through `linear` one weight at a time.

    (An earlier version also added a fused group's terms at once, (x·[a₁ … a_n]) · blockdiag(b₁ᵀ … b_nᵀ), as two
    batched matmuls. XLA's CPU backend ran those as plain dots, while it fuses each weight's own rank-r term with the
    split of the GEMM's output into one YNNPACK call: in paired rounds of `es_generate_vs_plain` at hidden 256 the
    per-weight terms gave 0.889 of plain generation against 0.818 for the grouped ones, and at hidden 1024 no
    measurable difference, 0.939 against 0.944 (README), so the grouped form was removed.)"""
    fused = fused_key(names)
    if fused not in p:
        return [linear(x_BxTxI, p[n], d.get(n), member_B) for n in names]
    widths = [p[n].shape[-1] for n in names]
    y = jnp.einsum("bti,io->bto", x_BxTxI, p[fused])
    outs = jnp.split(y, np.cumsum(widths)[:-1].tolist(), axis=-1)
    return [o if d.get(n) is None else o + lowrank_term(x_BxTxI, d[n], member_B) for o, n in zip(outs, names)]


FUSED = (("q", "k", "v"), ("gate", "up"))  # the projections that read the same input


def fused_key(names: tuple[str, ...]) -> str:
    return "fused:" + "+".join(names)


def fuse_matmuls(p: dict) -> dict:
    """One layer's weights prepared for `linears`: projections that share an input (q, k, v; gate, up) also stored
    side by side, so a decode step runs one GEMM where it ran several (low-rank terms stay per weight). The prepared
    copies take memory beside the originals, so `generate` builds them only on a CPU (where per-GEMM overhead
    dominates a decode step of a small model), once per call, outside the decode loop; the training forward
    (`forward(fuse=True)`, GRPO's update on a CPU) builds one layer's inside its layer scan.

    (An earlier version also folded small populations' factors into the fused GEMM, [x | x·a] · [W ; blockdiag(bᵀ)].
    In interleaved runs of `es_generate_vs_plain` it was slower than the per-row terms: 0.81-0.84 of plain generation
    against 0.86-0.90 without it at hidden 256, 0.94 and 0.96 against 0.96-0.97 at hidden 1024; so it was removed.)
    """
    p = dict(p)
    for names in FUSED:
        if all(n in p and p[n].ndim == 2 for n in names):
            p[fused_key(names)] = jnp.concatenate([p[n] for n in names], axis=-1)
    return p


def row_vector(v: Array, delta: Array | None, member_B: Array | None) -> Array:
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
