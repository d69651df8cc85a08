"""GRPO, the gradient-based baseline: same model, prompts, sampler and rewards as ES; only the estimator differs.

One step: G completions per prompt from `generate` (which also returns π_old per token) → rewards → group
advantages (`esroll.grpo.advantages`) → `inner_iterations` passes over `minibatches` minibatches, one optimizer step
each (`esroll.grpo.update`), on the clipped surrogate plus β·KL to the initial policy (`esroll.grpo.loss`).

π_old. The first minibatch of the first pass is scored by the parameters that sampled it, so its ratio is computed as
exp(logp − stop_gradient(logp)): exactly 1, with the policy gradient as its gradient. Every later update uses the
log-probabilities `generate` returned (KV-cache path; they may differ from a full forward by ~1e-6, far inside any
clip range), so no extra forward pass is spent on π_old.

Sampling (`esroll.rollout`) decodes from the same cast of the masters that ES decodes from, tensor-parallel over
"model", rows split over "data".

Shapes (the legend in `esroll/__init__.py`): X prompts per step, M completions per prompt (`group_size`), B = X·M rows,
P padded prompt length, N = max_new_tokens, U microbatches of b rows per minibatch.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from esroll import baselines, ledger, parallel, sharding
from esroll.config import ConfigError, ExperimentConfig, check_fields, make_optimizer
from esroll.data import Example
from esroll.grpo import advantages, ppo
from esroll.grpo import variants as grpo_variants
from esroll.grpo.checks import check_grpo_names
from esroll.grpo.branching import token_branches
from esroll.grpo.diagnostics import split_half_diagnostics
from esroll.grpo.loss import token_weights
from esroll.grpo.update import (
    GRPOState,
    Rollouts,
    init_state,
    join_host,
    loss_reads_reference,
    make_gradient,
    make_update,
    pad_rows,
    split_host,
    state_shardings,
    update_config,
)
from esroll.grpo.advantages import STEP_NEEDS, TEACHER_NEEDS, estimator_group
from esroll.grpo.variants import Sampled
from esroll.rollout import Sampling, given_rollout, prompt_means, rollout, training_rewards
from esroll.scoring import rollout_logprobs
from esroll.steps import branch, with_steps
from esroll.steps.branch import branch_rewards
from esroll.task import Method, StepOutput, Task
from esroll.teacher import experiment_teacher, teacher_head, teacher_signals


# fmt: off
def make_batches(
    out, mask_BxN, advantage_BxN, factor_BxN, aggregation: str, minibatches: int, microbatches: int, mesh: Mesh,
    teacher_BxNxD: np.ndarray | None = None,
) -> list[Rollouts]:
    # fmt: on
    """A step's B sampled rows as `minibatches` `Rollouts` on `mesh`, each split into `microbatches` of b rows (b
    padded to a multiple of the data axis with masked rows). Minibatch m is rows [m·B/n_mini, (m+1)·B/n_mini), whole
    prompt groups when n_mini divides X; its token weights (`token_weights`, times `factor_BxN`) are computed over
    its real rows, before the padding. `mask_BxN` is the tokens that get loss (`_loss_mask`); the forward attends to
    every completion token (an episode's environment answers too), which the rows carry apart only where they differ
    (`out.loss_mask_BxN`, episodes). `teacher_BxNxD`, a teacher's final hidden states, travels with the rows when
    the loss reads it (GKD)."""
    B, N = mask_BxN.shape
    b = B // (minibatches * microbatches)  # rows per microbatch
    b_padded = parallel.padded_rows(b, mesh)
    micro_rows = NamedSharding(mesh, PartitionSpec(None, parallel.AXIS))
    attend_BxN = np.arange(N)[None, :] < out.length_B[:, None]
    batches = []
    for m in range(minibatches):
        rows = slice(m * microbatches * b, (m + 1) * microbatches * b)
        weight = (
            np.asarray(token_weights(mask_BxN[rows], aggregation)) * np.broadcast_to(factor_BxN, mask_BxN.shape)[rows]
        )
        fields = dict(
            prompt=out.prompt_BxP[rows],
            prompt_mask=out.prompt_mask_BxP[rows],
            completion=out.tokens_BxN[rows],
            completion_mask=attend_BxN[rows],
            logp_old=out.logprobs_BxN[rows],
            advantage=advantage_BxN[rows],
            weight=weight.astype(np.float32),
            loss_mask=None if out.loss_mask_BxN is None else mask_BxN[rows],
            teacher_hidden=None if teacher_BxNxD is None else np.asarray(teacher_BxNxD[rows], np.float32),
        )
        split = {
            k: parallel.put(micro_rows, pad_rows(x.reshape(microbatches, b, *x.shape[1:]), b_padded))
            for k, x in fields.items()
            if x is not None
        }
        batches.append(Rollouts(**split))
    return batches


def token_advantages(name: str, advantage: np.ndarray, mask_BxN: np.ndarray, group_size: int) -> np.ndarray:
    """[B, N] float32: each token's advantage from an estimator's `advantage`, one per completion [X, M] (every token
    of a completion gets it) or one per token [X, M, N] (taken as it is; 0 past a completion's end). Any other shape,
    or a non-finite advantage on a completion token, is refused naming the estimator `name`."""
    B, N = mask_BxN.shape
    X, M = B // group_size, group_size
    advantage = np.asarray(advantage)
    if advantage.shape == (X, M):
        advantage_BxN = np.broadcast_to(advantage.reshape(B, 1), (B, N))
    elif advantage.shape == (X, M, N):
        advantage_BxN = advantage.reshape(B, N)
    else:
        raise ValueError(
            f"advantage estimator {name!r} returned advantages of shape {advantage.shape}; expected one per "
            f"completion {(X, M)} or one per token {(X, M, N)}"
        )
    if not np.isfinite(advantage_BxN[mask_BxN]).all():
        raise ValueError(f"advantage estimator {name!r} returned a non-finite advantage on a completion token")
    return np.where(mask_BxN, advantage_BxN, 0.0).astype(np.float32)


def _mean_abs(advantage: np.ndarray, mask_BxN: np.ndarray) -> float:
    """The mean over completions of |A|: a per-completion advantage's, or a per-token one's token mean."""
    if advantage.ndim == 2:
        return float(np.abs(advantage).mean())
    tokens_B = mask_BxN.sum(1)
    per_row = np.abs(advantage.reshape(mask_BxN.shape)).sum(1, where=mask_BxN) / np.maximum(tokens_B, 1)
    return float(per_row.mean())


def _loss_mask(out) -> np.ndarray:
    """[B, N] bool: the sampled tokens that get loss: every completion token up to and including its end, or, in a
    multi-turn episode, the model's actions only (`Rollout.loss_mask_BxN`)."""
    mask_BxN = np.arange(out.tokens_BxN.shape[1])[None, :] < out.length_B[:, None]
    return mask_BxN if out.loss_mask_BxN is None else mask_BxN & out.loss_mask_BxN


def check_config(cfg: ExperimentConfig) -> None:
    """Raise the one-line ConfigError of the first setting a GRPO run cannot work with: an estimator of turns
    without episodes or of reasoning steps with them, a vote without a group,
    minibatches and microbatches that do not divide the step's rows, diagnostics it does not have or cannot split, an
    estimator that reads a teacher without `teacher.path`."""
    needs = advantages.ESTIMATORS[cfg.grpo.advantage].needs if cfg.grpo.advantage in advantages.ESTIMATORS else ()
    if not cfg.env.name and "turns" in needs:
        expected = f"an estimator of single-turn completions without env.name ({cfg.grpo.advantage} reads turns)"
        raise ConfigError("grpo.advantage", cfg.grpo.advantage, expected)
    if cfg.env.name and (cfg.env.reflect_tokens > 0) != ("reflection" in needs):
        expected = "> 0 (the reflection's room)" if "reflection" in needs else "0 (grpo.advantage reads no reflection)"
        raise ConfigError("env.reflect_tokens", cfg.env.reflect_tokens, expected)
    if cfg.env.name and set(needs) & {*STEP_NEEDS, "token_branches"}:
        expected = "an estimator that reads no reasoning steps or branches with env.name set (turn credit is its own)"
        raise ConfigError("grpo.advantage", cfg.grpo.advantage, expected)
    if cfg.data.label_free and set(needs) & {"branches", "token_branches"}:
        expected = "an estimator without branched rollouts with data.reward='majority' (a branch is scored by gold)"
        raise ConfigError("grpo.advantage", cfg.grpo.advantage, expected)
    rows = rows_per_step(cfg)
    checks = [
        (
            "grpo.group_size",
            not cfg.data.label_free or cfg.grpo.group_size >= 2,
            ">= 2 with data.reward='majority' (a vote needs a group)",
        ),
        (
            "train.diagnostics_pg",
            not cfg.train.diagnostics_pg,
            "False unless an ES method logs diagnostics (train.diagnostics_every > 0); GRPO's estimate is the "
            "policy gradient",
        ),
        (
            "grpo.minibatches",
            rows % cfg.grpo.minibatches == 0,
            f"a divisor of train.prompts_per_step × grpo.group_size = {rows}",
        ),
        (
            "grpo.microbatches",
            rows % (cfg.grpo.minibatches * cfg.grpo.microbatches) == 0,
            f"a divisor of the minibatch size, {rows} / grpo.minibatches",
        ),
        (
            "train.prompts_per_step",
            not cfg.train.diagnostics_every or cfg.train.prompts_per_step >= 2,
            ">= 2 for GRPO's split-half diagnostics (train.diagnostics_every > 0)",
        ),
    ]
    check_fields(cfg, checks, "config")
    if "teacher_distributions" in needs and cfg.env.name and advantages.options_of(cfg.grpo).student_fraction < 1:
        expected = "1 with env.name set (episodes have no data completions to train on)"
        key = f"grpo.adv.{cfg.grpo.advantage}.student_fraction"
        raise ConfigError(key, advantages.options_of(cfg.grpo).student_fraction, expected)
    if TEACHER_NEEDS & set(needs) and not cfg.teacher.path:
        expected = f"a teacher model's folder (grpo.advantage {cfg.grpo.advantage!r} reads a teacher)"
        raise ConfigError("teacher.path", cfg.teacher.path, expected)
    if advantages.ESTIMATORS[cfg.grpo.advantage].label_free_only and not cfg.data.label_free:
        expected = (
            f"an estimator that reads gold rewards, or data.reward='majority' ({cfg.grpo.advantage} is label-free only)"
        )
        raise ConfigError("grpo.advantage", cfg.grpo.advantage, expected)


def unread(cfg: ExperimentConfig) -> dict[str, str]:
    """{key or section ending in ".": why} for what a GRPO run of `cfg` does not read
    (`esroll.experiment.unread_keys`)."""
    rules = {"es.": "method 'grpo' reads no ES setting"}
    needs = advantages.ESTIMATORS[cfg.grpo.advantage].needs if cfg.grpo.advantage in advantages.ESTIMATORS else ()
    for key, need in (("steps.", STEP_NEEDS), ("steps.verifier", ("step_scores",)), ("steps.branches", ("branches",))):
        if not set(need) & set(needs):
            rules[key] = f"grpo.advantage {cfg.grpo.advantage!r} does not read {' or '.join(need)}"
    if not TEACHER_NEEDS & set(needs):
        rules["teacher."] = f"grpo.advantage {cfg.grpo.advantage!r} does not read a teacher"
    for name in advantages.ESTIMATORS:
        if name != cfg.grpo.advantage:
            rules[f"grpo.adv.{name}."] = (
                f"only grpo.advantage {name!r} reads it, and this run's is {cfg.grpo.advantage!r}"
            )
    for name in grpo_variants.VARIANTS:
        if name not in cfg.grpo.variants:
            rules[f"grpo.variant_options.{name}."] = (
                f"only the GRPO variant {name!r} reads it, and grpo.variants lacks it"
            )
    return rules


def rows_per_step(cfg: ExperimentConfig) -> int:
    """Completions one GRPO step samples: `group_size` per prompt."""
    return cfg.train.prompts_per_step * cfg.grpo.group_size


def updates_per_step(cfg: ExperimentConfig) -> int:
    """Optimizer updates one GRPO step takes: μ passes over its minibatches."""
    return cfg.grpo.inner_iterations * cfg.grpo.minibatches


def make_grpo_method(cfg: ExperimentConfig, task: Task, mesh: Mesh, rows_per_device: int | None = None) -> Method:
    """The GRPO method; sampling decodes `rows_per_device` rows per device at once (as `esroll.plan` chose them),
    else `parallel.rows_per_device` (0: all of a device's share). `step` expects the masters as `esroll.task.load_task`
    places them on `mesh` and the state as `init` (or a restore into its layout) leaves it; the update returns both in
    that layout, so it compiles once. A name in `cfg.grpo` that no module implements is refused first
    (`check_grpo_names`, naming the key as a config file spells it)."""
    g = cfg.grpo
    try:
        check_grpo_names(g)
    except ConfigError as e:
        raise e.under("grpo.") from None
    X, M, N = cfg.train.prompts_per_step, g.group_size, cfg.train.max_new_tokens
    label_free = cfg.data.label_free  # rewards from the group's majority answer, not the gold one
    needs = advantages.ESTIMATORS.lookup(g.advantage).needs  # what the estimator reads beyond the rewards
    steps = cfg.steps if set(needs) & set(STEP_NEEDS) else None  # cut completions into steps (and score them)
    branch_key = jax.random.key(cfg.seed + 3)  # branched continuations: apart from every other draw of a run
    to_compute = sharding.caster(mesh, cfg.model.dtype)  # the decoding copy (model.dtype) of the masters
    sample_key = jax.random.key(cfg.seed + 1)
    sampling = Sampling.of(N, g.temperature, cfg.parallel, rows_per_device or cfg.parallel.rows_per_device)
    compiled = update_config(g)
    teacher = None
    if TEACHER_NEEDS & set(needs):  # one cache-free teacher forward over each step's rows (`esroll.teacher`)
        teacher = experiment_teacher(cfg, task.tokenizer, mesh)
    # GKD: the teacher's whole distributions in the loss, from its hidden states and its head (an update argument)
    gkd = "teacher_distributions" in needs
    teacher_cfg, head = (teacher[0], parallel.replicate(mesh, teacher_head(*teacher))) if gkd else (None, None)
    step_update = make_update(task.cfg, compiled, cfg.optimizer, mesh, cfg.model.dtype, teacher_cfg)
    optimizer = make_optimizer(cfg.optimizer)
    variants = grpo_variants.active(g)
    example_B = np.repeat(np.arange(X), M)  # rows prompt-major: row x·M + j answers prompt x
    every = cfg.train.diagnostics_every
    # FLOPs of the update (`esroll.ledger`): μ passes of forward + backward over every row, and the reference's
    # forward when one is kept.
    passes = g.inner_iterations
    update_flops = passes * ledger.train_flops(task.cfg, X * M, task.prompt_multiple, N, remat=g.remat)
    if "token_branches" in needs:  # the policy's and the reference's forwards that score the sampled tokens
        update_flops += 2 * ledger.forward_flops(task.cfg, X * M, task.prompt_multiple + N, head_positions=N)
    if loss_reads_reference(g):
        update_flops += passes * ledger.forward_flops(task.cfg, X * M, task.prompt_multiple + N, head_positions=N)
    student_fraction = advantages.options_of(g).student_fraction if gkd else 1.0  # GKD's steps on the student's samples
    if teacher is not None:  # its forward; with GKD its head at each generated position of each pass's loss, twice
        update_flops += ledger.forward_flops(teacher[0], X * M, task.prompt_multiple + N, head_positions=N)
        update_flops += gkd * passes * 4.0 * X * M * N * teacher[0].hidden_size * teacher[0].vocab_size  # and again
    critic_update = ppo.make_critic_update(task.cfg, g, mesh) if ppo.keeps_critic(g) else None
    actions = ppo.action_tokens(g, task) if critic_update is not None else None  # DAE's: π over the env's actions
    if critic_update is not None:  # the critic's forward for the rollout's values, then a forward + backward per pass
        trunk = ledger.forward_flops(task.cfg, X * M, task.prompt_multiple + N, head_positions=0)
        update_flops += trunk * (1 + 3 * passes + (actions is not None))  # DAE: and the policy's, for π

    def init(params, key):
        del key  # sampling keys are fold_in(seed, step); nothing else is random

        make = functools.partial(init_state, g, optimizer)
        state = jax.jit(make, out_shardings=state_shardings(g, cfg.optimizer, mesh, params))(params)
        critic = ppo.load_critic(g, task.cfg, mesh, params["final_norm"].dtype) if ppo.keeps_critic(g) else None
        # Adam's state does not depend on the values it starts from: the trunk's is the checkpoint's as well.
        return state if critic is None else state._replace(critic=critic)

    def step(params, state: GRPOState, examples: list[Example], step_index: int) -> StepOutput:
        # ---- sample M completions per prompt and score them
        key = jax.random.fold_in(sample_key, step_index)
        compute = to_compute(params)
        on_student = student_fraction >= 1 or np.random.default_rng([cfg.seed, step_index]).random() < student_fraction
        if on_student:
            out = rollout(task, mesh, compute, examples, example_B, key, sampling, completions=True, answers=label_free)
        else:  # GKD's share of steps on the data's completions, scored by the student as if it had sampled them
            out = given_rollout(task, examples, example_B, N)
            out = out._replace(logprobs_BxN=rollout_logprobs(task.cfg, compute, out))
        if steps is not None:
            out = with_steps(out, task, examples, steps, "step_scores" in needs)
        reward_B, metrics = training_rewards(out, label_free)
        if student_fraction < 1:
            metrics["student_data"] = float(on_student)
        rewards_XxM = reward_B.reshape(X, M)
        mask_BxN = _loss_mask(out)

        # ---- advantages, then the variants' token weights
        own, variant_state = split_host(g, state.host)
        old_BxN = critic_update and ppo.rollout_values(task.cfg, state.critic, out, mesh, params, actions)
        teacher_BxN, teacher_BxNxD = teacher_signals(*teacher, out, gkd, g.logprob_chunk) if teacher else (None, None)
        group = estimator_group(out, rewards_XxM, mask_BxN, examples, step_index, cfg.seed, needs, old_BxN, teacher_BxN)
        branched, branch_flops, branch_tokens, branch_key_t = None, 0.0, 0, jax.random.fold_in(branch_key, step_index)
        if "branches" in needs:  # A continuations from the end of each step but the last
            branched, origin = branch(task, mesh, compute, examples, out, branch_key_t, sampling, steps.branches)
            shape = (X, M, steps.max_steps)
            group = group._replace(branch_rewards=branch_rewards(branched, origin, shape, steps.branches))
        if "token_branches" in needs:  # A continuations from the token positions the estimator chooses (APPO)
            ref = to_compute(state.ref_params)
            group, branched, origin = token_branches(
                task, mesh, compute, ref, examples, out, group, g.advantage, advantages.options_of(g), branch_key_t,
                sampling, g.logprob_chunk,
            )  # fmt: skip
        if branched is not None:
            branch_tokens = int(branched.generated_B.sum())
            branch_flops = float(ledger.rollout_flops(task.cfg, branched.prompt_BxP.shape[1], branched.generated_B))
            metrics.update(branch_rows=len(origin), s_branch=sum(branched.seconds.values()))
        estimate = advantages.estimate(g.advantage, group, advantages.options_of(g), own)
        advantage_BxN = token_advantages(g.advantage, estimate.advantage, mask_BxN, M)
        factor_BxN = np.ones((X * M, N), np.float32)
        if estimate.token_weight is not None:  # the estimator's per-token factor (e.g. ntf's filtered tokens: 0)
            factor_BxN = factor_BxN * estimate.token_weight.reshape(X * M, N)
        sampled = Sampled(out.logprobs_BxN, mask_BxN, advantage_BxN, rewards_XxM, step_index)
        for name, variant in variants:
            factor, more = variant.token_weight(g, variant_state[name], sampled)
            factor_BxN = factor_BxN if factor is None else factor_BxN * factor
            metrics.update(more)

        def batches_of(factor):
            return make_batches(
                out, mask_BxN, advantage_BxN, factor_BxN * factor, g.aggregation, g.minibatches, g.microbatches, mesh,
                teacher_BxNxD,
            )  # fmt: skip

        # ---- on diagnostic steps, the split-half figures of the step's gradient at its start (never fed back)
        start = time.perf_counter()
        if every and (step_index + 1) % every == 0:
            gradient = make_gradient(task.cfg, compiled, mesh, cfg.model.dtype, teacher_cfg)
            gradient = functools.partial(gradient, teacher_head=head)
            metrics.update(split_half_diagnostics(gradient, params, state.ref_params, batches_of, X, M))
            metrics["s_diagnostics"] = time.perf_counter() - start
            start = time.perf_counter()

        # ---- μ passes over the minibatches, the first update on-policy
        batches = batches_of(np.float32(1.0))
        history = []
        for iteration in range(g.inner_iterations):
            for m, batch in enumerate(batches):
                params, state, update_metrics = step_update(
                    params, state, batch, jnp.asarray(iteration == 0 and m == 0), head
                )
                history.append(update_metrics)
        update_metrics = jax.tree.map(lambda *xs: jnp.mean(jnp.stack(xs)), *history)
        if critic_update is not None:  # then the critic, on the same schedule, toward the estimator's returns
            returns_BxN = estimate.returns.reshape(X * M, N)
            critic, critic_opt, metrics["value_loss"] = ppo.train_critic(
                critic_update, state.critic, state.critic_opt, out, mask_BxN, old_BxN, returns_BxN, g, mesh, params
            )
            state = state._replace(critic=critic, critic_opt=critic_opt)
        jax.block_until_ready(params)
        metrics["s_update"] = time.perf_counter() - start

        # ---- the host-side state for the next step
        updated = {name: variant.update_state(g, variant_state[name], update_metrics) for name, variant in variants}
        host = join_host(estimate.state, updated)
        if host:
            state = state._replace(host=parallel.put_replicated(mesh, jax.tree.map(jnp.asarray, host)))
        generate_flops = ledger.rollout_flops(task.cfg, out.prompt_BxP.shape[1], out.length_B) + branch_flops
        if not on_student:  # nothing decoded: the student's one forward over the given rows instead
            generate_flops = ledger.forward_flops(task.cfg, X * M, out.prompt_BxP.shape[1] + N, head_positions=N)
        metrics.update(
            update_metrics,
            reward_mean=rewards_XxM.mean(),
            reward_std=rewards_XxM.std(),
            advantage_abs=_mean_abs(estimate.advantage, mask_BxN),
            s_rollout=out.seconds["generate"],
            s_scoring=out.seconds["score"],
            flops_generate=float(generate_flops),
            flops_update=float(update_flops),
            **(estimate.metrics or {}),
            **(out.metrics or {}),
        )
        if M > 1:  # a group of one is trivially all-equal
            metrics.update(
                baselines.equal_groups(
                    rewards_XxM, np.abs(advantage_BxN * factor_BxN).max(1, where=mask_BxN, initial=0)
                )
            )
        prompt_reward = prompt_means(example_B, reward_B, X)
        flops = generate_flops + update_flops
        tokens = int(out.length_B.sum()) if on_student else 0
        return StepOutput(params, state, metrics, tokens + branch_tokens, prompt_reward, flops)

    return Method(init, step, headline="reward_mean")


def make_policy_gradient(cfg: ExperimentConfig, task: Task, mesh: Mesh):
    """pg(params, examples, step_index) -> the plain on-policy GRPO gradient, as an ascent direction in the masters'
    tree: `grpo.group_size` completions per prompt sampled from `params` at `grpo.temperature` (keys from
    seed + 2, apart from every other draw of a run), rewarded as the run's reward, group advantages (`grpo`), the
    plain loss (no variant, no KL). What an ES run's diagnostics compare its estimate with on the same prompts
    (`esroll.es.diagnostics.step_diagnostics`)."""
    g = dataclasses.replace(update_config(cfg.grpo), beta=0.0, variants=(), minibatches=1, microbatches=1)
    X, G, N = cfg.train.prompts_per_step, cfg.grpo.group_size, cfg.train.max_new_tokens
    label_free = cfg.data.label_free
    to_compute = sharding.caster(mesh, cfg.model.dtype)
    sampling = Sampling.of(N, cfg.grpo.temperature, cfg.parallel, cfg.parallel.rows_per_device)
    gradient = make_gradient(task.cfg, g, mesh, cfg.model.dtype)
    key = jax.random.key(cfg.seed + 2)
    example_B = np.repeat(np.arange(X), G)

    def pg(params, examples: list[Example], step_index: int):
        step_key = jax.random.fold_in(key, step_index)
        out = rollout(
            task,
            mesh,
            to_compute(params),
            examples,
            example_B,
            step_key,
            sampling,
            completions=True,
            answers=label_free,
        )
        reward_B, _ = training_rewards(out, label_free)
        advantage_B = advantages.estimate("grpo", advantages.Group(reward_B.reshape(X, G))).advantage
        mask_BxN = _loss_mask(out)
        advantage_BxN = np.broadcast_to(advantage_B.reshape(-1, 1), mask_BxN.shape).astype(np.float32)
        (batch,) = make_batches(out, mask_BxN, advantage_BxN, np.float32(1.0), g.aggregation, 1, 1, mesh)
        grads, _ = gradient(params, None, batch, jnp.asarray(True))
        return jax.tree.map(jnp.negative, grads)

    return pg
