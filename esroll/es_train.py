"""The ES training step: one prompt batch shared by every member, one rollout with each member's low-rank
perturbation, fitness per member = its mean reward over the X prompts, then the strategy's `tell` (estimator + optax).

Rows are member-major (rows [m·X, (m+1)·X) belong to member m). Every device regenerates the same factors from
(key, step), so only each row's reward crosses devices and hosts.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from esroll import es, parallel
from esroll.config import ExperimentConfig, OptimConfig, make_optimizer
from esroll.data import Example
from esroll.rollout import Sampling, rollout
from esroll.task import Method, Task


@functools.cache
def _strategy(es_cfg: es.ESConfig, optim: OptimConfig, mesh) -> es.Strategy:
    """The strategy with jitted ask / tell, one per (ES config, optimizer config, mesh) in a process, so that runs of
    one process (a comparison's warm-up and its timed runs) share their compilation. Outputs are pinned to the
    replicated sharding the inputs have, so step 2 hits the jit cache of step 1."""
    strategy = es.make_strategy(es_cfg, make_optimizer(optim))
    same = parallel.replicated(mesh)
    return strategy._replace(
        ask=jax.jit(strategy.ask, out_shardings=same), tell=jax.jit(strategy.tell, out_shardings=same)
    )


def make_es_method(cfg: ExperimentConfig, task: Task, mesh) -> Method:
    init, ask, tell = _strategy(cfg.es_config, cfg.optimizer, mesh)
    M, X = cfg.es.population, cfg.train.prompts_per_step
    example_B, member_B = np.tile(np.arange(X), M), np.repeat(np.arange(M, dtype=np.int32), X)
    sample_key = jax.random.key(cfg.seed + 1)
    sampling = Sampling(cfg.train.max_new_tokens, temperature=cfg.train.temperature)

    def step(params, state: es.ESState, examples: list[Example], step_index: int):
        out = rollout(
            task,
            mesh,
            params,
            examples,
            example_B,
            jax.random.fold_in(sample_key, step_index),
            sampling,
            deltas=ask(state, params),
            member_B=member_B,
        )
        fitness_M = out.reward_B.reshape(M, X).mean(axis=1)
        params, state, metrics = tell(state, params, parallel.put_replicated(mesh, fitness_M))
        return params, state, metrics, int(out.length_B.sum())

    return Method(init, step)
