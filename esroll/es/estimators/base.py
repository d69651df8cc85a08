"""The ES estimators of the population field g(θ) = E[J(θ+σE)·E]/σ, as per-direction weights, and their registry.

Every estimator is ĝ = Σ_k w_k E_k over the step's E directions, so one code path turns weights into an update; an
estimator (`Estimator`, one module each, registered with `register_estimator`) says only how members map to
directions and how their fitnesses become the weights w. The built-ins, with M members:
    eggroll   antithetic, members 2k, 2k+1 = θ ± σE_k (E = M/2):   w_k = (f⁺_k − f⁻_k) / (Mσ)
    looroll   member i = θ + σE_i (E = M), leave-one-out baseline:  w_i = (f_i − f̄) / ((M−1)σ)
(f are the shaped fitnesses; raw fitness keeps both unbiased). The config's `method` names the estimator of an ES
run; each registered estimator is a training method (`esroll.methods`). The update of a low-rank leaf,
Σ_k w_k A_k B_kᵀ/√r, is one contraction over (direction, rank) per layer, optionally chunked over directions so that
only a chunk's factors are live at once; chunks give the same sum.

Non-finite fitness never reaches the parameters:
- a member with NaN/±inf fitness is dropped, and so is every member sharing its direction (an antithetic pair
  without both halves has no estimate); the estimate is over the directions left, with the M' members kept in place
  of M, and fitness shaping sees only the members kept;
- if fewer than max(2, min_valid_fraction·M) members are kept, every weight is zero and `skipped` is set: the caller
  (`strategy.tell`) then leaves parameters and optimizer state untouched and only advances the step.
`num_nonfinite` counts the non-finite members, `num_dropped` every member left out (partners included).

Shape letters (see `esroll`): M population members, E directions, C chunks of directions, Z directions per chunk,
L layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from esroll.config import ConfigError
from esroll.es import noise
from esroll.es import shaping as shapings
from esroll.models import LowRank
from esroll.registry import Registry

Array = jax.Array


class Estimator(NamedTuple):
    """An ES estimator: `members_per_direction` members share each direction (the population a multiple of it;
    `members_per_direction` consecutive members per direction, the first with sign +); `signs(k)` [k] the members'
    signs along their direction; `weights(f_M, keep_M, kept, sigma)` → w_E from the shaped fitnesses (zero where not
    kept) and the M' = `kept` members kept; `min_directions` the fewest directions an estimate needs (a
    leave-one-out baseline needs a second); `mse(population, v, v_dense)` the predicted E‖ĝ − G‖² under the affine
    model with raw fitness (`esroll.es.theory`), or None."""

    members_per_direction: int
    signs: Callable[[int], Array]
    weights: Callable[[Array, Array, Array, Array], Array]
    min_directions: int = 1
    mse: Callable[[int, Array, Array], Array] | None = None


ESTIMATORS: Registry[Estimator] = Registry("ES estimator", "method")


def register_estimator(name: str, estimator: Estimator, *, replace: bool = False) -> Estimator:
    """Register an ES estimator under `name` (then a config's `method`; `esroll.methods` makes it a training method)."""
    if not isinstance(estimator.members_per_direction, int) or estimator.members_per_direction < 1:
        raise ValueError(f"ES estimator {name!r}: members_per_direction must be an integer >= 1")
    return ESTIMATORS.add(name, estimator, replace=replace)


def check_population(method: str, population: int, key: str = "population", where: str = "config") -> None:
    """The one-line ConfigError of a population that `method`'s members cannot fill (not a multiple of its members
    per direction)."""
    k = ESTIMATORS.lookup(method).members_per_direction
    if population % k:
        raise ConfigError(key, population, f"a multiple of {k} for {method} ({k} members per direction)", where=where)


class Weights(NamedTuple):
    w_E: Array  # [E] float32: ĝ = Σ_k w_k E_k
    num_nonfinite: Array  # int32: members with non-finite fitness
    num_dropped: Array  # int32: members left out of the estimate
    skipped: Array  # bool: too few members left; all weights are zero


def num_directions(method: str, population: int) -> int:
    """E, the directions of a step of `population` members."""
    return population // ESTIMATORS.lookup(method).members_per_direction


def member_directions(method: str, population: int) -> tuple[Array, Array]:
    """(direction_M, sign_M): member i evaluates direction i // k with the sign of its place among the k members of
    that direction (eggroll: members 2k, 2k+1 share direction k with signs +, −; looroll: member i uses i, +)."""
    est = ESTIMATORS.lookup(method)
    k = est.members_per_direction
    i = jnp.arange(population)
    return i // k, jnp.tile(jnp.asarray(est.signs(k), jnp.float32), population // k)


def direction_weights(
    method: str, fitness_M: Array, sigma: float, shaping: str | Callable = "raw", min_valid_fraction: float = 0.5
) -> Weights:
    """The estimator's weights on the step's directions, after the non-finite policy and fitness shaping (a name in
    `esroll.es.shaping.SHAPINGS` at its default options, or a shaping function, `esroll.es.shaping.get`)."""
    est = ESTIMATORS.lookup(method)
    M, k = fitness_M.shape[0], est.members_per_direction
    finite_M = jnp.isfinite(fitness_M)
    keep_M = jnp.repeat(finite_M.reshape(-1, k).all(axis=1), k)  # a direction is kept with all its members
    kept = keep_M.sum()
    skipped = kept < max(2, math.ceil(min_valid_fraction * M))
    shaped = shapings.get(shaping) if isinstance(shaping, str) else shaping
    f_M = shaped(fitness_M, keep_M)  # zero where not kept
    w_E = est.weights(f_M, keep_M, kept, sigma)
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
    C = -(-E // chunk_size)  # C chunks of Z = chunk_size directions each
    w_CxZ = jnp.pad(w_E, (0, C * chunk_size - E)).reshape(C, chunk_size)
    directions_CxZ = jnp.arange(C * chunk_size).reshape(C, chunk_size)
    zeros = jax.eval_shape(chunk_sum, directions_CxZ[0], w_CxZ[0])
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), zeros)

    def body(total, xs):
        part = chunk_sum(*xs)
        return jax.tree.map(jnp.add, total, part), None

    total, _ = jax.lax.scan(body, zeros, (directions_CxZ, w_CxZ))
    return total
