"""The training methods a config's `method` names, and what the training loop, the planner and the run's bookkeeping
need of each: so that none of them asks which method it runs.

    spec("looroll").build(cfg, task, mesh, rows_per_device) -> Method   (init, step; `esroll.task.Method`)
    spec("grpo").plan(cfg, model_cfg, mesh, ...) -> Plan                 (the method's own plan.py, `esroll.plan`)
    spec(name).rows_per_step(cfg)       completions sampled by one training step
    spec(name).updates_per_step(cfg)    optimizer updates one training step takes (learning-rate schedule steps)
    spec(name).check(cfg)               what the method needs of the config's other sections
    spec(name).unread(cfg)              the keys a run of the method does not read (`--print_config` marks them)

This module is where the two method families meet: ES (`esroll.es`) and GRPO (`esroll.grpo`) never import each other,
and an ES run's diagnostics compare its estimate with GRPO's policy gradient (`train.diagnostics_pg`), which is wired
here. Every ES estimator (`esroll.es.estimators`, one module each) is a method of the one ES spec, `ES`; any other
method registers its `MethodSpec` with `METHODS.add`. `names()` lists them all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from esroll.config import ExperimentConfig
from esroll.es import estimators
from esroll.es import method as es_method
from esroll.es.plan import plan_es
from esroll.grpo import method as grpo_method
from esroll.grpo.plan import plan_grpo
from esroll.plan import Plan
from esroll.registry import Registry
from esroll.task import Method


class MethodSpec(NamedTuple):
    """What the loop and the planner need of a training method."""

    build: Callable[..., Method]  # (cfg, task, mesh, rows_per_device: int | None) -> Method
    plan: Callable[..., Plan]  # (cfg, model_cfg, mesh, *, platform, prompt_len, eos_ids, shrink)
    rows_per_step: Callable[[ExperimentConfig], int]  # completions one step samples
    updates_per_step: Callable[[ExperimentConfig], int]  # optimizer updates one step takes
    check: Callable[[ExperimentConfig], None]  # what the method needs of the config's other sections (ConfigError)
    unread: Callable[[ExperimentConfig], dict[str, str]]  # {key or section.: why} the method does not read


METHODS: Registry[MethodSpec] = Registry("method", "method")


def _build_es(cfg: ExperimentConfig, task, mesh, rows_per_device: int | None = None) -> Method:
    """The ES method; with `train.diagnostics_pg`, its diagnostics also read GRPO's plain policy gradient."""
    pg = grpo_method.make_policy_gradient(cfg, task, mesh) if cfg.train.diagnostics_pg else None
    return es_method.make_es_method(cfg, task, mesh, rows_per_device=rows_per_device, policy_gradient=pg)


def _build_grpo(cfg: ExperimentConfig, task, mesh, rows_per_device: int | None = None) -> Method:
    return grpo_method.make_grpo_method(cfg, task, mesh, rows_per_device=rows_per_device)


ES = MethodSpec(
    _build_es,
    plan_es,
    es_method.rows_per_step,
    es_method.updates_per_step,
    es_method.check_config,
    es_method.unread,
)  # every ES estimator's (`esroll.es.estimators.ESTIMATORS`): the estimator is the config's `method`

METHODS.add(
    "grpo",
    MethodSpec(
        _build_grpo,
        plan_grpo,
        grpo_method.rows_per_step,
        grpo_method.updates_per_step,
        grpo_method.check_config,
        grpo_method.unread,
    ),
)


def names() -> tuple[str, ...]:
    """Every name a config's `method` may take: the ES estimators registered (`esroll.es.estimators.register_estimator`),
    then the other methods."""
    return (*estimators.ESTIMATORS, *METHODS)


def expected() -> str:
    return f"one of {', '.join(names())}"


def spec(name: str) -> MethodSpec:
    """The spec of method `name` (a ValueError naming every method if there is none)."""
    if name in estimators.ESTIMATORS:
        return ES
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; expected {expected()}")
    return METHODS[name]


def lookup(cfg: ExperimentConfig) -> MethodSpec:
    """The spec of `cfg.method` (a ValueError naming every method if there is none)."""
    return spec(cfg.method)


def plan_step(cfg: ExperimentConfig, model_cfg, mesh, **kwargs) -> Plan:
    """The plan of `cfg.method`'s step, by the method's own planner (`MethodSpec.plan`)."""
    return lookup(cfg).plan(cfg, model_cfg, mesh, **kwargs)
