"""The two ES estimators of the population field g(θ) = E[J(θ+σE)·E]/σ, as per-direction weights.

Both are ĝ = Σ_k w_k E_k over the step's directions, so one code path turns weights into an update:
    antithetic EGGROLL, members 2k, 2k+1 = θ ± σE_k:  w_k = (f⁺_k − f⁻_k) / (2Kσ)
    LOO-ROLL, member i = θ + σE_i:                      w_i = (f_i − f̄) / ((N−1)σ)
(f are the shaped fitnesses; raw fitness keeps both unbiased). The update of a low-rank leaf, Σ_k w_k A_k B_kᵀ/√r, is
one contraction over (direction, rank) per layer, optionally chunked over directions so that only a chunk's factors
are live at once; chunks give the same sum.

Non-finite fitness never reaches the parameters:
- a member with NaN/±inf fitness is dropped, and so is its antithetic partner (a pair without both halves has no
  estimate); the estimate is over the K' (or N') directions left, renormalised by K' (or N'−1), and fitness shaping
  sees only the members kept;
- if fewer than max(2, min_valid_fraction·N) members are kept, every weight is zero and `skipped` is set: the caller
  (`strategy.tell`) then leaves parameters and optimizer state untouched and only advances the step.
`num_nonfinite` counts the non-finite members, `num_dropped` every member left out (partners included).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from esroll import advantages
from esroll.es import noise
from esroll.models import LowRank

Array = jax.Array
METHODS = ("eggroll", "looroll")


class Weights(NamedTuple):
    w_K: Array  # [K] float32: ĝ = Σ_k w_k E_k
    num_nonfinite: Array  # int32: members with non-finite fitness
    num_dropped: Array  # int32: members left out of the estimate
    skipped: Array  # bool: too few members left; all weights are zero


def num_directions(method: str, population: int) -> int:
    return population // 2 if method == "eggroll" else population


def member_directions(method: str, population: int) -> tuple[Array, Array]:
    """(direction_N, sign_N): antithetic members 2k, 2k+1 share direction k with signs +, −; LOO member i uses i, +."""
    i = jnp.arange(population)
    if method == "eggroll":
        return i // 2, jnp.where(i % 2 == 0, 1.0, -1.0)
    return i, jnp.ones(population)


def direction_weights(
    method: str, fitness_N: Array, sigma: float, shaping: str = "raw", min_valid_fraction: float = 0.5
) -> Weights:
    """The estimator's weights on the step's directions, after the non-finite policy and fitness shaping."""
    N = fitness_N.shape[0]
    finite_N = jnp.isfinite(fitness_N)
    if method == "eggroll":
        pair_K = finite_N[0::2] & finite_N[1::2]
        keep_N = jnp.repeat(pair_K, 2)
    else:
        keep_N = finite_N
    kept = keep_N.sum()
    skipped = kept < max(2, math.ceil(min_valid_fraction * N))
    f_N = advantages.get(shaping)(fitness_N, keep_N)  # zero where not kept
    if method == "eggroll":
        w_K = (f_N[0::2] - f_N[1::2]) / (sigma * jnp.maximum(kept, 2))  # kept = 2K'
    else:
        mean = f_N.sum() / jnp.maximum(kept, 1)
        w_K = jnp.where(keep_N, f_N - mean, 0.0) / (sigma * jnp.maximum(kept - 1, 1))
    w_K = jnp.where(skipped, 0.0, w_K).astype(jnp.float32)
    return Weights(w_K, (~finite_N).sum().astype(jnp.int32), (N - kept).astype(jnp.int32), skipped)


def _contract(noise_leaf, w_K: Array, rank: int, stacked: bool) -> Array:
    """Σ_k w_k E_k for one leaf: a single contraction over (direction, rank), per layer for stacked leaves."""
    if isinstance(noise_leaf, LowRank):
        spec = "lkir,lkor->lio" if stacked else "kir,kor->io"
        wa = noise_leaf.a * (w_K[:, None, None] / math.sqrt(rank))
        return jnp.einsum(spec, wa, noise_leaf.b)
    return jnp.einsum("lkd,k->ld" if stacked else "kd,k->d", noise_leaf, w_K)


def weighted_sum(
    factors_fn: Callable[[Array], dict], w_K: Array, rank: int, chunk_size: int | None = None
) -> dict[str, Array]:
    """{path: Σ_k w_k E_k} in float32. `factors_fn(directions)` regenerates the noise of those directions.

    With `chunk_size`, directions are processed chunk by chunk under `lax.scan` (the last chunk padded with
    zero-weight directions), so peak memory holds one chunk's factors.
    """

    def chunk_sum(directions_C: Array, w_C: Array) -> dict[str, Array]:
        flat = noise.flatten(factors_fn(directions_C))
        return {path: _contract(leaf, w_C, rank, noise.is_stacked(path)) for path, leaf in flat.items()}

    K = w_K.shape[0]
    if chunk_size is None or chunk_size >= K:
        return chunk_sum(jnp.arange(K), w_K)
    chunks = -(-K // chunk_size)
    w_CxS = jnp.pad(w_K, (0, chunks * chunk_size - K)).reshape(chunks, chunk_size)
    dirs_CxS = jnp.arange(chunks * chunk_size).reshape(chunks, chunk_size)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(chunk_sum, dirs_CxS[0], w_CxS[0]))

    def body(total, xs):
        part = chunk_sum(*xs)
        return jax.tree.map(jnp.add, total, part), None

    total, _ = jax.lax.scan(body, zeros, (dirs_CxS, w_CxS))
    return total
