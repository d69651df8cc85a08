"""Group advantages (GRPO): the registry `grpo.advantage` names, what an estimator reads and returns, and the
estimators that are group-relative transforms of rewards (`esroll.baselines`: grpo, grpo_population_std, dr_grpo, rloo,
raw, zscore, centered_ranks).

An estimator reads more than the rewards: the step (schedules), the completions' log-probabilities, a cluster key per
prompt, the parsed answers (label-free rewards) and a small running state that the trainer checkpoints, and it may
bring its own options (a frozen dataclass registered with it: `grpo.adv.<name>.<key>`). Each is a pure function

    fn(group: Group, options, state) -> Estimate(advantage [X, M] or [X, M, N], token_weight [X, M, N] | None,
                                                 state, metrics)

An advantage is one per completion [X, M] (each of its tokens gets it) or one per token [X, M, N] (credit below the
whole completion: a step's tokens share their step's advantage); the loss takes either the same way, multiplied by
the token factors it applies (the estimator's `token_weight`, the variants') and aggregated as configured, and a
per-token advantage that is constant over each completion gives exactly the loss and gradient of the per-completion one.

(numpy, on the host, float64 inside). The estimators of recent papers are in `esroll.grpo.estimators` (one module
each, listed in its docstring), registered through `register_advantage` as a user's own would be (docs/extending.md);
`ESTIMATORS` holds every registered name. What each computes, and what its source leaves open, is written down in
docs/advantages.md (the step- and turn-level ones: docs/step_level.md, docs/agents.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np

from esroll import baselines
from esroll.baselines import Shaping
from esroll.data import Example, step_states
from esroll.registry import Registry
from esroll.steps import Steps

# ---- the registry: what `grpo.advantage` names

Estimator = Callable[..., "Estimate"]  # fn(group: Group, options, state: dict | None) -> Estimate
STEP_NEEDS = ("steps", "step_scores", "branches", "states")  # what reads the `steps` config section
NEEDS = (
    "logprobs",
    "answers",
    "examples",
    *STEP_NEEDS,
    "turns",
    "values",
    "teacher",
    "teacher_distributions",
    "token_branches",
    "reflection",
)  # what it may read beyond the rewards
TEACHER_NEEDS = frozenset({"teacher", "teacher_distributions"})  # what loads the `teacher` config section's model


class EstimatorSpec(NamedTuple):
    """A registered estimator: its function, how its running state starts, and what it needs."""

    fn: Estimator
    init: Callable[[Any], dict] | None = None  # init(options) -> the first step's state; None: it keeps none
    single_rollout: bool = False  # works with one completion per prompt (grpo.group_size 1 allowed)
    label_free_only: bool = False  # reads the parsed answers and needs data.reward = "majority"
    needs: tuple[str, ...] = ()  # the `NEEDS` it reads
    branch_points: Callable[[Any, "Group"], tuple[np.ndarray, int]] | None = None  # "token_branches": where to branch


ESTIMATORS: Registry[EstimatorSpec] = Registry("advantage estimator", "grpo.advantage", options_key="grpo.adv")


def register_advantage(
    name: str,
    fn: Estimator | None = None,
    init: Callable[[Any], dict] | None = None,
    *,
    options: type | None = None,
    needs: Iterable[str] = (),
    single_rollout: bool = False,
    label_free_only: bool = False,
    branch_points: Callable[[Any, "Group"], tuple[np.ndarray, int]] | None = None,
    replace: bool = False,
):
    """Register the group-advantage estimator `grpo.advantage = name` selects.

    fn(group: Group, options, state: dict | None) -> Estimate: one step's X prompts × M completions (`Group`: rewards
    [X, M], the step, the seed, and what `needs` asks for) to advantages [X, M] or per token [X, M, N] (0 on invalid
    entries; tokens past a completion's end are ignored), optional per-token loss weights [X, M, N], the running
    state after the step and metrics to log. It runs on the host, in numpy, once per step.

    options: the estimator's own frozen dataclass of options, every field with a default; its fields are config keys
    `grpo.adv.<name>.<field>` (checked, overridable from the command line, saved with the run), and `fn` and `init`
    receive the run's instance (None without options). A dataclass may also define `check(self, grpo)` raising a
    `esroll.config.ConfigError` (key relative to `grpo`) for GRPO settings it cannot work with.
    init(options) -> dict: the running state of the first step, a dict of numpy arrays whose shapes never change
    (it is checkpointed with the run); None (the default): the estimator keeps none and is passed state None.
    needs: what it reads of the rollout beyond the rewards, among `NEEDS`: "logprobs" (`Group.seq_logp`,
    `token_logp`, `token_mask`), "answers" (the parsed answers, which the rollout produces in the label-free mode
    only), "examples" (the prompts), "steps" (`Group.steps`, each completion cut into reasoning steps by the `steps`
    config section), "step_scores" (`Group.step_scores`, each step's score by `steps.verifier`), "branches"
    (`Group.branch_rewards`, the rewards of `steps.branches` continuations sampled from the end of each step),
    "states" (`Group.states`, the state each step reaches by the task's `step_state`), "turns" (`Group.turns`, the
    turns of multi-turn episodes, with the token mask: agent runs only, `esroll.agents`), "values" (`Group.values`,
    a critic's values before each generated token, with the token mask and, in agent runs, the turns: the method
    then keeps and trains a critic on the `Estimate.returns` the estimator gives), "teacher" (`Group.teacher_logp`,
    the log-probability of each sampled token under the `teacher` config section's model), "teacher_distributions"
    (not read by the estimator but by the update: the teacher's hidden states at each completion position travel
    with the rows, its head gives its whole next-token distributions there, and the loss adds GKD's generalised JSD
    to them with the β of the estimator's
    options, `beta`; `esroll.grpo.estimators.distill.gkd`), "token_branches" (`Group.entropy` and
    `Group.ref_logratio` of each sampled token, the initial policy kept to give the latter; then `branch_points(options,
    group)` -> (positions [X, M, K], A) says where to branch, and `Group.branch_positions`, `Group.branch_rewards`
    [X, M, K, A] hold the rewards of A continuations of each completion from its first t tokens, t = each position),
    "reflection" (with "turns": each training episode is followed by the model's reflection, `env.reflect_tokens`,
    whose text and span are in `Group.turns`, RePro's);
    the step fills only these fields of its `Group` (and the steps, token log-probabilities and mask with any step
    need).
    single_rollout: it works with one completion per prompt (grpo.group_size 1 is then allowed); label_free_only:
    it needs data.reward = "majority".

    A name already registered is refused unless `replace` is set. Returns `fn`; without `fn`, a decorator."""
    spec = dict(options=options, needs=needs, single_rollout=single_rollout, label_free_only=label_free_only)
    spec["branch_points"] = branch_points
    if fn is None:
        return lambda f: register_advantage(name, f, init, replace=replace, **spec)
    ESTIMATORS.check_new(name, replace=replace)
    if not callable(fn):
        raise TypeError(f"{name!r}: {fn!r} is not callable")
    if init is not None and not callable(init):
        raise TypeError(f"advantage estimator {name!r}: init must be callable, got {init!r}")
    needs = tuple(needs)
    unknown = [n for n in needs if n not in NEEDS]
    if unknown:
        raise ValueError(f"advantage estimator {name!r}: needs {unknown[0]!r} (expected among {', '.join(NEEDS)})")
    if {"branches", "token_branches"} <= set(needs):
        raise ValueError(f"advantage estimator {name!r}: needs one of 'branches' and 'token_branches', not both")
    if ("token_branches" in needs) != callable(branch_points):
        raise ValueError(f"advantage estimator {name!r}: branch_points is given exactly when it needs 'token_branches'")
    entry = EstimatorSpec(fn, init, single_rollout, label_free_only, needs, branch_points)
    ESTIMATORS.add(name, entry, options=options, replace=replace)
    return fn


def options_of(g) -> Any:
    """The options of `g.advantage` (a `GRPOConfig`'s estimator) in `g.adv`: None when it registered none."""
    return ESTIMATORS.options_of(g.adv, g.advantage)


def from_shaping(shaping: Shaping) -> Estimator:
    """The stateless estimator that applies a group-relative transform (`esroll.baselines`) to the rewards."""

    def estimate(g: Group, o=None, state=None) -> Estimate:
        return Estimate(np.asarray(shaping(g.rewards, g.valid), np.float32))

    estimate.__name__, estimate.__doc__ = shaping.__name__, shaping.__doc__
    return estimate


# ---- group-advantage estimators (GRPO): rewards plus what a method reads, and a small running state


class Group(NamedTuple):
    """What an estimator may read about one step's X prompts × M completions (rows prompt-major)."""

    rewards: np.ndarray  # [X, M] float
    step: int = 0  # the optimizer step this batch is for (schedules are functions of it)
    seed: int = 0  # the run's seed (estimators that subsample draw from (seed, step))
    valid: np.ndarray | None = None  # [X, M] bool; None: all valid (non-finite rewards are never valid)
    seq_logp: np.ndarray | None = None  # [X, M] mean log π_old per completion token
    token_logp: np.ndarray | None = None  # [X, M, N] log π_old of each sampled token
    token_mask: np.ndarray | None = None  # [X, M, N] bool: completion tokens
    cluster: np.ndarray | None = None  # [X] int in [0, bv_blend.clusters): the prompt's cluster; None: from `examples`
    answers: np.ndarray | None = None  # [X, M] int64 parsed-answer ids (`answer_id`), -1 for no answer
    examples: list[Example] | None = None  # the X prompts' examples (their task, difficulty, meta)
    steps: Steps | None = None  # the X·M completions' reasoning steps (`esroll.steps.Steps`, rows prompt-major)
    step_scores: np.ndarray | None = None  # [X, M, J] each step's verifier score; NaN past a completion's steps
    branch_rewards: np.ndarray | None = None  # [X, M, J, A] rewards of A continuations from the end of step s; NaN
    # where none was sampled (the last step, steps past a completion's count)
    states: np.ndarray | None = None  # [X, M, J] int, J the most steps of any completion: the state after each step
    # (`esroll.data.step_states`), ids equal within a prompt's group exactly where the states are; -1 past a
    # completion's steps (`state_ids`)
    turns: Any = None  # the X·M episodes' turns (`esroll.agents.Turns`, rows prompt-major): agent runs
    values: np.ndarray | None = None  # [X, M, N] the critic's value before each generated token (`esroll.critic`)
    # ([X, M, N, C] for DAE: its readings, `esroll.grpo.ppo.dae_readings`)
    teacher_logp: np.ndarray | None = None  # [X, M, N] log π_T of each sampled token (`esroll.teacher`), 0 past the end
    entropy: np.ndarray | None = None  # [X, M, N] the policy's next-token entropy at each sampled token, 0 past the end
    ref_logratio: np.ndarray | None = None  # [X, M, N] log π_θ − log π_ref of each sampled token, 0 past the end
    branch_positions: np.ndarray | None = None  # [X, M, K] where `branch_rewards` branched (-1: nowhere); then
    # `branch_rewards` is [X, M, K, A], continuations from each completion's first t tokens


def state_ids(keys_per_row: list[list], X: int, M: int, J: int) -> np.ndarray:
    """[X, M, J] int64 ids of the rows' state keys (rows prompt-major, `keys_per_row[x·M + j]` the keys of row j of
    prompt x after each step): equal ids within a prompt exactly where the keys are equal, numbered 0, 1, ... in
    order of first appearance; -1 past a row's steps. The prompt itself (the state before the first step) has no
    key: an estimator treats "before step 0" as the group's root."""
    ids = np.full((X, M, J), -1, np.int64)
    for x in range(X):
        seen: dict = {}
        for j in range(M):
            for s, key in enumerate(keys_per_row[x * M + j][:J]):
                ids[x, j, s] = seen.setdefault(key, len(seen))
    return ids


class Estimate(NamedTuple):
    advantage: np.ndarray  # [X, M] float32, or per token [X, M, N]; 0 on invalid entries
    token_weight: np.ndarray | None = None  # [X, M, N]: multiplies the loss's token weights (None: all 1)
    state: dict | None = None  # the running state after this step (None: the estimator has none)
    metrics: dict | None = None  # logged (None: nothing)
    returns: np.ndarray | None = None  # [X, M, N]: the critic's targets, from an estimator that reads "values"


def init_estimator_state(name: str, options: Any = None) -> dict | None:
    """The running state estimator `name` starts from (None if it keeps none); `options`: its options (None: its
    defaults)."""
    spec = ESTIMATORS.lookup(name)
    return None if spec.init is None else spec.init(_options(name, options))


def estimate(name: str, group: Group, options: Any = None, state: dict | None = None) -> Estimate:
    """Estimator `name` on one step's groups with its `options` (None: its defaults); `state` is what the previous
    call returned (or `init_estimator_state`)."""
    return ESTIMATORS.lookup(name).fn(group, _options(name, options), state)


def _options(name: str, options: Any) -> Any:
    return ESTIMATORS.options_of({}, name) if options is None else options


def valid_rewards(g: Group) -> tuple[np.ndarray, np.ndarray]:
    """The rewards as float64 with invalid entries (masked out or non-finite) set to 0, and the valid mask."""
    r = np.asarray(g.rewards, np.float64)
    valid = np.ones(r.shape, bool) if g.valid is None else np.asarray(g.valid, bool)
    valid = valid & np.isfinite(r)
    return np.where(valid, r, 0.0), valid


def all_equal(g: Group) -> np.ndarray:
    """[X] bool: the groups that have a valid completion and whose valid completions' rewards are all equal (where
    a group-relative advantage is 0 everywhere)."""
    r, valid = valid_rewards(g)
    low, high = np.where(valid, r, np.inf).min(1), np.where(valid, r, -np.inf).max(1)
    return valid.any(1) & (low == high)


def step_sums(g: Group, values_XxMxN: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sums [X, M, J], token counts [X, M, J]) of a per-token quantity over each step of each completion: the
    completion tokens (`g.token_mask`) that `g.steps` puts in step s. J is the most steps of any completion."""
    X, M, N = g.token_mask.shape
    step = np.where(np.asarray(g.token_mask, bool), np.asarray(g.steps.step_BxN).reshape(X, M, N), -1)
    values = np.asarray(values_XxMxN, np.float64)
    J = max(int(np.asarray(g.steps.count_B).max(initial=0)), 1)
    sums, counts = np.zeros((X, M, J)), np.zeros((X, M, J), np.int64)
    for s in range(J):
        on = step == s
        sums[..., s] = np.where(on, values, 0.0).sum(2)
        counts[..., s] = on.sum(2)
    return sums, counts


def step_means(g: Group, values_XxMxN: np.ndarray) -> np.ndarray:
    """[X, M, J]: the mean of a per-token quantity over each step's tokens (`step_sums`); NaN where a step has
    none (past a completion's steps)."""
    sums, counts = step_sums(g, values_XxMxN)
    return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def per_token(g: Group, step_XxMxJ: np.ndarray, plus_XxM: np.ndarray | float = 0.0) -> np.ndarray:
    """[X, M, N] float32: each completion token gets its step's value (NaN counts as 0) plus its completion's
    `plus`; tokens past a completion's end get 0. The inverse of reading a per-step advantage per token."""
    X, M, N = g.token_mask.shape
    step = np.asarray(g.steps.step_BxN).reshape(X, M, N)
    adv = np.nan_to_num(np.asarray(step_XxMxJ, np.float64))
    taken = np.take_along_axis(adv, np.clip(step, 0, adv.shape[2] - 1), axis=2)
    total = taken + np.broadcast_to(np.asarray(plus_XxM, np.float64), (X, M))[..., None]
    keep = np.asarray(g.token_mask, bool) & (step >= 0)
    return np.where(keep, total, 0.0).astype(np.float32)


for _name, _shaping in baselines.BUILTIN.items():
    register_advantage(_name, from_shaping(_shaping))


def estimator_group(
    out,
    rewards_XxM,
    mask_BxN,
    examples,
    step_index: int,
    seed: int,
    needs: tuple[str, ...],
    values_BxN=None,
    teacher_BxN=None,
) -> Group:
    """What the advantage estimator reads of a step's X × M sampled rows (`esroll.grpo.advantages.Group`): the
    rewards, step and seed, and the fields its `needs` name (the parsed answers exist in the label-free mode only;
    the critic's `values_BxN` are given when "values" is, the teacher's log-probabilities `teacher_BxN` when
    "teacher" is)."""
    X, M = rewards_XxM.shape
    N = mask_BxN.shape[1]
    fields = {}
    step_needs = set(needs) & set(STEP_NEEDS)
    if "logprobs" in needs:
        seq_logp = np.where(mask_BxN, out.logprobs_BxN, 0.0).sum(1) / np.maximum(out.length_B, 1)
        fields["seq_logp"] = seq_logp.reshape(X, M)
    if "logprobs" in needs or step_needs or {"turns", "values", "token_branches"} & set(needs):
        fields.update(token_logp=out.logprobs_BxN.reshape(X, M, N), token_mask=mask_BxN.reshape(X, M, N))
    if "values" in needs:
        fields.update(values=values_BxN.reshape(X, M, *values_BxN.shape[1:]), turns=out.turns)
    if "teacher" in needs:
        fields["teacher_logp"] = teacher_BxN.reshape(X, M, N)
    if "answers" in needs and out.answer_B is not None:
        fields["answers"] = out.answer_B.reshape(X, M)
    if "examples" in needs:
        fields["examples"] = examples
    if step_needs:
        fields["steps"] = out.steps
    if "step_scores" in needs:
        fields["step_scores"] = out.step_scores_BxJ.reshape(X, M, -1)
    if "turns" in needs:
        fields["turns"] = out.turns
    if "states" in needs:
        keys = [step_states(examples[b // M], out.steps.text[b]) for b in range(X * M)]
        fields["states"] = state_ids(keys, X, M, max(int(out.steps.count_B.max(initial=0)), 1))
    return Group(rewards_XxM, step=step_index, seed=seed, **fields)
