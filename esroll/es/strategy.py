"""ES shaped like an optax transformation: a factory closes over the ES config and the optimizer and returns pure
`init / ask / tell` over parameter pytrees.

    strategy = es.make_strategy(es.ESConfig(method="looroll", population=64, sigma=5e-3), optax.adam(1e-3))
    state = strategy.init(params, key)
    deltas = strategy.ask(state, params)          # member-level low-rank factors of this step, scale folded in
    fitness_M = ... generate / forward with Perturbation(deltas, member_B) ...
    params, state, metrics = strategy.tell(params, state, fitness_M)

All three are pure and jit-able as they are (`jax.jit(strategy.tell)`): nothing is a static argument. `tell`
regenerates the step's noise from (key, step) instead of receiving it, so across devices only the M fitness scalars
travel. Members with non-finite fitness are dropped and a step with too few left is skipped (parameters and
optimizer state kept): see `estimators`. The optimizer holds state for the perturbed leaves only; frozen leaves pass
through untouched.

`ESSettings` and `ESConfig` live in `esroll.config` with every other config (importable from here and from
`esroll.es`); the names they hold are checked against this package's registries by `check_es_names`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from esroll.config import ConfigError, ESConfig, ESSettings, check_fields, make_schedule
from esroll.es import estimators, noise, shaping

Array = jax.Array


def check_es_names(cfg: ESSettings) -> None:
    """Raise the one-line ConfigError of the first name in `cfg` that names no implementation: its fitness shapings
    (`esroll.es.shaping.SHAPINGS`) and, in an `ESConfig`, its estimator (`estimators.ESTIMATORS`) and the population it
    can fill. The dataclasses of `esroll.config` check everything else when they are built but cannot see these
    registries; `make_strategy` runs this, so that a config built by hand is refused before anything runs."""
    checks = [
        ("shaping", cfg.shaping in shaping.SHAPINGS, shaping.SHAPINGS.expected()),
        ("prompt_shaping", cfg.prompt_shaping in shaping.SHAPINGS, shaping.SHAPINGS.expected()),
    ]
    if isinstance(cfg, ESConfig):
        checks.insert(0, ("method", cfg.method in estimators.ESTIMATORS, estimators.ESTIMATORS.expected()))
    check_fields(cfg, checks, type(cfg).__name__)
    if isinstance(cfg, ESConfig):
        estimators.check_population(cfg.method, cfg.population, where=type(cfg).__name__)


def shaping_of(cfg: ESSettings):
    """`cfg.shaping` as a function, with its options from `cfg.shaping_options` when it takes some."""
    return shaping.get(cfg.shaping, cfg.shaping_options)


class ESState(NamedTuple):
    step: Array  # int32; the noise of step t is a function of (key, t)
    key: Array
    opt_state: Any


def leaf_kinds(cfg: ESConfig, params: dict) -> dict[str, str]:
    return noise.plan(params, cfg.lowrank_patterns, cfg.dense_patterns, cfg.frozen_patterns)


def step_factors(cfg: ESConfig, key: Array, step, params: dict, directions_E: Array) -> dict:
    """Unscaled noise of the given directions at `step` (see `noise.factors`)."""
    return noise.factors(key, step, params, leaf_kinds(cfg, params), cfg.rank, directions_E)


def sigma_at(cfg: ESSettings, step) -> Array | float:
    """σ at `step` (`sigma_schedule`)."""
    sigma = make_schedule(cfg.sigma_schedule, cfg.sigma, cfg.sigma_final, cfg.sigma_horizon)
    return sigma(step) if callable(sigma) else sigma


def member_deltas(cfg: ESConfig, key: Array, step, params: dict) -> dict:
    """Deltas of every member at `step`: member i is θ + sign_i·σ_t·E_{direction_i}."""
    direction_M, sign_M = estimators.member_directions(cfg.method, cfg.population)
    factors = step_factors(cfg, key, step, params, jnp.arange(estimators.num_directions(cfg.method, cfg.population)))
    return noise.member_deltas(factors, params, direction_M, sigma_at(cfg, step) * sign_M, cfg.rank)


def estimate(cfg: ESConfig, key: Array, step, params: dict, fitness_M: Array) -> tuple[dict, estimators.Weights]:
    """ĝ (ascent direction, same tree as params, zeros on frozen leaves) from the members' fitness at `step`."""
    sums, weights = _estimate_perturbed(cfg, key, step, params, fitness_M)
    flat = noise.flatten(params)
    grad = {path: sums[path].astype(p.dtype) if path in sums else jnp.zeros_like(p) for path, p in flat.items()}
    return noise.unflatten(grad), weights


def _estimate_perturbed(cfg: ESConfig, key: Array, step, params: dict, fitness_M: Array):
    """ĝ on the perturbed leaves only ({path: float32 array}), and the estimator's weights."""
    weights = _weights(cfg, step, fitness_M)
    sums = estimators.weighted_sum(
        lambda dirs: step_factors(cfg, key, step, params, dirs), weights.w_E, cfg.rank, cfg.chunk_size or None
    )
    return sums, weights


def _weights(cfg: ESConfig, step, fitness_M: Array) -> estimators.Weights:
    return estimators.direction_weights(
        cfg.method, fitness_M, sigma_at(cfg, step), shaping_of(cfg), cfg.min_valid_fraction
    )


def _norm(tree) -> Array:
    return optax.tree.norm(tree).astype(jnp.float32)


def trainable(cfg: ESConfig, params: dict) -> dict:
    """The perturbed leaves of `params` (a sub-tree of it): what the optimizer sees and keeps state for."""
    kinds = leaf_kinds(cfg, params)
    return noise.unflatten({path: x for path, x in noise.flatten(params).items() if path in kinds})


class Strategy(NamedTuple):
    """Pure functions of one ES configuration and optimizer, like `optax.GradientTransformation`."""

    init: Callable[[dict, Array], ESState]  # (params, key) -> state
    ask: Callable[[ESState, dict], dict]  # (state, params) -> member deltas for `Perturbation`
    # (params, state, fitness_M) -> (params, state, metrics): inputs and outputs in the same order, so that jit's
    # buffer donation (`donate_argnums=(0, 1)`) writes each new leaf into its own old buffer
    tell: Callable[[dict, ESState, Array], tuple[dict, ESState, dict]]


def make_strategy(
    cfg: ESConfig,
    optimizer: optax.GradientTransformation,
    *,
    constrain: Callable[[dict], dict] | None = None,
) -> Strategy:
    """ES with `cfg` whose update goes through `optimizer` (the ascent direction is negated for optax).

    The optimizer sees only the perturbed leaves (`trainable`): frozen leaves have no optimizer state and are passed
    through untouched (weight decay never reaches them). The update is computed in each leaf's dtype, so parameters
    held in float32 (the trainer's master weights) are updated in float32 whatever dtype the rollouts decode in.
    `constrain` (identity by default) is applied to the gradient and the new parameters: the trainer passes a sharding
    constraint so each device computes only its shard of the update (`esroll.sharding.master_shardings`).
    An estimator or shaping that `cfg` names but no module implements is refused here (`check_es_names`).
    """
    check_es_names(cfg)
    constrain = constrain or (lambda tree: tree)

    def init(params: dict, key: Array) -> ESState:
        kinds = leaf_kinds(cfg, params)
        if not kinds:
            raise ConfigError(
                "lowrank_patterns",
                cfg.lowrank_patterns,
                "patterns that perturb at least one parameter leaf (check dense_patterns and frozen_patterns too)",
                where="ESConfig",
            )
        if "embed" in kinds:  # the token lookup (and a tied head) takes no perturbation: its update would be blind
            raise ConfigError("frozen_patterns", cfg.frozen_patterns, "patterns that freeze 'embed'", where="ESConfig")
        return ESState(jnp.zeros((), jnp.int32), key, optimizer.init(trainable(cfg, params)))

    def ask(state: ESState, params: dict) -> dict:
        """This step's member-level deltas, ready for `Perturbation(deltas, member_B)`."""
        return member_deltas(cfg, state.key, state.step, params)

    def tell(params: dict, state: ESState, fitness_M: Array) -> tuple[dict, ESState, dict[str, Array]]:
        """Apply one ES step from the members' fitness (higher is better); returns (params, state, metrics)."""
        train = trainable(cfg, params)
        sums, weights = _estimate_perturbed(cfg, state.key, state.step, params, fitness_M)
        flat_train = noise.flatten(train)
        grad = constrain(noise.unflatten({path: sums[path].astype(x.dtype) for path, x in flat_train.items()}))

        def apply(train, opt_state):
            updates, opt_state = optimizer.update(jax.tree.map(jnp.negative, grad), opt_state, train)
            new_train = constrain(optax.apply_updates(train, updates))
            return new_train, opt_state, _norm(grad), _norm(updates)

        def skip(train, opt_state):
            return train, opt_state, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)

        # A skipped step leaves parameters and moments exactly as they were: the update is not computed at all
        # (its weights are zero, so the gradient's norm is 0).
        new_train, opt_state, grad_norm, update_norm = jax.lax.cond(
            weights.skipped, skip, apply, train, state.opt_state
        )
        skipped = weights.skipped
        new_train = noise.flatten(new_train)
        new_flat = {path: new_train.get(path, x) for path, x in noise.flatten(params).items()}
        finite_M = jnp.where(jnp.isfinite(fitness_M), fitness_M, jnp.nan)
        metrics = {
            "fitness_mean": jnp.nanmean(finite_M),  # over finite members (NaN if there are none)
            "fitness_std": jnp.nanstd(finite_M),
            "fitness_max": jnp.nanmax(finite_M),
            "num_nonfinite": weights.num_nonfinite,
            "num_dropped": weights.num_dropped,
            "skipped": skipped,
            "grad_norm": grad_norm,
            "update_norm": update_norm,
            "sigma": jnp.asarray(sigma_at(cfg, state.step), jnp.float32),
        }
        return noise.unflatten(new_flat), ESState(state.step + 1, state.key, opt_state), metrics

    return Strategy(init, ask, tell)
