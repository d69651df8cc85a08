"""Will an ES step fit? Its five programs compiled for the target's devices (`esroll.plan`): `cast` (master weights
→ the decoding copy), `ask` (this step's low-rank factors), `generate` (one chunk of the population's rows,
perturbed), `tell` (estimate and optimizer update of the masters, donated), and held-out evaluation's `generate`
(greedy, unperturbed).

`trainer_strategy`, `abstract_state` and `abstract_deltas` build the step's abstract ES state and member deltas with
the trainer's shardings; other ahead-of-time compilations of ES programs (`experiments.benchmarks.tpu_cost`) use
them too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from esroll import es, parallel, sharding
from esroll.config import ExperimentConfig
from esroll.es import method as es_method
from esroll.models import ModelConfig
from esroll.plan import Plan, Target, compile_program


def trainer_strategy(cfg: ExperimentConfig, mesh: Mesh) -> es.Strategy:
    """The strategy with jitted ask / tell the trainer runs for `cfg` on `mesh` (`es_method.compiled_strategy`)."""
    return es_method.compiled_strategy(es_method.strategy_config(cfg.es_config), cfg.optimizer, mesh)


def abstract_state(cfg: ExperimentConfig, mesh: Mesh, params, key) -> es.ESState:
    """The ES state the trainer's strategy starts from for the abstract masters `params` and `key`: abstract, laid
    out as the trainer lays it out (`es_method.state_shardings`)."""
    state = jax.eval_shape(trainer_strategy(cfg, mesh).init, params, key)
    return sharding.with_shardings(state, es_method.state_shardings(cfg.es_config, cfg.optimizer, mesh, params))


def abstract_deltas(cfg: ExperimentConfig, mesh: Mesh, state: es.ESState, compute) -> dict:
    """A step's member deltas (the trainer's `ask` of the abstract `state` for the decoding copy `compute`):
    abstract, laid out as `ask` lays them out (following the weights' compute shardings)."""
    deltas = jax.eval_shape(trainer_strategy(cfg, mesh).ask, state, compute)
    return sharding.with_shardings(deltas, sharding.delta_shardings(mesh, deltas, compute))


def plan_es(
    cfg: ExperimentConfig,
    model_cfg: ModelConfig,
    mesh: Mesh,
    *,
    platform: str,
    prompt_len: int,
    eos_ids: tuple[int, ...] = (0,),
    shrink: bool = True,
) -> Plan:
    """Compile an ES step of `cfg` for `mesh` (real devices or a topology's) on `platform`, and measure it.

    With `parallel.rows_per_device` 0 the row count starts from the trainer's estimate (`esroll.memory.rows_per_device`)
    and, when `shrink` and the compiled step does not fit, halved until it does (down to 1 row).
    """
    t = Target(cfg, model_cfg, mesh, platform, prompt_len, eos_ids, shrink)
    params = t.masters()
    strategy = trainer_strategy(cfg, mesh)
    state = abstract_state(cfg, mesh, params, t.key)
    resident = t.resident(params, state)
    masters_and_state = resident["masters"] + resident["optimizer state"]
    deltas = abstract_deltas(cfg, mesh, state, t.compute)
    fitness = jax.ShapeDtypeStruct((cfg.es.population,), jnp.float32, sharding=parallel.replicated(mesh))
    programs = [
        t.cast(params, resident["optimizer state"]),
        compile_program("ask", strategy.ask.lower(state, t.compute), masters_and_state)[0],
        compile_program("tell", strategy.tell.lower(params, state, fitness), 0)[0],
    ]
    rows = es_method.rows_per_step(cfg)
    gen, per_device = t.fit_rows(
        "generate",
        t.auto_rows(rows, resident),
        cfg.train.temperature,
        masters_and_state,
        deltas,
        es_method.member_rows(cfg),
    )
    evaluation, eval_per_device = t.fit_rows(
        "evaluate", t.auto_rows(min(256, cfg.data.eval_size), resident), 0.0, masters_and_state
    )
    return t.plan(rows, per_device, eval_per_device, resident, [*programs, gen, evaluation])
