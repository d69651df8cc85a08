"""ES shaped like an optax transformation: a factory closes over the ES config and the optimizer and returns pure
`init / ask / tell` over parameter pytrees.

    strategy = es.make_strategy(es.ESConfig(method="looroll", population=64, sigma=5e-3), optax.adam(1e-3))
    state = strategy.init(params, key)
    deltas = strategy.ask(state, params)          # member-level low-rank factors of this step, scale folded in
    fitness_M = ... generate / forward with Perturbation(deltas, member_B) ...
    params, state, metrics = strategy.tell(state, params, fitness_M)

All three are pure and jit-able as they are (`jax.jit(strategy.tell)`): nothing is a static argument. `tell`
regenerates the step's noise from (key, step) instead of receiving it, so across devices only the M fitness scalars
travel. Members with non-finite fitness are dropped and a step with too few left is skipped (parameters and
optimizer state kept): see `estimators`. The optimizer holds state for the perturbed leaves only; frozen leaves pass
through untouched.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from esroll import advantages
from esroll.errors import ConfigError, check_fields
from esroll.es import estimators, noise
from esroll.schedules import SCHEDULES, make_schedule

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class ESSettings:
    """The ES settings a config file's `es` section holds (the estimator, `method`, is the experiment's top level).

    These defaults are the only ones: config files start from them (`configs/default.py`) and set what differs.
    population: members M per step. rank: r of E = ABᵀ/√r. sigma: perturbation radius (member i is θ ± σ·E_i); it
    follows `sigma_schedule` (`esroll.schedules`: constant | linear | cosine) to `sigma_final` over `sigma_horizon`
    steps, the same σ_t in the members' perturbation and in the estimator's 1/σ.
    shaping: a name in `esroll.advantages`, applied to the fitness before the estimator (raw keeps it unbiased;
    zscore makes the update independent of the reward scale).
    How rewards become a member's fitness: each member answers each of the step's prompts `samples` times (K; more
    than 1 needs train.temperature > 0), `sample_reduce` folds the K rewards (mean, or max: max@K, pass@K on 0/1
    rewards), `prompt_shaping` (a name in `esroll.advantages.SHAPINGS`, across the members, prompt by prompt:
    GRPO's group-relative normalisation, with the population as the group; raw: none) and the mean over prompts.
    Leaf selection by path regex (see `noise`): defaults freeze embed / lm_head and vectors, perturb other matrices.
    chunk_size: directions per chunk when `tell` sums the update (0: all at once).
    min_valid_fraction: non-finite fitness is dropped (see `estimators`); a step keeping fewer members than this
    fraction of the population is skipped.
    """

    population: int = 64
    rank: int = 1
    sigma: float = 1e-3
    sigma_schedule: str = "constant"
    sigma_final: float = 0.0
    sigma_horizon: int = 0
    shaping: str = "zscore"
    samples: int = 1
    sample_reduce: str = "mean"
    prompt_shaping: str = "raw"
    lowrank_patterns: tuple[str, ...] = (".*",)
    dense_patterns: tuple[str, ...] = ()
    frozen_patterns: tuple[str, ...] = ("embed", "lm_head")
    chunk_size: int = 0
    min_valid_fraction: float = 0.5

    def __post_init__(self):
        where = type(self).__name__
        checks = [
            ("population", self.population >= 2, ">= 2"),
            ("rank", self.rank >= 1, ">= 1"),
            ("sigma", self.sigma > 0 and math.isfinite(self.sigma), "a positive finite number"),
            ("sigma_schedule", self.sigma_schedule in SCHEDULES, f"one of {', '.join(SCHEDULES)}"),
            (
                "sigma_final",
                self.sigma_schedule == "constant" or (self.sigma_final > 0 and math.isfinite(self.sigma_final)),
                "a positive finite number (the estimator divides by σ)",
            ),
            ("sigma_horizon", self.sigma_schedule == "constant" or self.sigma_horizon >= 1, ">= 1 with a schedule"),
            ("shaping", self.shaping in advantages.SHAPINGS, f"one of {', '.join(advantages.SHAPINGS)}"),
            ("samples", self.samples >= 1, ">= 1"),
            ("sample_reduce", self.sample_reduce in ("mean", "max"), "mean or max"),
            (
                "prompt_shaping",
                self.prompt_shaping in advantages.SHAPINGS,
                f"one of {', '.join(advantages.SHAPINGS)}",
            ),
            ("chunk_size", self.chunk_size >= 0, ">= 0 (0: all directions at once)"),
            ("min_valid_fraction", 0 <= self.min_valid_fraction <= 1, "in [0, 1]"),
        ]
        for field in ("lowrank_patterns", "dense_patterns", "frozen_patterns"):
            patterns = getattr(self, field)
            ok = isinstance(patterns, tuple) and all(isinstance(p, str) and _compiles(p) for p in patterns)
            checks.append((field, ok, "a tuple of valid regular expressions"))
        check_fields(self, checks, where)


@dataclasses.dataclass(frozen=True)
class ESConfig(ESSettings):
    """What an ES step does: the settings plus the estimator, `method`: "eggroll" (antithetic pairs, population
    even) or "looroll" (one evaluation per direction, leave-one-out baseline)."""

    method: str = "looroll"

    def __post_init__(self):
        super().__post_init__()
        if self.method not in estimators.METHODS:
            raise ConfigError("method", self.method, f"one of {', '.join(estimators.METHODS)}", where="ESConfig")
        if self.method == "eggroll" and self.population % 2:
            raise ConfigError("population", self.population, "even for eggroll (antithetic pairs)", where="ESConfig")

    @classmethod
    def of(cls, method: str, settings: ESSettings) -> ESConfig:
        return cls(method=method, **{f.name: getattr(settings, f.name) for f in dataclasses.fields(ESSettings)})

    @property
    def num_directions(self) -> int:
        return estimators.num_directions(self.method, self.population)


def _compiles(pattern: str) -> bool:
    try:
        re.compile(pattern)
    except re.error:
        return False
    return True


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
    factors = step_factors(cfg, key, step, params, jnp.arange(cfg.num_directions))
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
    return estimators.direction_weights(cfg.method, fitness_M, sigma_at(cfg, step), cfg.shaping, cfg.min_valid_fraction)


def tile_count(cfg: ESConfig, train: dict, tile_entries: int) -> int:
    """How many tiles `_tiled_update` cuts the perturbed leaves `train` into, or 0 where they do not tile.

    Every leaf is cut into the same number T of tiles of whole rows (a tile holds rows of one layer only), so the
    optimizer sees one tree per tile. That needs every leaf low-rank and all of them layer-stacked with the same L
    (or all single): T = L·c with c dividing every leaf's input dimension, the smallest such c whose tiles of the
    largest leaf hold at most `tile_entries`. 0 also when `tile_entries` is 0 or `chunk_size` splits the directions.
    """
    kinds = leaf_kinds(cfg, train)
    if not tile_entries or not kinds or 0 < cfg.chunk_size < cfg.num_directions:
        return 0
    if any(kind != noise.LOWRANK for kind in kinds.values()):
        return 0
    flat = noise.flatten(train)
    layers = {flat[path].shape[0] if noise.is_stacked(path) else 0 for path in kinds}
    if len(layers) != 1:
        return 0
    L = layers.pop() or 1
    rows = math.gcd(*(flat[path].shape[-2] for path in kinds))
    largest = max(flat[path].size for path in kinds)
    c = next(c for c in range(1, rows + 1) if rows % c == 0 and (largest // (L * c) <= tile_entries or c == rows))
    return L * c


def _tiled_update(optimizer, factors: dict, w_E: Array, rank: int, tiles: int, train: dict, opt_state):
    """(new train, new optimizer state, ‖ĝ‖, ‖update‖) computed over `tiles` tiles of rows (`tile_count`) under
    `lax.map`: for each tile, ĝ's rows Σ_k w_k a_k[rows] b_kᵀ/√r as one GEMM over (direction, rank), then the
    optimizer on that tile alone. Exact for an optimizer that acts entry by entry (the same arithmetic per entry as
    the whole-tree update; only the GEMM's summation order can differ). Optimizer-state leaves that mirror a
    parameter are tiled with it; the others (step counts) are the same input to every tile, and the first tile's new
    value is kept (every tile computes the same one).

    (Tried and not kept, `tell` at Qwen3-0.6B shapes on a CPU, interleaved: updating the masters and moments in
    place under `lax.fori_loop` instead, with the skipped step as a `lax.cond` per tile: 2.6-4.1 s against
    1.8-2.6 s for this form; with a select per tile, or with the one `lax.cond` around the loop, its first call took
    minutes.)
    """
    flat = noise.flatten(train)
    A, B = {}, {}  # A: [T, rows per tile, E·R] scaled by w/√r; B: [L, out, E·R]
    for path, f in noise.flatten(factors).items():
        a, b = (f.a, f.b) if noise.is_stacked(path) else (f.a[None], f.b[None])  # [L, E, I, R], [L, E, O, R]
        L, E, _, R = a.shape
        a = a * (w_E[None, :, None, None] / math.sqrt(rank))
        A[path] = a.transpose(0, 2, 1, 3).reshape(tiles, -1, E * R)
        B[path] = b.transpose(0, 2, 1, 3).reshape(L, b.shape[2], E * R)
    per_layer = tiles // next(iter(B.values())).shape[0]

    def tile(x):
        return x.reshape(tiles, -1, x.shape[-1])

    leaves, treedef = jax.tree.flatten(opt_state)
    mirrors = jax.tree.leaves(
        optax.tree_map_params(optimizer, lambda _: True, opt_state, transform_non_params=lambda _: False)
    )
    others = [x for x, m in zip(leaves, mirrors) if not m]

    def one(xs):
        t, train_t, a_t, mirrored_t = xs
        layer = t // per_layer
        grad_t = {
            path: jnp.einsum("ic,oc->io", a_t[path], B[path][layer]).astype(x.dtype) for path, x in train_t.items()
        }
        mirrored, other = iter(mirrored_t), iter(others)
        state_t = treedef.unflatten([next(mirrored) if m else next(other) for m in mirrors])
        grad_t, train_t = noise.unflatten(grad_t), noise.unflatten(train_t)
        updates, state_t = optimizer.update(jax.tree.map(jnp.negative, grad_t), state_t, train_t)
        new = jax.tree.leaves(state_t)
        return (
            noise.flatten(optax.apply_updates(train_t, updates)),
            [x for x, m in zip(new, mirrors) if m],
            [x for x, m in zip(new, mirrors) if not m],
            _sumsq(grad_t),
            _sumsq(updates),
        )

    xs = (
        jnp.arange(tiles),
        {path: tile(x) for path, x in flat.items()},
        A,
        [tile(x) for x, m in zip(leaves, mirrors) if m],
    )
    new_flat, mirrored, other, grad_sq, update_sq = jax.lax.map(one, xs)
    new_train = noise.unflatten({path: new_flat[path].reshape(x.shape) for path, x in flat.items()})
    mirrored, other = iter(mirrored), iter(other)
    new_leaves = [next(mirrored).reshape(x.shape) if m else next(other)[0] for x, m in zip(leaves, mirrors)]
    return new_train, treedef.unflatten(new_leaves), jnp.sqrt(grad_sq.sum()), jnp.sqrt(update_sq.sum())


def _sumsq(tree) -> Array:
    return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree))


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
    tell: Callable[[ESState, dict, Array], tuple[dict, ESState, dict]]  # (state, params, fitness_M) -> ...


def make_strategy(
    cfg: ESConfig,
    optimizer: optax.GradientTransformation,
    *,
    constrain: Callable[[dict], dict] | None = None,
    tile_entries: int = 0,
) -> Strategy:
    """ES with `cfg` whose update goes through `optimizer` (the ascent direction is negated for optax).

    The optimizer sees only the perturbed leaves (`trainable`): frozen leaves have no optimizer state and are passed
    through untouched (weight decay never reaches them). The update is computed in each leaf's dtype, so parameters
    held in float32 (the trainer's master weights) are updated in float32 whatever dtype the rollouts decode in.
    `constrain` (identity by default) is applied to the gradient and the new parameters: the trainer passes a sharding
    constraint so each device computes only its shard of the update (`esroll.sharding.master_shardings`).

    `tile_entries` > 0 computes the update tile by tile (`_tiled_update`): each perturbed leaf's rows in tiles of at
    most about that many entries, the tile's low-rank sum and optimizer step done before the next tile is read, so
    the gradient is never written out whole. Only for an optimizer that acts entry by entry (sgd, adam, adamw; not
    global-norm clipping) and unsharded parameters: the trainer turns it on for a one-device CPU mesh, where XLA
    makes a separate pass over memory for each step of the optimizer's arithmetic. Leaves that do not tile (see
    `tile_count`) take the whole-tree path; both give the same update up to float rounding.
    """
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

    def tell(state: ESState, params: dict, fitness_M: Array) -> tuple[dict, ESState, dict[str, Array]]:
        """Apply one ES step from the members' fitness (higher is better); returns (params, state, metrics)."""
        train = trainable(cfg, params)
        tiles = tile_count(cfg, train, tile_entries)
        if tiles:
            weights = _weights(cfg, state.step, fitness_M)
            factors = step_factors(cfg, state.key, state.step, params, jnp.arange(cfg.num_directions))

            def apply(train, opt_state):
                return _tiled_update(optimizer, factors, weights.w_E, cfg.rank, tiles, train, opt_state)

        else:
            sums, weights = _estimate_perturbed(cfg, state.key, state.step, params, fitness_M)
            flat_train = noise.flatten(train)
            grad = constrain(noise.unflatten({path: sums[path].astype(x.dtype) for path, x in flat_train.items()}))

            def apply(train, opt_state):
                updates, opt_state = optimizer.update(jax.tree.map(jnp.negative, grad), opt_state, train)
                new_train = constrain(optax.apply_updates(train, updates))
                return new_train, opt_state, _norm(grad), _norm(updates)

        def skip(train, opt_state):
            return train, opt_state, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)

        # A skipped step leaves parameters and moments exactly as they were: the update is not computed at all (its
        # weights are zero, so the gradient's norm is 0).
        skipped = weights.skipped
        new_train, opt_state, grad_norm, update_norm = jax.lax.cond(skipped, skip, apply, train, state.opt_state)
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
