"""Group advantages (GRPO): the registry `grpo.advantage` names, what an estimator reads and returns, and the
estimators that are group-relative transforms of rewards (`esroll.baselines`: grpo, grpo_population_std, dr_grpo, rloo,
raw, zscore, centered_ranks).

An estimator reads more than the rewards: the step (schedules), the completions' log-probabilities, a cluster key per
prompt, the parsed answers (label-free rewards) and a small running state that the trainer checkpoints. Each is a
pure function

    fn(group: Group, options: AdvantageConfig, state) -> Estimate(advantage [X, M], token_weight [X, M, N] | None,
                                                                  state, metrics)

(numpy, on the host, float64 inside). The estimators of recent papers (A-GRAE, BV-Blend, GMAE, MaxPO, LamPO, NTF,
DDRL) are in `esroll.grpo.estimators`, registered through `register_advantage` as a user's own would be
(docs/extending.md); what each computes, and what its source leaves open, is written down in docs/advantages.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np

from esroll import baselines
from esroll.baselines import Shaping
from esroll.config import AdvantageConfig
from esroll.data import Example
from esroll.registry import Registry

# ---- the registry: what `grpo.advantage` names

Estimator = Callable[..., "Estimate"]  # fn(group: Group, options: AdvantageConfig, state: dict | None) -> Estimate

# name -> (estimator, initial state or None)
ESTIMATORS: Registry[tuple[Estimator, Callable[[AdvantageConfig], Any] | None]] = Registry(
    "advantage estimator", "grpo.advantage"
)
SINGLE_ROLLOUT: set[str] = set()  # estimators that work with one completion per prompt
# name -> the fields of `grpo.adv` (AdvantageConfig) the estimator reads; None: not declared (taken as all of them)
OPTIONS: dict[str, tuple[str, ...] | None] = {}
LABEL_FREE_ONLY: set[str] = set()  # estimators that need the parsed answers (data.reward = "majority")


def register_advantage(
    name: str,
    fn: Estimator | None = None,
    init: Callable[[AdvantageConfig], dict] | None = None,
    *,
    single_rollout: bool = False,
    label_free_only: bool = False,
    options: Iterable[str] | None = None,
    replace: bool = False,
):
    """Register the group-advantage estimator `grpo.advantage = name` selects.

    fn(group: Group, options: AdvantageConfig, state: dict | None) -> Estimate: one step's X prompts × M completions
    (`Group`: rewards [X, M], the step, the seed, the completions' log-probabilities, the parsed answers in the
    label-free mode) to advantages [X, M] (0 on invalid entries), optional per-token loss weights [X, M, N], the
    running state after the step and metrics to log. It runs on the host, in numpy, once per step; `options` is the
    config's `grpo.adv` section. init(options) -> dict: the running state of the first step, a dict of numpy arrays
    whose shapes never change (it is checkpointed with the run); None (the default): the estimator keeps none and
    is passed state None. single_rollout: it works with one completion per prompt (grpo.group_size 1 is then
    allowed); label_free_only: it reads `group.answers` and needs data.reward = "majority"; options: the fields of
    `grpo.adv` it reads (the others are refused when set on the command line with this estimator; None: all of them).

    A name already registered is refused unless `replace` is set. Returns `fn`; without `fn`, a decorator."""
    if fn is None:
        return lambda f: register_advantage(
            name,
            f,
            init,
            single_rollout=single_rollout,
            label_free_only=label_free_only,
            options=options,
            replace=replace,
        )
    _check_new(name, fn, replace)
    if init is not None and not callable(init):
        raise TypeError(f"advantage estimator {name!r}: init must be callable, got {init!r}")
    if options is not None:
        options = tuple(options)
        known = [f.name for f in dataclasses.fields(AdvantageConfig)]
        unknown = [o for o in options if o not in known]
        if unknown:
            raise ValueError(f"advantage estimator {name!r}: option {unknown[0]!r} is not a field of grpo.adv")
    _set_estimator(name, fn, init, single_rollout=single_rollout, label_free_only=label_free_only, options=options)
    return fn


def _check_new(name: str, fn, replace: bool) -> None:
    ESTIMATORS.check_new(name, replace=replace)
    if not callable(fn):
        raise TypeError(f"{name!r}: {fn!r} is not callable")


def _set_estimator(name: str, fn: Estimator, init, *, single_rollout: bool, label_free_only: bool, options) -> None:
    ESTIMATORS[name] = (fn, init)
    OPTIONS[name] = options
    for flag, names in ((single_rollout, SINGLE_ROLLOUT), (label_free_only, LABEL_FREE_ONLY)):
        if flag:
            names.add(name)
        else:
            names.discard(name)


def from_shaping(shaping: Shaping) -> Estimator:
    """The stateless estimator that applies a group-relative transform (`esroll.baselines`) to the rewards."""

    def estimate(g: Group, o: AdvantageConfig, state=None) -> Estimate:
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
    cluster: np.ndarray | None = None  # [X] int in [0, bv_clusters): the prompt's cluster; None: from `examples`
    answers: np.ndarray | None = None  # [X, M] int64 parsed-answer ids (`answer_id`), -1 for no answer
    examples: list[Example] | None = None  # the X prompts' examples (their task, difficulty, meta)


class Estimate(NamedTuple):
    advantage: np.ndarray  # [X, M] float32; 0 on invalid entries
    token_weight: np.ndarray | None = None  # [X, M, N]: multiplies the loss's token weights (None: all 1)
    state: dict | None = None  # the running state after this step (None: the estimator has none)
    metrics: dict | None = None  # logged (None: nothing)


def init_state(name: str, options: AdvantageConfig) -> dict | None:
    """The running state estimator `name` starts from (None if it keeps none)."""
    init = _estimator(name)[1]
    return None if init is None else init(options)


def estimate(name: str, group: Group, options: AdvantageConfig, state: dict | None = None) -> Estimate:
    """Estimator `name` on one step's groups; `state` is what the previous call returned (or `init_state`)."""
    return _estimator(name)[0](group, options, state)


def _estimator(name: str):
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {', '.join(ESTIMATORS)}")
    return ESTIMATORS[name]


def valid_rewards(g: Group) -> tuple[np.ndarray, np.ndarray]:
    """The rewards as float64 with invalid entries (masked out or non-finite) set to 0, and the valid mask."""
    r = np.asarray(g.rewards, np.float64)
    valid = np.ones(r.shape, bool) if g.valid is None else np.asarray(g.valid, bool)
    valid = valid & np.isfinite(r)
    return np.where(valid, r, 0.0), valid


for _name, _shaping in baselines.BUILTIN.items():
    register_advantage(_name, from_shaping(_shaping), options=())
