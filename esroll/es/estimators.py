"""The two ES estimators of the population field g(θ) = E[J(θ+σE)·E]/σ, as per-direction weights.

Both are ĝ = Σ_k w_k E_k over the step's E directions, so one code path turns weights into an update; with M members,
    antithetic EGGROLL, members 2k, 2k+1 = θ ± σE_k (E = M/2):  w_k = (f⁺_k − f⁻_k) / (Mσ)
    LOO-ROLL, member i = θ + σE_i (E = M):                       w_i = (f_i − f̄) / ((M−1)σ)
(f are the shaped fitnesses; raw fitness keeps both unbiased). The update of a low-rank leaf, Σ_k w_k A_k B_kᵀ/√r, is
one contraction over (direction, rank) per layer, optionally chunked over directions so that only a chunk's factors
are live at once; chunks give the same sum.

Non-finite fitness never reaches the parameters:
- a member with NaN/±inf fitness is dropped, and so is its antithetic partner (a pair without both halves has no
  estimate); the estimate is over the directions left, with the M' members kept in place of M, and fitness shaping
  sees only the members kept;
- if fewer than max(2, min_valid_fraction·M) members are kept, every weight is zero and `skipped` is set: the caller
  (`strategy.tell`) then leaves parameters and optimizer state untouched and only advances the step.
`num_nonfinite` counts the non-finite members, `num_dropped` every member left out (partners included).

Shape letters (see `esroll`): M population members, E directions, C chunks of directions, L layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from esroll.es import shaping as shapings
from esroll.es import noise
from esroll.models import LowRank

Array = jax.Array
METHODS = ("eggroll", "looroll")


class Weights(NamedTuple):
    w_E: Array  # [E] float32: ĝ = Σ_k w_k E_k
    num_nonfinite: Array  # int32: members with non-finite fitness
    num_dropped: Array  # int32: members left out of the estimate
    skipped: Array  # bool: too few members left; all weights are zero


def num_directions(method: str, population: int) -> int:
    return population // 2 if method == "eggroll" else population


def member_directions(method: str, population: int) -> tuple[Array, Array]:
    """(direction_M, sign_M): antithetic members 2k, 2k+1 share direction k with signs +, −; LOO member i uses i, +."""
    i = jnp.arange(population)
    if method == "eggroll":
        return i // 2, jnp.where(i % 2 == 0, 1.0, -1.0)
    return i, jnp.ones(population)


def direction_weights(
    method: str, fitness_M: Array, sigma: float, shaping: str | Callable = "raw", min_valid_fraction: float = 0.5
) -> Weights:
    """The estimator's weights on the step's directions, after the non-finite policy and fitness shaping (a name in
    `esroll.es.shaping.SHAPINGS` at its default options, or a shaping function, `esroll.es.shaping.get`)."""
    M = fitness_M.shape[0]
    finite_M = jnp.isfinite(fitness_M)
    if method == "eggroll":
        pair_E = finite_M[0::2] & finite_M[1::2]
        keep_M = jnp.repeat(pair_E, 2)
    else:
        keep_M = finite_M
    kept = keep_M.sum()
    skipped = kept < max(2, math.ceil(min_valid_fraction * M))
    shaped = shapings.get(shaping) if isinstance(shaping, str) else shaping
    f_M = shaped(fitness_M, keep_M)  # zero where not kept
    if method == "eggroll":
        w_E = (f_M[0::2] - f_M[1::2]) / (sigma * jnp.maximum(kept, 2))  # kept = M'
    else:
        mean = f_M.sum() / jnp.maximum(kept, 1)
        w_E = jnp.where(keep_M, f_M - mean, 0.0) / (sigma * jnp.maximum(kept - 1, 1))
    w_E = jnp.where(skipped, 0.0, w_E).astype(jnp.float32)
    return Weights(w_E, (~finite_M).sum().astype(jnp.int32), (M - kept).astype(jnp.int32), skipped)


def _contract(noise_leaf, w_E: Array, rank: int, stacked: bool) -> Array:
    """Σ_k w_k E_k for one leaf: a single contraction over (direction, rank), per layer for stacked leaves."""
    if isinstance(noise_leaf, LowRank):
        spec = "leir,leor->lio" if stacked else "eir,eor->io"
        wa = noise_leaf.a * (w_E[:, None, None] / math.sqrt(rank))
        return jnp.einsum(spec, wa, noise_leaf.b)
    return jnp.einsum("led,e->ld" if stacked else "ed,e->d", noise_leaf, w_E)


def weighted_sum(
    factors_fn: Callable[[Array], dict], w_E: Array, rank: int, chunk_size: int | None = None
) -> dict[str, Array]:
    """{path: Σ_k w_k E_k} in float32. `factors_fn(directions)` regenerates the noise of those directions.

    With `chunk_size`, directions are processed chunk by chunk under `lax.scan` (the last chunk padded with
    zero-weight directions), so peak memory holds one chunk's factors.
    """

    def chunk_sum(directions_E: Array, w_E: Array) -> dict[str, Array]:
        flat = noise.flatten(factors_fn(directions_E))
        return {path: _contract(leaf, w_E, rank, noise.is_stacked(path)) for path, leaf in flat.items()}

    E = w_E.shape[0]
    if chunk_size is None or chunk_size >= E:
        return chunk_sum(jnp.arange(E), w_E)
    C = -(-E // chunk_size)  # C chunks of chunk_size directions each
    w_CxE = jnp.pad(w_E, (0, C * chunk_size - E)).reshape(C, chunk_size)
    directions_CxE = jnp.arange(C * chunk_size).reshape(C, chunk_size)
    zeros = jax.eval_shape(chunk_sum, directions_CxE[0], w_CxE[0])
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zeros)

    def body(total, xs):
        part = chunk_sum(*xs)
        return jax.tree.map(jnp.add, total, part), None

    total, _ = jax.lax.scan(body, zeros, (directions_CxE, w_CxE))
    return total
