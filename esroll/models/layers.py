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
    member_B: Array  # [B] int32: row -> population member


def linear(x_BxTxI: Array, w_IxO: Array, delta: LowRank | None = None, member_B: Array | None = None) -> Array:
    """x·W, or x·W + (x·a)·bᵀ per row with each row's member's factors (contracting x with a first).

    The shared x·W is one GEMM over the whole batch; only the rank-r term is per member, and the perturbed weight
    is never formed.
    """
    y = jnp.einsum("bti,io->bto", x_BxTxI, w_IxO)
    return y if delta is None else y + lowrank_term(x_BxTxI, delta, member_B)


def lowrank_term(x_BxTxI: Array, delta: LowRank, member_B: Array) -> Array:
    """(x·a)·bᵀ with each row's member's factors: the perturbation's share of x·(W + a·bᵀ)."""
    a_BxIxR = delta.a[member_B].astype(x_BxTxI.dtype)
    b_BxOxR = delta.b[member_B].astype(x_BxTxI.dtype)
    xa_BxTxR = jnp.einsum("bti,bir->btr", x_BxTxI, a_BxIxR)
    return jnp.einsum("btr,bor->bto", xa_BxTxR, b_BxOxR)


class Folded(NamedTuple):
    """A group's low-rank factors as `fuse_matmuls` folds them (see `linears`)."""

    a: Array  # [I, n·M·R] for a group of n weights: every member's `a` factors, columns [weight][member][rank]
    members: int  # M


def linears(x_BxTxI: Array, p: dict, d: dict, names: tuple[str, ...], member_B: Array | None) -> list[Array]:
    """`linear` for the weights `names` that read the same input, as one GEMM when `fuse_matmuls` prepared them.

    Prepared, p[fused_key(names)] holds [W₁ | … | W_n] side by side. With folded perturbations it holds
    [W₁ | … | W_G ; blockdiag(b)ᵀ] (the `b` factors of every member stacked under the weights), and the input is
    extended by x·a for all members at once (one thin GEMM), zeroed outside each row's own member: one GEMM then gives
    every row x·W + (x·aᵢ)·bᵢᵀ. Unprepared groups, and unfolded factors, go through `linear`.
    """
    fused = fused_key(names)
    if fused not in p:
        return [linear(x_BxTxI, p[n], d.get(n), member_B) for n in names]
    widths = [p[n].shape[-1] for n in names]
    folded = d.get(fused)
    if folded is None:
        y = jnp.einsum("bti,io->bto", x_BxTxI, p[fused])
    else:
        xa = jnp.einsum("bti,ic->btc", x_BxTxI, folded.a.astype(x_BxTxI.dtype))  # [B, T, n·M·R], as folded.a
        onehot_BxM = (member_B[:, None] == jnp.arange(folded.members)).astype(x_BxTxI.dtype)
        rank = xa.shape[-1] // folded.members // len(names)  # the columns are ordered [weight][member][rank]
        own = jnp.tile(jnp.repeat(onehot_BxM, rank, axis=-1), (1, len(names)))  # [B, n·M·R]: the row's member's
        # [x | own x·a] · [W ; blockdiag(bᵀ)] = x·W + (x·aᵢ)·bᵢᵀ in one GEMM
        y = jnp.einsum("bti,io->bto", jnp.concatenate([x_BxTxI, xa * own[:, None]], -1), p[fused])
    outs = jnp.split(y, np.cumsum(widths)[:-1].tolist(), axis=-1)
    gathered = folded is None  # unfolded factors go through `lowrank_term`
    return [
        o + lowrank_term(x_BxTxI, d[n], member_B) if gathered and d.get(n) is not None else o
        for o, n in zip(outs, names)
    ]


FUSED = (("q", "k", "v"), ("o",), ("gate", "up"), ("down",), ("lm_head",))


def fused_key(names: tuple[str, ...]) -> str:
    return "fused:" + "+".join(names)


def fuse_matmuls(p: dict, d: dict, *, max_extra: float = 0.3) -> tuple[dict, dict]:
    """Weights (and low-rank perturbations) of one layer, or of the top level, prepared for `linears`.

    Projections that share an input (q, k, v; gate, up) are stored side by side, so a decode step runs one GEMM
    where it ran several. A group whose weights all carry `LowRank` factors of one shape [M, I, R] has them folded
    in (see `linears`) when that adds at most `max_extra` to the group's FLOPs, n·M·R·(1/ΣO + 1/I) for n weights
    of total width ΣO: a small population per device. Otherwise the factors stay per weight and `linear` gathers
    each row's. The prepared copies take memory beside the originals, so `generate` builds them only on a CPU (where
    per-GEMM overhead dominates a decode step of a small model), once per call, outside the decode loop.
    """
    p, d = dict(p), dict(d)
    for names in FUSED:
        if not all(n in p and p[n].ndim == 2 for n in names):
            continue
        deltas = [d.get(n) for n in names]
        weights = [p[n] for n in names]
        fold = all(isinstance(x, LowRank) for x in deltas) and len({x.a.shape for x in deltas}) == 1
        if fold:  # extra FLOPs of the fold, relative to the group's own: n·M·R·(1/ΣO + 1/I)
            M, I, R = deltas[0].a.shape
            fold = len(names) * M * R * (1 / sum(w.shape[1] for w in weights) + 1 / I) <= max_extra
        if not fold and len(names) == 1:
            continue  # nothing to gain from a group of one
        key = fused_key(names)
        if fold:
            a = [x.a.transpose(1, 0, 2).reshape(x.a.shape[1], -1).astype(w.dtype) for x, w in zip(deltas, weights)]
            blocks = [x.b.transpose(0, 2, 1).reshape(-1, x.b.shape[1]) for x in deltas]  # [M·R, O] each
            bd = jax.scipy.linalg.block_diag(*blocks).astype(weights[0].dtype)
            d[key] = Folded(jnp.concatenate(a, axis=-1), deltas[0].a.shape[0])
            p[key] = jnp.concatenate([jnp.concatenate(weights, axis=-1), bd], axis=0)
        else:
            p[key] = jnp.concatenate(weights, axis=-1)
    return p, d


def row_vector(v: Array, delta: Array | None, member_B: Array | None) -> Array:
    """A vector leaf [n] (norm scale, bias) as seen by each row: [1, 1, n] unperturbed, [B, 1, n] perturbed."""
    if delta is None:
        return v[None, None]
    return (v[None] + delta[member_B].astype(v.dtype))[:, None]


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
