"""The ES training step: one prompt batch shared by every member, generation with each member's low-rank
perturbation, rewards per (member, prompt), fitness per member, then `es.tell` (estimator + optax update).

Rows are member-major (rows [i·P, (i+1)·P) belong to member i) and split over the mesh; each device regenerates the
same factors from (key, step), so only the per-row rewards — fitness scalars — cross devices and hosts.
"""

from __future__ import annotations

import jax
import numpy as np
import optax

from esroll import es, parallel
from esroll.config import ExperimentConfig
from esroll.data import Example
from esroll.models import Perturbation
from esroll.sampling import generate, pad_prompts
from esroll.task import Method


def es_config(cfg: ExperimentConfig) -> es.ESConfig:
    return es.ESConfig(
        method=cfg.method, population=cfg.es.population, rank=cfg.es.rank, sigma=cfg.es.sigma,
        shaping=cfg.es.shaping, chunk_size=cfg.es.chunk_size or None,
    )  # fmt: skip


def make_es_method(cfg: ExperimentConfig, task, optimizer: optax.GradientTransformation, mesh):
    es_cfg = es_config(cfg)
    N, P = es_cfg.population, cfg.train.prompts_per_step
    if N % mesh.size:
        raise ValueError(f"config: 'es.population' = {N} must be divisible by the number of devices ({mesh.size})")
    member_B = parallel.put_rows(mesh, np.repeat(np.arange(N, dtype=np.int32), P))
    # Outputs pinned to the replicated sharding the inputs have, so step 2 hits the jit cache of step 1.
    same = parallel.replicated(mesh)
    ask = jax.jit(es.ask, static_argnums=0, out_shardings=same)
    tell = jax.jit(es.tell, static_argnums=(0, 4), out_shardings=same)
    sample_key = jax.random.key(cfg.seed + 1)

    def init(params, key):
        return es.init(es_cfg, params, optimizer, key)

    def step(params, state, examples: list[Example], step_index: int):
        tokens, mask = pad_prompts(task.prompt_ids(examples), multiple=task.prompt_multiple, rows=P, pad_id=task.pad_id)
        tokens_R = parallel.put_rows(mesh, np.tile(tokens, (N, 1)))
        mask_R = parallel.put_rows(mesh, np.tile(mask, (N, 1)))
        perturb = Perturbation(ask(es_cfg, state, params), member_B)
        gen = generate(task.cfg, params, tokens_R, jax.random.fold_in(sample_key, step_index),
                       max_new_tokens=cfg.train.max_new_tokens, temperature=cfg.train.temperature,
                       eos_ids=task.eos_ids, prompt_mask=mask_R, perturb=perturb, pad_id=task.pad_id)  # fmt: skip
        idx, out_tokens = parallel.local_rows(gen.tokens)
        _, lengths = parallel.local_rows(gen.lengths)
        local_rewards = task.rewards([examples[i % P] for i in idx], out_tokens, lengths)
        # One exchange across processes per step: each row's reward and generated length.
        rows_Rx2 = parallel.gather_to_all(np.stack([local_rewards, lengths.astype(np.float32)], 1), idx, N * P)
        fitness_N = rows_Rx2[:, 0].reshape(N, P).mean(axis=1)
        params, state, metrics = tell(es_cfg, state, params, parallel.put_replicated(mesh, fitness_N), optimizer)
        return params, state, metrics, int(rows_Rx2[:, 1].sum())

    return Method(init, step)
