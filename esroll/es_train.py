"""The ES training step: one prompt batch shared by every member, one rollout with each member's low-rank
perturbation, fitness per member = its mean reward over the X prompts, then the strategy's `tell` (estimator + optax).

Rows are member-major (rows [m·X, (m+1)·X) belong to member m). Every device regenerates the same factors from
(key, step), so only each row's reward crosses devices and hosts.

Memory layout (`esroll.sharding`): the trainer's parameters are the master weights (`model.master_dtype`), split over
every device with the optimizer state, which exists for the perturbed leaves only; each step casts them to a decoding
copy in `model.dtype` laid out for tensor parallelism, decodes the population in chunks sized to the device
(`esroll.memory`), frees the copy, and `tell` updates the masters in place (their buffers are donated), each device
computing only its shard of the update.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from esroll import advantages, es, memory, parallel, sharding
from esroll.config import ESConfig, ExperimentConfig, OptimConfig, make_optimizer
from esroll.data import Example
from esroll.rollout import Sampling, rollout
from esroll.task import Method, Task


@functools.cache
def _strategy(es_cfg: ESConfig, optim: OptimConfig, mesh) -> es.Strategy:
    """The strategy with jitted ask / tell, one per (ES config, optimizer config, mesh) in a process, so that runs of
    one process (a comparison's warm-up and its timed runs) share their compilation. `ask`'s deltas follow the
    weights' tensor-parallel layout; `tell` donates the master parameters and the state, computes each device's shard
    of the update (`constrain`), and returns them in the layout they came in, so step 2 hits the jit cache of step 1."""

    def constrain(tree):
        return jax.lax.with_sharding_constraint(tree, sharding.master_shardings(mesh, tree))

    strategy = es.make_strategy(es_cfg, make_optimizer(optim), constrain=constrain)

    def ask(state, params):
        deltas = strategy.ask(state, params)
        return jax.lax.with_sharding_constraint(deltas, sharding.delta_shardings(mesh, deltas, params))

    # jit pairs each donated input buffer with the first output of its shape and dtype, in order. `tell` takes
    # (state, params) and returns (params, state): jitted as it is, each new master would be written into an old
    # moment's buffer and each moment into another's. Taking the parameters first pairs every buffer with its own.
    in_place = jax.jit(lambda params, state, fitness_M: strategy.tell(state, params, fitness_M), donate_argnums=(0, 1))

    def tell(state, params, fitness_M):
        return in_place(params, state, fitness_M)

    tell.lower = lambda state, params, fitness_M: in_place.lower(params, state, fitness_M)
    return strategy._replace(ask=jax.jit(ask), tell=tell)


def state_shardings(es_cfg: ESConfig, optim: OptimConfig, mesh, params) -> es.ESState:
    """Where an ES state lives: optimizer moments like the master weights they mirror, step and key replicated."""
    optimizer = make_optimizer(optim)
    train = es.trainable(es_cfg, params)
    abstract = jax.eval_shape(optimizer.init, train)
    same = parallel.replicated(mesh)
    return es.ESState(
        same, same, sharding.state_shardings(mesh, optimizer, abstract, sharding.master_shardings(mesh, train))
    )


def resident_bytes(es_cfg, optim, mesh, params, compute_dtype) -> int:
    """Bytes per device that live through a whole ES step: master weights, optimizer state, the decoding copy."""
    masters = memory.tree_bytes_per_device(params, sharding.master_shardings(mesh, params))
    optimizer = make_optimizer(optim)
    train = es.trainable(es_cfg, params)
    state = jax.eval_shape(optimizer.init, train)
    state_bytes = memory.tree_bytes_per_device(
        state, sharding.state_shardings(mesh, optimizer, state, sharding.master_shardings(mesh, train))
    )
    compute = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, compute_dtype), params)
    return masters + state_bytes + memory.tree_bytes_per_device(compute, sharding.compute_shardings(mesh, compute))


def estimate_rows_per_device(cfg: ExperimentConfig, model_cfg, prompt_len: int, mesh, params, rows: int) -> int:
    """`parallel.rows_per_device`, or when 0 the most rows that fit beside the resident buffers (`esroll.memory`)."""
    if cfg.parallel.rows_per_device:
        return cfg.parallel.rows_per_device
    limit = memory.device_memory_bytes(mesh.devices.flat[0])
    free = None
    if limit is not None:
        dtype = jnp.dtype(cfg.model.dtype)
        free = limit * cfg.parallel.memory_fraction - resident_bytes(cfg.es_config, cfg.optimizer, mesh, params, dtype)
    return memory.auto_rows_per_device(
        model_cfg,
        prompt_len,
        cfg.train.max_new_tokens,
        cfg.model.dtype,
        free_bytes=free,
        rows=rows,
        data_axis=parallel.data_size(mesh),
        model_axis=parallel.model_size(mesh),
    )


def strategy_config(es_cfg: ESConfig) -> ESConfig:
    """`es_cfg` without how rewards become fitness (host-side): runs that differ only there share one compiled
    strategy, and the planner compiles the trainer's program."""
    return dataclasses.replace(es_cfg, samples=1, sample_reduce="mean", prompt_shaping="raw")


def member_fitness(
    es_settings, reward_B: np.ndarray, answer_B: np.ndarray | None, M: int, X: int
) -> tuple[np.ndarray, dict]:
    """Each member's fitness from its rows' rewards (rows as `make_es_method` lays them out: member, prompt, sample),
    and metrics. With `answer_B` (label-free), a row's reward is whether its answer is the majority answer of all
    the rows (every member, every sample) answering its prompt, and the gold reward is kept as a diagnostic. A member
    with a non-finite reward gets a non-finite fitness (the strategy's non-finite policy drops it); `reward_mean` is
    the mean reward before any shaping. The majority vote, and a `prompt_shaping` that divides by or ranks against
    the members' rewards, make each member's fitness depend on the other members' perturbations: the estimators'
    unbiasedness does not hold then (docs/theory.md, and `ESSettings`)."""
    K = es_settings.samples
    gold_MxXxK = np.asarray(reward_B, np.float64).reshape(M, X, K)
    broken_M = ~np.isfinite(gold_MxXxK).all(axis=(1, 2))
    rewards_MxXxK, extra = gold_MxXxK, {}
    if answer_B is not None:
        votes_XxMK = np.asarray(answer_B).reshape(M, X, K).transpose(1, 0, 2).reshape(X, M * K)
        rewards_MxXxK = advantages.majority_rewards(votes_XxMK).reshape(X, M, K).transpose(1, 0, 2)
        extra = {"gold_reward_mean": gold_MxXxK.mean(), "pseudo_label_agreement": np.mean(rewards_MxXxK == gold_MxXxK)}
    extra["prompt_reward"] = rewards_MxXxK.mean(axis=(0, 2))  # [X]: read by the training loop's curriculum
    reduce = np.max if es_settings.sample_reduce == "max" else np.mean
    per_prompt_XxM = reduce(rewards_MxXxK, axis=2).T
    shaped_XxM = np.asarray(advantages.get(es_settings.prompt_shaping)(per_prompt_XxM), np.float64)
    extra["reward_mean"] = np.nanmean(np.where(np.isfinite(rewards_MxXxK), rewards_MxXxK, np.nan))
    fitness_M = np.where(broken_M, np.nan, shaped_XxM.mean(axis=0))
    return fitness_M.astype(np.float32), extra


def make_es_method(cfg: ExperimentConfig, task: Task, mesh, rows_per_device: int | None = None) -> Method:
    """The ES method; `rows_per_device` (rows each device decodes at once) as `esroll.plan` chose it, else
    `parallel.rows_per_device` or the estimate from the shapes (`estimate_rows_per_device`)."""
    es_cfg = cfg.es_config
    strategy = _strategy(strategy_config(es_cfg), cfg.optimizer, mesh)
    to_compute = sharding.caster(mesh, cfg.model.dtype)
    M, X, K = cfg.es.population, cfg.train.prompts_per_step, cfg.es.samples
    # Rows member-major, then prompt, then sample: row (m·X + x)·K + k is member m's k-th answer to prompt x.
    example_B = np.tile(np.repeat(np.arange(X), K), M)
    member_B = np.repeat(np.arange(M, dtype=np.int32), X * K)
    label_free = cfg.data.reward == "majority"
    sample_key = jax.random.key(cfg.seed + 1)
    sampling = None  # set by init, which sees the parameters' shapes
    chosen_rows = rows_per_device

    def init(params, key):
        nonlocal sampling
        chunk = chosen_rows or estimate_rows_per_device(cfg, task.cfg, task.prompt_multiple, mesh, params, M * X * K)
        sampling = Sampling.of(cfg.train.max_new_tokens, cfg.train.temperature, cfg.parallel, chunk)
        shardings = state_shardings(es_cfg, cfg.optimizer, mesh, params)
        return jax.jit(strategy.init, out_shardings=shardings)(params, parallel.put_replicated(mesh, key))

    def step(params, state: es.ESState, examples: list[Example], step_index: int):
        compute = to_compute(params)
        out = rollout(
            task,
            mesh,
            compute,
            examples,
            example_B,
            jax.random.fold_in(sample_key, step_index),
            sampling,
            deltas=strategy.ask(state, compute),
            member_B=member_B,
            answers=label_free,
        )
        del compute  # the decoding copy is not needed by `tell`: free it first
        fitness_M, extra = member_fitness(cfg.es, out.reward_B, out.answer_B, M, X)
        params, state, metrics = strategy.tell(state, params, parallel.put_replicated(mesh, fitness_M))
        return params, state, {**metrics, **extra}, int(out.length_B.sum())

    return Method(init, step)
