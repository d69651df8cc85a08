"""The ES training step: one prompt batch shared by every member, one rollout with each member's low-rank
perturbation, fitness per member = its mean reward over the X prompts, then the strategy's `tell` (estimator + optax).

Rows are member-major (rows [m·X, (m+1)·X) belong to member m). Every device regenerates the same factors from
(key, step), so only each row's reward crosses devices and hosts.
"""

from __future__ import annotations

import jax
import numpy as np
import optax

from esroll import es, parallel
from esroll.config import ExperimentConfig
from esroll.data import Example
from esroll.rollout import Sampling, rollout
from esroll.task import Method, Task


def make_es_method(cfg: ExperimentConfig, task: Task, optimizer: optax.GradientTransformation, mesh) -> Method:
    strategy = es.make_strategy(cfg.es_config, optimizer)
    M, X = cfg.es.population, cfg.train.prompts_per_step
    example_B, member_B = np.tile(np.arange(X), M), np.repeat(np.arange(M, dtype=np.int32), X)
    # Outputs pinned to the replicated sharding the inputs have, so step 2 hits the jit cache of step 1.
    same = parallel.replicated(mesh)
    ask = jax.jit(strategy.ask, out_shardings=same)
    tell = jax.jit(strategy.tell, out_shardings=same)
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

    return Method(strategy.init, step)
