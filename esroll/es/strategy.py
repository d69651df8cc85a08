"""ES as init / ask / tell over parameter pytrees, with optax inside.

    state = init(cfg, params, optimizer, key)
    deltas = ask(cfg, state, params)                      # member-level low-rank factors of this step
    fitness_N = ... forward(..., perturb=Perturbation(deltas, member_B)) ...
    params, state, metrics = tell(cfg, state, params, fitness_N, optimizer)

`tell` regenerates the step's noise from (key, step) instead of receiving it, so across devices only the N fitness
scalars travel. All three are jit-able with `cfg` static (close over `optimizer`). Members with non-finite fitness
are dropped and a step with too few left is skipped (parameters and optimizer state kept): see `estimators`.
Frozen leaves get a zero gradient: wrap the optimizer in `optax.masked` if it applies weight decay.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from esroll import advantages
from esroll.es import estimators, noise

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class ESConfig:
    """What an ES step does; frozen and hashable, so it is a static jit argument.

    method: "eggroll" (antithetic pairs, population even) or "looroll" (one evaluation per direction, LOO baseline).
    sigma: perturbation radius (member i is θ ± σ·E_i). rank: r of E = ABᵀ/√r.
    shaping: a name in `esroll.advantages`, applied to the fitness before the estimator (raw keeps it unbiased;
    zscore makes the update independent of the reward scale).
    Leaf selection by path regex (see `noise`): defaults freeze embed / lm_head and vectors, perturb other matrices.
    chunk_size: directions per chunk when `tell` sums the update (None: all at once).
    min_valid_fraction: non-finite fitness is dropped (see `estimators`); a step keeping fewer members than this
    fraction of the population is skipped.
    """

    method: str = "looroll"
    population: int = 64
    rank: int = 1
    sigma: float = 1e-3
    shaping: str = "zscore"
    lowrank_patterns: tuple[str, ...] = (".*",)
    dense_patterns: tuple[str, ...] = ()
    frozen_patterns: tuple[str, ...] = ("embed", "lm_head")
    chunk_size: int | None = None
    min_valid_fraction: float = 0.5

    def __post_init__(self):
        def check(ok: bool, field: str, why: str):
            if not ok:
                raise ValueError(f"ESConfig.{field} = {getattr(self, field)!r}: {why}")

        check(self.method in estimators.METHODS, "method", f"must be one of {', '.join(estimators.METHODS)}")
        check(self.population >= 2, "population", "must be at least 2")
        check(self.method != "eggroll" or self.population % 2 == 0, "population", "must be even for eggroll")
        check(self.rank >= 1, "rank", "must be at least 1")
        check(self.sigma > 0 and math.isfinite(self.sigma), "sigma", "must be a positive finite number")
        check(self.shaping in advantages.SHAPINGS, "shaping", f"must be one of {', '.join(advantages.SHAPINGS)}")
        check(self.chunk_size is None or self.chunk_size >= 1, "chunk_size", "must be None or at least 1")
        check(0 <= self.min_valid_fraction <= 1, "min_valid_fraction", "must be in [0, 1]")
        for field in ("lowrank_patterns", "dense_patterns", "frozen_patterns"):
            check(isinstance(getattr(self, field), tuple), field, "must be a tuple of regexes")
            for p in getattr(self, field):
                try:
                    re.compile(p)
                except re.error as e:
                    check(False, field, f"bad regex {p!r} ({e})")

    @property
    def num_directions(self) -> int:
        return estimators.num_directions(self.method, self.population)


class ESState(NamedTuple):
    step: Array  # int32; the noise of step t is a function of (key, t)
    key: Array
    opt_state: Any


def leaf_kinds(cfg: ESConfig, params: dict) -> dict[str, str]:
    return noise.plan(params, cfg.lowrank_patterns, cfg.dense_patterns, cfg.frozen_patterns)


def init(cfg: ESConfig, params: dict, optimizer: optax.GradientTransformation, key: Array) -> ESState:
    if not leaf_kinds(cfg, params):
        raise ValueError(
            "ESConfig: no parameter leaf is perturbed; check lowrank_patterns / dense_patterns / frozen_patterns"
        )
    return ESState(jnp.zeros((), jnp.int32), key, optimizer.init(params))


def step_factors(cfg: ESConfig, key: Array, step, params: dict, directions_K: Array) -> dict:
    """Unscaled noise of the given directions at `step` (see `noise.factors`)."""
    return noise.factors(key, step, params, leaf_kinds(cfg, params), cfg.rank, directions_K)


def member_deltas(cfg: ESConfig, key: Array, step, params: dict) -> dict:
    """Deltas of every member at `step`: member i is θ + sign_i·σ·E_{direction_i}."""
    direction_N, sign_N = estimators.member_directions(cfg.method, cfg.population)
    factors = step_factors(cfg, key, step, params, jnp.arange(cfg.num_directions))
    return noise.member_deltas(factors, params, direction_N, cfg.sigma * sign_N, cfg.rank)


def ask(cfg: ESConfig, state: ESState, params: dict) -> dict:
    """This step's member-level deltas, ready for `Perturbation(deltas, member_B)`."""
    return member_deltas(cfg, state.key, state.step, params)


def estimate(cfg: ESConfig, key: Array, step, params: dict, fitness_N: Array) -> tuple[dict, estimators.Weights]:
    """ĝ (ascent direction, same tree as params, zeros on frozen leaves) from the members' fitness at `step`."""
    weights = estimators.direction_weights(cfg.method, fitness_N, cfg.sigma, cfg.shaping, cfg.min_valid_fraction)
    sums = estimators.weighted_sum(
        lambda dirs: step_factors(cfg, key, step, params, dirs), weights.w_K, cfg.rank, cfg.chunk_size
    )
    flat = noise.flatten(params)
    grad = {path: sums[path].astype(p.dtype) if path in sums else jnp.zeros_like(p) for path, p in flat.items()}
    return noise.unflatten(grad), weights


def tell(
    cfg: ESConfig, state: ESState, params: dict, fitness_N: Array, optimizer: optax.GradientTransformation
) -> tuple[dict, ESState, dict[str, Array]]:
    """Apply one ES step from the members' fitness (higher is better); returns (params, state, metrics)."""
    grad, weights = estimate(cfg, state.key, state.step, params, fitness_N)
    updates, opt_state = optimizer.update(jax.tree.map(jnp.negative, grad), state.opt_state, params)
    new_params = optax.apply_updates(params, updates)

    def unless_skipped(new, old):
        return jax.tree.map(lambda n, o: jnp.where(weights.skipped, o, n), new, old)

    finite_N = jnp.where(jnp.isfinite(fitness_N), fitness_N, jnp.nan)
    metrics = {
        "fitness_mean": jnp.nanmean(finite_N),  # over finite members (NaN if there are none)
        "fitness_std": jnp.nanstd(finite_N),
        "fitness_max": jnp.nanmax(finite_N),
        "num_nonfinite": weights.num_nonfinite,
        "num_dropped": weights.num_dropped,
        "skipped": weights.skipped,
        "grad_norm": optax.tree.norm(grad),
        "update_norm": jnp.where(weights.skipped, 0.0, optax.tree.norm(updates)),
    }
    new_state = ESState(state.step + 1, state.key, unless_skipped(opt_state, state.opt_state))
    return unless_skipped(new_params, params), new_state, metrics
