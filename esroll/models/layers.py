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
    """Per-row perturbation of a whole parameter pytree, in one of three forms:

        member level  `member_B` set: deltas [M, ...], row b uses member member_B[b]'s (what `strategy.ask` gives);
        per row       neither set: deltas [B, ...], row b uses entry b (`per_row`);
        tables        `slot_B` set: the B rows form G equal contiguous blocks and each block has a table of U
                      members, deltas [G, U, ...]; row b uses entry slot_B[b] of its block's table (`tables`).

    `deltas` mirrors the parameter dict: a `LowRank` for a perturbed matrix, an array (added to the leaf, scale
    included) for a perturbed vector, and a missing key for a leaf left as it is. Layer-stacked deltas carry the
    layer axis L first ([L, M, ...], [L, B, ...], [L, G, U, ...]).
    """

    deltas: dict[str, Any]
    member_B: Array | None  # [B] int32: row -> population member
    slot_B: Array | None = None  # [B] int32: row -> entry of its block's member table

    @property
    def index_B(self) -> Array | None:
        """What maps rows to the deltas' entries: `member_B`, `slot_B`, or None (per row)."""
        return self.member_B if self.member_B is not None else self.slot_B

    def _map(self, fn) -> dict:
        """deltas with fn(x, axis) applied to every factor, axis its member (or row) axis."""
        return {k: jax.tree.map(lambda x: fn(x, int(k == STACKED)), v) for k, v in self.deltas.items()}

    def per_row(self) -> Perturbation:
        """A member-level perturbation with every row's factors gathered once (leading axis B instead of M;
        layer-stacked factors [L, B, ...]); any other form as it is. Each row then reads its own copy of its
        member's factors: B copies where the rows hold far fewer distinct members (see `tables`)."""
        if self.member_B is None:
            return self
        return Perturbation(self._map(lambda x, axis: jnp.take(x, self.member_B, axis=axis)), None)

    def tables(self, slots: int, blocks: int = 1) -> Perturbation:
        """A member-level perturbation as member tables: the B rows in `blocks` equal contiguous blocks (G, the
        row shards of a device mesh: under GSPMD each device then reads its own block's table), each block's
        distinct members (at most `slots`, U: the caller's bound, which must hold) gathered once into a table
        [G, U, ...], and each row's entry in its block's table.

        A decode loop over many steps then reads U members' factors per block and step, not one copy per row:
        a decode step's `linear` contracts each row with all U entries of its block's table and keeps its own
        entry's share (the others multiplied by exact zeros), which costs U times the rank-r flops and reads each
        factor once (`lowrank_term`).
        """
        G, U = blocks, slots
        member_GxB = self.member_B.reshape(G, -1)
        members_GxU = jax.vmap(lambda m: jnp.unique(m, size=U, fill_value=m[0]))(member_GxB)
        slot_B = jnp.argmax(member_GxB[:, :, None] == members_GxU[:, None, :], -1).reshape(-1).astype(jnp.int32)
        return Perturbation(self._map(lambda x, axis: jnp.take(x, members_GxU, axis=axis)), None, slot_B)


def member_slots(member_B, blocks: int = 1, chunk: int | None = None) -> int:
    """The table size U for `Perturbation.tables` of rows `member_B` (host values), taken `chunk` rows at a time
    (default: all at once) and each chunk split in `blocks` equal blocks: the most distinct members in any block (one
    bound for every chunk of a rollout, so that they share one compilation); 0 where that is not fewer than a
    block's rows (per-row factors then read no more)."""
    per_block = (chunk or len(member_B)) // blocks
    slots = most_members(member_B, per_block)
    return slots if slots < per_block else 0


def table_slots(member_B, rows: int, blocks: int, given: int | None, caller: str) -> int:
    """The table size U to build for `rows` rows split in `blocks` blocks: `given` (a caller's bound for several
    chunks), refused with a ValueError naming `caller` where the rows' members `member_B` (host values, or None where
    they are not known) exceed it; else `member_slots` of them (0 when not known). 0 (per-row factors) wherever U is
    not below a block's rows."""
    per_block = rows // blocks
    if given is None:
        return 0 if member_B is None else member_slots(member_B, blocks)
    if given and member_B is not None and most_members(member_B, per_block) > given:
        raise ValueError(
            f"{caller}: member_slots = {given} is fewer than the {most_members(member_B, per_block)} distinct "
            f"members among one device's {per_block} rows"
        )
    return int(given) if 0 < given < per_block else 0


def most_members(member_B, per_block: int) -> int:
    """The most distinct members in any block of `per_block` consecutive rows of `member_B` (host values)."""
    member_B = np.asarray(member_B)
    return max(len(np.unique(member_B[i : i + per_block])) for i in range(0, len(member_B), per_block))


def linear(x_BxTxI: Array, w_IxO: Array, delta: LowRank | None = None, index_B: Array | None = None) -> Array:
    """x·W, or x·W + (x·a)·bᵀ per row with each row's member's factors (contracting x with a first).

    The shared x·W is one GEMM over the whole batch; only the rank-r term is per member, and the perturbed weight
    is never formed. `delta` and `index_B` in one of `Perturbation`'s forms (see `lowrank_term`).
    """
    y = jnp.einsum("bti,io->bto", x_BxTxI, w_IxO)
    return y if delta is None else y + lowrank_term(x_BxTxI, delta, index_B)


def lowrank_term(x_BxTxI: Array, delta: LowRank, index_B: Array | None = None) -> Array:
    """(x·a)·bᵀ with each row's member's factors: the perturbation's share of x·(W + a·bᵀ). The factors are per row
    (a [B, I, R], `index_B` None), per member (a [M, I, R], `index_B` the rows' members), or member tables
    (a [G, U, I, R], `index_B` the rows' entries in their block's table: `Perturbation.tables`).

    With tables, a step of one token per row (a decode step: it reads far more bytes than it multiplies) contracts
    each row with all U entries of its block and keeps its own entry's share, so each entry is read once; a step
    of several tokens per row (a prefill: it multiplies far more than it reads) gathers each row's entry first, so
    the rank-r products are not done U times over."""
    if delta.a.ndim == 4 and x_BxTxI.shape[1] > 1:  # tables, several tokens per row: each row's entry, gathered
        return lowrank_term(x_BxTxI, LowRank(*(_row_entries(f, index_B) for f in delta)))
    if delta.a.ndim == 4:  # tables, one token per row: every row against its block's U entries, its own one's kept
        G, U = delta.a.shape[:2]
        B, T, I = x_BxTxI.shape
        x_GxBxTxI = x_BxTxI.reshape(G, B // G, T, I)
        a_GxUxIxR, b_GxUxOxR = (f.astype(x_BxTxI.dtype) for f in delta)
        xa_GxBxTxUxR = jnp.einsum("gbti,guir->gbtur", x_GxBxTxI, a_GxUxIxR)
        own_GxBxU = index_B.reshape(G, B // G)[:, :, None] == jnp.arange(U)
        xa_GxBxTxUxR = jnp.where(own_GxBxU[:, :, None, :, None], xa_GxBxTxUxR, 0)
        return jnp.einsum("gbtur,guor->gbto", xa_GxBxTxUxR, b_GxUxOxR).reshape(B, T, -1)
    a_BxIxR = (delta.a if index_B is None else delta.a[index_B]).astype(x_BxTxI.dtype)
    b_BxOxR = (delta.b if index_B is None else delta.b[index_B]).astype(x_BxTxI.dtype)
    xa_BxTxR = jnp.einsum("bti,bir->btr", x_BxTxI, a_BxIxR)
    return jnp.einsum("btr,bor->bto", xa_BxTxR, b_BxOxR)


def row_vector(v: Array, delta: Array | None, index_B: Array | None = None) -> Array:
    """A vector leaf [n] (norm scale, bias) as seen by each row: [1, 1, n] unperturbed, [B, 1, n] perturbed (`delta`
    and `index_B` in one of `Perturbation`'s forms, as for `lowrank_term`)."""
    if delta is None:
        return v[None, None]
    if delta.ndim == 3:  # tables [G, U, n]
        delta = _row_entries(delta, index_B)
    elif index_B is not None:
        delta = delta[index_B]
    return (v[None] + delta.astype(v.dtype))[:, None]


def _row_entries(table_GxUx: Array, slot_B: Array) -> Array:
    """[B, ...]: each row's entry `slot_B[b]` of its block's table (the B rows in G equal contiguous blocks)."""
    G, B = table_GxUx.shape[0], slot_B.shape[0]
    return table_GxUx[jnp.arange(B) // (B // G), slot_B]


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
