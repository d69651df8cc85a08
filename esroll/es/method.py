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
import time

import jax
import numpy as np

from esroll import baselines, es, ledger, memory, parallel, sharding
from esroll.config import ConfigError, ESConfig, ExperimentConfig, OptimConfig, check_fields, make_optimizer
from esroll.agents import visitation
from esroll.data import Example
from esroll.es import estimators, shaping
from esroll.es.diagnostics import least_split_directions, rank_diagnostics, step_diagnostics
from esroll.models import abstract_params
from esroll.rollout import Sampling, prompt_means, rollout, training_rewards
from esroll.steps import with_steps
from esroll.task import Method, StepOutput, Task
from esroll.teacher import experiment_teacher, teacher_logprobs


@functools.cache
def compiled_strategy(es_cfg: ESConfig, optim: OptimConfig, mesh) -> es.Strategy:
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

    # jit pairs each donated input buffer with the first output of its shape and dtype, in order: `tell` takes
    # (params, state) and returns (params, state), so every new master and moment is written into its own old buffer.
    return strategy._replace(ask=jax.jit(ask), tell=jax.jit(strategy.tell, donate_argnums=(0, 1)))


@functools.cache
def _diagnostics(es_cfg: ESConfig, model_cfg):
    """The jitted diagnostics of an ES step (`esroll.es.diagnostics`): the split-half figures, on the mesh, and the
    update's effective ranks, on one device. One pair per (ES config, model) in a process, as `compiled_strategy`, so
    that the runs of one process compile them once."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract_params(model_cfg))
    return jax.jit(functools.partial(step_diagnostics, es_cfg)), jax.jit(
        functools.partial(rank_diagnostics, es_cfg, shapes)
    )


def state_shardings(es_cfg: ESConfig, optim: OptimConfig, mesh, params) -> es.ESState:
    """Where an ES state lives: optimizer moments like the master weights they mirror, step and key replicated."""
    same = parallel.replicated(mesh)
    return es.ESState(same, same, sharding.state_shardings(mesh, make_optimizer(optim), es.trainable(es_cfg, params)))


def check_config(cfg: ExperimentConfig) -> None:
    """Raise the one-line ConfigError of the first setting an ES run cannot work with: GRPO's variants, several samples
    of greedy decoding, an estimator's population (eggroll: even, `estimators.check_population`), the split-half
    diagnostics' directions."""
    checks = [
        ("method", not cfg.grpo.variants, "grpo for grpo.variants (they change GRPO's step and loss; ES has neither)"),
        (
            "es.samples",
            cfg.es.samples == 1 or cfg.train.temperature > 0,
            "1 when train.temperature is 0 (greedy decoding gives K identical answers)",
        ),
        (
            "teacher.path",
            not cfg.es.teacher_weight or bool(cfg.teacher.path),
            "a teacher model's folder (es.teacher_weight > 0 reads a teacher)",
        ),
        (
            "es.svm_weight",
            not cfg.es.svm_weight or bool(cfg.env.name),
            "0 without env.name (it densifies the returns of episodes)",
        ),
        (
            "train.diagnostics_pg",
            not cfg.train.diagnostics_pg or cfg.train.diagnostics_every > 0,
            "False unless an ES method logs diagnostics (train.diagnostics_every > 0)",
        ),
    ]
    check_fields(cfg, checks, "config")
    estimators.check_population(cfg.method, cfg.es.population, "es.population")
    directions = estimators.num_directions(cfg.method, cfg.es.population)
    least = least_split_directions(cfg.method)
    if cfg.train.diagnostics_every and (directions % 2 or directions < least):
        raise ConfigError(
            "es.population",
            cfg.es.population,
            f"a population of an even number of directions, at least {least}, for the split-half "
            f"diagnostics (train.diagnostics_every > 0); {cfg.method} has {directions}",
        )


def unread(cfg: ExperimentConfig) -> dict[str, str]:
    """{key or section ending in ".": why} for what an ES run of `cfg` does not read
    (`esroll.experiment.unread_keys`)."""
    if cfg.es.step_weight:
        rules = {"steps.branches": f"method {cfg.method!r} samples no branches (es.step_weight scores the steps only)"}
    else:
        rules = {"steps.": f"method {cfg.method!r} reads no reasoning steps (es.step_weight is 0)"}
    if not cfg.es.teacher_weight:
        rules["teacher."] = f"method {cfg.method!r} reads no teacher (es.teacher_weight is 0)"
        rules["es.teacher_fitness"] = "es.teacher_weight is 0: no teacher score to compute"
    if not cfg.train.diagnostics_pg:
        rules["grpo."] = f"method {cfg.method!r} reads GRPO settings only for train.diagnostics_pg, which is off"
    for name in shaping.SHAPINGS:
        if name not in (cfg.es.shaping, cfg.es.prompt_shaping):
            rules[f"es.shaping_options.{name}."] = (
                f"only the fitness shaping {name!r} reads it, and neither es.shaping nor es.prompt_shaping is it"
            )
    if cfg.es.sigma_schedule == "constant":
        for key in ("es.sigma_final", "es.sigma_horizon"):
            rules[key] = "a constant es.sigma_schedule does not read it"
    if cfg.es.samples == 1:
        rules["es.sample_reduce"] = "es.samples is 1: one answer per member and prompt, nothing to reduce"
    return rules


def rows_per_step(cfg: ExperimentConfig) -> int:
    """Rows one ES step decodes: every member answers every prompt `es.samples` times."""
    return cfg.es.population * cfg.train.prompts_per_step * cfg.es.samples


def member_rows(cfg: ExperimentConfig) -> np.ndarray:
    """[rows_per_step] int32: each row's member. Rows are member-major, then prompt, then sample: row (m·X + x)·A + a
    is member m's a-th answer to prompt x."""
    return np.repeat(np.arange(cfg.es.population, dtype=np.int32), cfg.train.prompts_per_step * cfg.es.samples)


def updates_per_step(cfg: ExperimentConfig) -> int:
    """Optimizer updates one ES step takes: one `tell`."""
    return 1


def decode_rows(cfg: ExperimentConfig, model_cfg, prompt_len: int, mesh) -> int:
    """The rows each device decodes at once in an ES step (`esroll.memory.rows_per_device`): beside the masters,
    the optimizer state and the decoding copy, as the config lays them out on `mesh`."""
    shapes = abstract_params(model_cfg)
    params = sharding.master_copy(mesh, shapes, cfg.model.master_dtype)
    optimizer = make_optimizer(cfg.optimizer)
    train = es.trainable(cfg.es_config, params)
    state = sharding.with_shardings(
        jax.eval_shape(optimizer.init, train), sharding.state_shardings(mesh, optimizer, train)
    )
    resident = memory.resident_bytes(params, state, sharding.decoding_copy(mesh, params, cfg.model.dtype))
    return memory.rows_per_device(cfg, model_cfg, prompt_len, mesh, resident, rows_per_step(cfg))


def strategy_config(es_cfg: ESConfig) -> ESConfig:
    """`es_cfg` without how rewards become fitness (host-side): runs that differ only there share one compiled
    strategy, and the planner compiles the trainer's program."""
    return dataclasses.replace(
        es_cfg, samples=1, sample_reduce="mean", prompt_shaping="raw", step_weight=0.0, teacher_weight=0.0,
        teacher_fitness="log_ratio", svm_weight=0.0,
    )  # fmt: skip


def mean_step_scores(step_scores_BxJ: np.ndarray) -> np.ndarray:
    """[B] each row's mean step score over its steps (NaN past them); 0 for a row with no steps."""
    scores = np.asarray(step_scores_BxJ, np.float64)
    counted = np.isfinite(scores)
    n_B = counted.sum(axis=1)
    return np.where(n_B > 0, np.where(counted, scores, 0.0).sum(axis=1) / np.maximum(n_B, 1), 0.0)


def dense_rewards(reward_B: np.ndarray, score_B: np.ndarray, weight: float) -> np.ndarray:
    """[B] a reward mixed with a dense per-row score: (1 − w)·reward + w·score (`es.step_weight` with the row's mean
    step score, `mean_step_scores`; `es.teacher_weight` with its teacher score, `teacher_scores`). A non-finite
    reward stays non-finite (the member is dropped)."""
    return ((1.0 - weight) * np.asarray(reward_B, np.float64) + weight * score_B).astype(np.float32)


def teacher_scores(teacher_BxN: np.ndarray, logprobs_BxN: np.ndarray, length_B: np.ndarray, kind: str) -> np.ndarray:
    """[B] each row's teacher score (`es.teacher_fitness`): the mean over its `length_B` completion tokens of
    log π_T − log π (log_ratio) or of log π_T (log_likelihood); 0 for a row with no tokens."""
    N = np.asarray(teacher_BxN).shape[1]
    mask = np.arange(N)[None, :] < np.asarray(length_B)[:, None]
    per_token = np.asarray(teacher_BxN, np.float64)
    if kind == "log_ratio":
        per_token = per_token - np.asarray(logprobs_BxN, np.float64)
    return np.where(mask, per_token, 0.0).sum(axis=1) / np.maximum(mask.sum(axis=1), 1)


def member_fitness(es_settings, reward_B: np.ndarray, M: int, X: int, gold_B: np.ndarray | None = None) -> np.ndarray:
    """Each member's fitness from its rows' training rewards (rows as `make_es_method` lays them out: member, prompt,
    sample; label-free rewards already voted, `esroll.rollout.training_rewards`): its A samples per prompt reduced by
    `sample_reduce`, shaped across members per prompt by `prompt_shaping`, averaged over prompts. A member with a
    non-finite reward (in `gold_B`, the rows' gold rewards, when given: the vote hides them) gets a non-finite
    fitness, which the strategy's non-finite policy drops. The majority vote, and a `prompt_shaping` that divides by
    or ranks against the members' rewards, make each member's fitness depend on the other members' perturbations:
    the estimators' unbiasedness does not hold then (docs/theory.md, and `ESSettings`)."""
    A = es_settings.samples
    rewards_MxXxA = np.asarray(reward_B, np.float64).reshape(M, X, A)
    checked = rewards_MxXxA if gold_B is None else np.asarray(gold_B, np.float64).reshape(M, X, A)
    broken_M = ~np.isfinite(checked).all(axis=(1, 2))
    reduce = np.max if es_settings.sample_reduce == "max" else np.mean
    per_prompt_XxM = reduce(rewards_MxXxA, axis=2).T
    shaped_XxM = np.asarray(
        shaping.get(es_settings.prompt_shaping, es_settings.shaping_options)(per_prompt_XxM), np.float64
    )
    return np.where(broken_M, np.nan, shaped_XxM.mean(axis=0)).astype(np.float32)


def _finite_mean(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return finite.mean(dtype=np.float64) if finite.size else np.nan


def make_es_method(
    cfg: ExperimentConfig, task: Task, mesh, rows_per_device: int | None = None, policy_gradient=None
) -> Method:
    """The ES method; `rows_per_device` (rows each device decodes at once) as `esroll.plan` chose it, else
    `parallel.rows_per_device` or the estimate from the shapes (`decode_rows`). On the steps of
    `train.diagnostics_every`, the step also logs `esroll.es.diagnostics.step_diagnostics` of its estimate, computed
    from the parameters and fitness `tell` reads, before it runs (nothing of it reaches the update); with
    `policy_gradient` (`esroll.grpo.make_policy_gradient`, for `train.diagnostics_pg`) their cosine with it too."""
    es_cfg = cfg.es_config
    strategy = compiled_strategy(strategy_config(es_cfg), cfg.optimizer, mesh)
    to_compute = sharding.caster(mesh, cfg.model.dtype)
    M, X, A = cfg.es.population, cfg.train.prompts_per_step, cfg.es.samples
    example_B = np.tile(np.repeat(np.arange(X), A), M)  # prompt x, sample a of member m: as `member_rows`
    member_B = member_rows(cfg)
    label_free = cfg.data.label_free
    sample_key = jax.random.key(cfg.seed + 1)
    chunk = rows_per_device or decode_rows(cfg, task.cfg, task.prompt_multiple, mesh)
    sampling = Sampling.of(cfg.train.max_new_tokens, cfg.train.temperature, cfg.parallel, chunk)
    step_weight, teacher_weight = cfg.es.step_weight, cfg.es.teacher_weight
    teacher = None
    if teacher_weight:  # one cache-free teacher forward over each step's rows (`esroll.teacher`)
        teacher = experiment_teacher(cfg, task.tokenizer, mesh)
    every = cfg.train.diagnostics_every
    diagnose, ranks = _diagnostics(es_cfg, task.cfg)
    first = jax.local_devices()[0]  # where `ranks` runs
    update_flops = ledger.es_update_flops(
        task.cfg, estimators.num_directions(cfg.method, es_cfg.population), es_cfg.rank
    )

    def init(params, key):
        shardings = state_shardings(es_cfg, cfg.optimizer, mesh, params)
        return jax.jit(strategy.init, out_shardings=shardings)(params, parallel.put_replicated(mesh, key))

    def step(params, state: es.ESState, examples: list[Example], step_index: int) -> StepOutput:
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
            completions=bool(step_weight or teacher_weight),
            answers=label_free,
        )
        if step_weight:
            out = with_steps(out, task, examples, cfg.steps, scored=True)
        del compute  # the decoding copy is not needed by `tell`: free it first
        start = time.perf_counter()
        reward_B, extra = training_rewards(out, label_free)
        outcome_B = reward_B
        if step_weight:
            step_mean_B = mean_step_scores(out.step_scores_BxJ)
            extra["outcome_mean"] = _finite_mean(outcome_B)  # before mixing; reward_mean below is the mixed reward
            extra["step_score_mean"] = float(step_mean_B.mean())
            reward_B = dense_rewards(outcome_B, step_mean_B, step_weight)
        if cfg.es.svm_weight:  # Success Visitation Matching over the population's episodes, one fit per seed
            bonus_B = visitation.discriminator_logits(out.turns, np.isfinite(outcome_B), level_B=example_B).sum(1)
            extra.setdefault("outcome_mean", _finite_mean(outcome_B))
            extra["svm_bonus_mean"] = float(bonus_B.mean())
            reward_B = (reward_B + cfg.es.svm_weight * bonus_B).astype(np.float32)
        teacher_flops = 0.0
        if teacher is not None:
            teacher_BxN = teacher_logprobs(*teacher, out)
            ratio_B = teacher_scores(teacher_BxN, out.logprobs_BxN, out.length_B, "log_ratio")
            score_B = ratio_B
            if cfg.es.teacher_fitness != "log_ratio":
                score_B = teacher_scores(teacher_BxN, out.logprobs_BxN, out.length_B, cfg.es.teacher_fitness)
            extra.update(teacher_score_mean=float(score_B.mean()), teacher_log_ratio=float(ratio_B.mean()))
            extra.setdefault("outcome_mean", _finite_mean(outcome_B))
            reward_B = dense_rewards(reward_B, score_B, teacher_weight)
            context = out.prompt_BxP.shape[1] + out.tokens_BxN.shape[1]
            teacher_flops = ledger.forward_flops(
                teacher[0], len(score_B), context, head_positions=out.tokens_BxN.shape[1]
            )
        fitness_M = member_fitness(cfg.es, reward_B, M, X, gold_B=out.reward_B if label_free else None)
        fitness = parallel.put_replicated(mesh, fitness_M)
        extra["s_scoring"] = out.seconds["score"] + time.perf_counter() - start
        if every and (step_index + 1) % every == 0:  # before `tell`, which donates the parameters
            start = time.perf_counter()
            pg = None if policy_gradient is None else policy_gradient(params, examples, step_index)
            extra.update(jax.device_get(diagnose(state.key, state.step, params, fitness, pg)))
            on_one = jax.device_put(jax.device_get((state.key, state.step, fitness_M)), first)
            extra.update(jax.device_get(ranks(*on_one)))
            extra["s_diagnostics"] = time.perf_counter() - start
        start = time.perf_counter()
        params, state, metrics = strategy.tell(params, state, fitness)
        jax.block_until_ready(params)
        extra["s_update"] = time.perf_counter() - start
        extra["reward_mean"] = _finite_mean(reward_B)  # before shaping
        extra.update(out.metrics or {})  # what the rollout logs of itself (episodes: solved, turns, valid actions)
        generate_flops = ledger.rollout_flops(task.cfg, out.prompt_BxP.shape[1], out.length_B, perturb_rank=es_cfg.rank)
        extra.update(
            s_rollout=out.seconds["generate"], flops_generate=float(generate_flops), flops_update=float(update_flops)
        )
        if teacher is not None:
            extra["flops_teacher"] = float(teacher_flops)
        # The prompts whose rows' outcomes are all equal, and those of them the fitness still tells apart.
        by_prompt = [
            np.asarray(v, np.float64).reshape(M, X, A).swapaxes(0, 1).reshape(X, M * A) for v in (outcome_B, reward_B)
        ]
        extra.update(baselines.equal_groups(by_prompt[0], (by_prompt[1] - by_prompt[1][:, :1]).ravel()))
        prompt_reward = prompt_means(example_B, outcome_B, X)  # each prompt's success, as the curriculum reads it
        flops = generate_flops + update_flops + teacher_flops
        return StepOutput(params, state, {**metrics, **extra}, int(out.length_B.sum()), prompt_reward, flops)

    return Method(init, step, headline="fitness_mean")
