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


def tile_counts(cfg: ESConfig, train: dict, tile_entries: int) -> dict[str, int]:
    """How many tiles `_tiled_update` cuts each perturbed leaf of `train` into ({path: tiles}), or {} where the update
    does not tile.

    A leaf [L, I, O] (or a single matrix [I, O], L = 1) is cut into L·c tiles of I/c whole rows of one layer, c the
    smallest divisor of I whose tiles hold at most `tile_entries` entries (c = I when none does). {} when
    `tile_entries` is 0, a perturbed leaf is not low-rank (a vector), or `chunk_size` splits the directions.
    """
    kinds = leaf_kinds(cfg, train)
    if not tile_entries or not kinds or 0 < cfg.chunk_size < cfg.num_directions:
        return {}
    if any(kind != noise.LOWRANK for kind in kinds.values()):
        return {}
    flat = noise.flatten(train)
    counts = {}
    for path in kinds:
        shape = flat[path].shape
        (I, O), L = shape[-2:], shape[0] if noise.is_stacked(path) else 1
        counts[path] = L * next(c for c in range(1, I + 1) if I % c == 0 and (I * O // c <= tile_entries or c == I))
    return counts


def _tiled_update(optimizer, factors: dict, w_E: Array, rank: int, tiles: dict, train: dict, opt_state, skipped):
    """(new train, new optimizer state, ‖ĝ‖, ‖update‖) computed leaf by leaf and tile by tile (`tile_counts`), in
    place (`_tiled_leaf`). Exact for an optimizer that acts entry by entry (the same arithmetic per entry as the
    whole-tree update; only the GEMM's summation order can differ). Optimizer-state leaves that mirror a parameter
    are updated with it; the others (step counts) are the same input to every tile, every tile computes the same new
    value, and the last one's is kept.
    """
    flat = noise.flatten(train)
    leaves, treedef = jax.tree.flatten(opt_state)
    owners = jax.tree.leaves(  # the parameter path each state leaf mirrors, "" for the others
        optax.tree_map_params(
            optimizer,
            lambda _, path: path,
            opt_state,
            noise.unflatten({p: p for p in flat}),
            transform_non_params=lambda _: "",
        )
    )
    others = [x for x, owner in zip(leaves, owners) if not owner]
    new_leaves, new_others, grad_sq, update_sq = list(leaves), others, 0.0, 0.0
    for path, f in noise.flatten(factors).items():
        mine = [j for j, owner in enumerate(owners) if owner == path]
        flat[path], moments, new_others, g, u = _tiled_leaf(
            optimizer,
            path,
            flat[path],
            [leaves[j] for j in mine],
            others,
            f,
            w_E / math.sqrt(rank),
            tiles[path],
            skipped,
        )
        for j, m in zip(mine, moments):
            new_leaves[j] = m
        grad_sq, update_sq = grad_sq + g, update_sq + u
    others_it = iter(new_others)
    new_leaves = [y if owner else next(others_it) for y, owner in zip(new_leaves, owners)]
    return noise.unflatten(flat), treedef.unflatten(new_leaves), jnp.sqrt(grad_sq), jnp.sqrt(update_sq)


def _tiled_leaf(optimizer, path: str, x: Array, moments: list, others: list, f, scale_E: Array, tiles: int, skipped):
    """One leaf's update in place: a `lax.fori_loop` over its `tiles` tiles of rows whose carry is the leaf and the
    optimizer-state leaves that mirror it (`moments`). A tile's rows of ĝ, Σ_k w_k a_k[rows] b_kᵀ/√r (`scale_E` =
    w/√r), are one GEMM over (direction, rank) on the factors as drawn ([L, E, I, R]: no transposed copy); then the
    optimizer runs on that tile alone (a one-leaf tree) and the tile's new values are written back where they were
    read. Returns (new leaf, new moments, new `others`, Σ ĝ², Σ update²); Σ ĝ² from the factors (`_lowrank_sumsq`),
    not from the tiles (0 for a skipped step).

    The tile is read inside a `lax.cond` on `skipped` whose other branch returns it unchanged (a skipped step
    writes back what it read). That matters for speed: a conditional's results are buffers of their own, so each
    carried buffer has one reader and one writer per tile and XLA updates it in place. Read directly, the old tile is
    fused into several consumers (optax's new moment is recomputed inside the weights' fusion), one of which runs
    after the in-place write, so XLA copies every carried buffer on every iteration. (`tell` at Qwen3-0.6B shapes on
    a CPU, README: read directly, 45-53 s per call; this form 1.1-1.5 s; the tiles under `lax.map` of the code
    before, whose outputs were fresh buffers each call, 1.8-2.0 s in the same runs.)
    """
    stacked = noise.is_stacked(path)
    a, b = (f.a, f.b) if stacked else (f.a[None], f.b[None])  # [L, E, I, R], [L, E, O, R]
    L, E, I, R = a.shape
    O = b.shape[2]
    per_layer = tiles // L
    rows = I // per_layer
    tile = noise.unflatten({path: jax.ShapeDtypeStruct((rows, O), x.dtype)})  # what the optimizer sees
    tile_leaves, tile_def = jax.tree.flatten(jax.eval_shape(optimizer.init, tile))
    mirrors = jax.tree.leaves(
        optax.tree_map_params(
            optimizer, lambda _: True, tile_def.unflatten(tile_leaves), transform_non_params=lambda _: False
        )
    )
    if sum(mirrors) != len(moments) or len(mirrors) - sum(mirrors) != len(others):
        raise ValueError(f"tiled update of {path}: the optimizer's state does not split by parameter")

    def body(t, carry):
        w, ms, _, update_sq = carry
        layer, row = t // per_layer, t % per_layer * rows

        def cut(full):
            return jax.lax.dynamic_slice(full, (layer, row, 0), (1, rows, O))[0]

        def keep(w, ms):
            return cut(w), [cut(m) for m in ms], others, jnp.zeros((), jnp.float32)

        def step(w, ms):
            a_t = jax.lax.dynamic_slice(a, (layer, 0, row, 0), (1, E, rows, R))[0] * scale_E[:, None, None]
            grad = noise.unflatten({path: jnp.einsum("eir,eor->io", a_t, b[layer]).astype(x.dtype)})
            params = noise.unflatten({path: cut(w)})
            ms_it, others_it = iter([cut(m) for m in ms]), iter(others)
            state = tile_def.unflatten([next(ms_it) if m else next(others_it) for m in mirrors])
            updates, state = optimizer.update(jax.tree.map(jnp.negative, grad), state, params)
            new = jax.tree.leaves(state)
            return (
                noise.flatten(optax.apply_updates(params, updates))[path],
                [s for s, m in zip(new, mirrors) if m],
                [s for s, m in zip(new, mirrors) if not m],
                _sumsq(updates),
            )

        w_t, ms_t, others_t, u = jax.lax.cond(skipped, keep, step, w, ms)

        def put(full, part):
            return jax.lax.dynamic_update_slice(full, part[None], (layer, row, 0))

        return put(w, w_t), [put(m, v) for m, v in zip(ms, ms_t)], others_t, update_sq + u

    lead = (lambda y: y) if stacked else (lambda y: y[None])
    zero = jnp.zeros((), jnp.float32)
    w, moments, others, u = jax.lax.fori_loop(0, tiles, body, (lead(x), [lead(m) for m in moments], others, zero))
    g = jnp.where(skipped, zero, _lowrank_sumsq(a, b, scale_E))
    unlead = (lambda y: y) if stacked else (lambda y: y[0])
    return unlead(w), [unlead(m) for m in moments], others, g, u


def _lowrank_sumsq(a: Array, b: Array, scale_E: Array) -> Array:
    """‖Σ_k s_k a_k b_kᵀ‖² summed over layers (a [L, E, I, R], b [L, E, O, R], s = `scale_E` per direction; k runs
    over (direction, rank)), from the factors' Gram matrices: Σ_k,l s_k s_l (a_k·a_l)(b_k·b_l). Two batched GEMMs of
    (E·R)² outputs per layer instead of a pass over the I·O entries of the sum (the tiled update's gradient norm: at
    Qwen3-0.6B shapes on a CPU, `tell` medians 0.64-0.69 s against 0.72-0.73 s with the sum of the tiles' squares in
    paired calls, README).
    """
    L, E, I, R = a.shape
    a = (a * scale_E[None, :, None, None]).transpose(0, 1, 3, 2).reshape(L, E * R, I)
    b = b.transpose(0, 1, 3, 2).reshape(L, E * R, b.shape[2])
    batched = (((2,), (2,)), ((0,), (0,)))  # contract the long axis, batch over layers
    return jnp.sum(jax.lax.dot_general(a, a, batched) * jax.lax.dot_general(b, b, batched))


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
    `tile_counts`) take the whole-tree path; both give the same update up to float rounding. The tiled update
    writes the masters and moments in place when `tell` is jitted with them donated and each paired with its own
    output buffer (`esroll.es_train._strategy`).
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
        tiles = tile_counts(cfg, train, tile_entries)
        if tiles:
            weights = _weights(cfg, state.step, fitness_M)
            factors = step_factors(cfg, state.key, state.step, params, jnp.arange(cfg.num_directions))
            new_train, opt_state, grad_norm, update_norm = _tiled_update(
                optimizer, factors, weights.w_E, cfg.rank, tiles, train, state.opt_state, weights.skipped
            )
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

            # A skipped step leaves parameters and moments exactly as they were: the update is not computed at all
            # (its weights are zero, so the gradient's norm is 0). The tiled form decides tile by tile.
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
