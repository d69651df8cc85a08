"""Will a GRPO step fit? Its programs compiled for the target's devices (`esroll.plan`): the cast of the sharded
masters to the decoding copy, sampling the step's X·G completions (`generate`, in chunks as for ES), one optimizer
update on one minibatch (`esroll.grpo.make_update`: gradient accumulated over its microbatches), and evaluation's
`generate`; with a critic (PPO), its values over the step's rows and its update on one minibatch
(`esroll.grpo.ppo`).

`abstract_state` builds the abstract GRPO state with the trainer's shardings; other ahead-of-time compilations of
GRPO's update (`experiments.benchmarks.tpu_cost`) use it too."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from esroll import parallel, sharding
from esroll.config import ExperimentConfig, GRPOConfig, OptimConfig, make_optimizer
from esroll.critic import on_trunk, trunk_of
from esroll import memory
from esroll.grpo import advantages
from esroll.grpo import method as grpo_method
from esroll.grpo import ppo
from esroll.grpo.update import GRPOState, Rollouts, init_state, make_update, state_shardings, update_config
from esroll.models import ModelConfig, abstract_params
from esroll.plan import Plan, Program, Target, compile_program


def abstract_state(g: GRPOConfig, optim: OptimConfig, mesh: Mesh, params) -> GRPOState:
    """The GRPO state `init_state` makes for the abstract masters `params`: abstract, laid out as the trainer lays it
    out (`state_shardings`)."""
    state = jax.eval_shape(functools.partial(init_state, g, make_optimizer(optim)), params)
    return sharding.with_shardings(state, state_shardings(g, optim, mesh, params))


def plan_grpo(
    cfg: ExperimentConfig,
    model_cfg: ModelConfig,
    mesh: Mesh,
    *,
    platform: str,
    prompt_len: int,
    eos_ids: tuple[int, ...] = (0,),
    shrink: bool = True,
    choose_remat: bool = False,
) -> Plan:
    """Compile a GRPO step of `cfg` for `mesh` and measure it (the row count chosen as `esroll.es.plan.plan_es`
    chooses it). With `choose_remat`, the update is also compiled under every remat policy (`remat_options`) and the
    plan names the cheapest that fits (`Plan.remat`, `Plan.remat_choice`; None where none fits or the device's
    memory is unknown)."""
    t = Target(cfg, model_cfg, mesh, platform, prompt_len, eos_ids, shrink)
    g = cfg.grpo
    params = t.masters()
    state = abstract_state(g, cfg.optimizer, mesh, params)
    resident = t.resident(params, state)
    masters_and_state = resident["masters"] + resident["optimizer state"]
    rows, N = grpo_method.rows_per_step(cfg), cfg.train.max_new_tokens

    # One minibatch of U microbatches of b rows, b padded to a multiple of the data axis (masked rows).
    U = g.microbatches
    b = rows // (g.minibatches * U)
    b += -b % t.data
    micro = NamedSharding(mesh, PartitionSpec(None, parallel.DATA))
    batch = Rollouts.abstract(U, b, prompt_len, N, micro)
    on_policy = jax.ShapeDtypeStruct((), bool, sharding=parallel.replicated(mesh))
    update = make_update(model_cfg, update_config(g), cfg.optimizer, mesh, cfg.model.dtype)
    programs = [
        t.cast(params, resident["optimizer state"]),
        compile_program("update", update.lower(params, state, batch, on_policy), 0)[0],
    ]
    options = {}
    if choose_remat:
        options = remat_options(cfg, model_cfg, mesh, batch, on_policy, known={g.remat: programs[1]})
    if ppo.keeps_critic(g):
        programs += critic_programs(model_cfg, g, mesh, state, rows, prompt_len + N, masters_and_state, params)
    gen, per_device = t.fit_rows("generate", t.auto_rows(rows, resident), g.temperature, masters_and_state)
    evaluation, eval_per_device = t.fit_rows(
        "evaluate", t.auto_rows(min(256, cfg.data.eval_size), resident), 0.0, masters_and_state
    )
    plan = t.plan(rows, per_device, eval_per_device, resident, [*programs, gen, evaluation])
    if options:
        fitting = [name for name, o in options.items() if o["fits"]]  # none where the device's memory is unknown
        plan.remat, plan.remat_choice = options, (fitting[0] if fitting else None)
    return plan


def remat_options(cfg: ExperimentConfig, model_cfg: ModelConfig, mesh: Mesh, batch, on_policy, known=None) -> dict:
    """The update on one minibatch under each remat policy, cheapest first ("none": nothing recomputed; "dots": the
    weight products saved, the rest of each layer recomputed; "full": each layer recomputed from its input), each
    compiled at the model's depth L (`known`: the programs already compiled, by policy) and at d = min(2, L - 1)
    layers: its temporaries per device, its peak (with the masters and optimizer state, its arguments), whether it
    fits, and its temporaries per layer, (temporaries at L layers - at d) / (L - d) (None for one layer)."""
    g, L = cfg.grpo, model_cfg.num_layers
    limit = memory.device_memory_bytes(mesh.devices.flat[0])
    out = {}
    for policy in ("none", "dots", "full"):  # every one of esroll.models.transformer.REMAT_POLICIES
        settings = update_config(dataclasses.replace(g, remat=policy))

        def compiled(depth: int) -> Program:
            c = dataclasses.replace(model_cfg, num_layers=depth)
            params = sharding.master_copy(mesh, abstract_params(c), cfg.model.master_dtype)
            state = abstract_state(g, cfg.optimizer, mesh, params)
            update = make_update(c, settings, cfg.optimizer, mesh, cfg.model.dtype)
            return compile_program(f"update ({policy})", update.lower(params, state, batch, on_policy), 0)[0]

        whole = (known or {}).get(policy) or compiled(L)
        d = min(2, L - 1)
        out[policy] = {
            "temp_bytes": whole.temp_bytes,
            "peak_bytes": whole.peak_bytes,
            "fits": None if limit is None else whole.peak_bytes <= limit,
            "temp_bytes_per_layer": (whole.temp_bytes - compiled(d).temp_bytes) // (L - d) if d > 0 else None,
        }
    return out


def critic_programs(
    model_cfg: ModelConfig, g: GRPOConfig, mesh: Mesh, state: GRPOState, rows: int, T: int, resident, params
):
    """The critic's two programs, compiled as the trainer runs them: its values over all `rows` rows of T tokens (one
    forward, `ppo.rollout_values`), and its update on one minibatch in `grpo.microbatches` (`ppo.train_critic`). Each
    has the critic as an argument (a value head alone reads the trunk of the policy's masters `params`); the policy's
    masters and optimizer state live beside it (`resident`, less the critic's own bytes, which it counts)."""
    critic = (state.critic, state.critic_opt)
    beside = resident - memory.tree_bytes_per_device(critic, jax.tree.map(lambda x: x.sharding, critic))
    padded = parallel.padded_rows(rows, mesh)
    row_sharding = parallel.rows(mesh)
    tokens = jax.ShapeDtypeStruct((padded, T), jnp.int32, sharding=row_sharding)
    mask = jax.ShapeDtypeStruct((padded, T), bool, sharding=row_sharding)
    read = ppo.read_values(model_cfg)
    whole = on_trunk(state.critic, params)
    programs = [compile_program("critic values", read.lower(whole, tokens, mask_BxT=mask), beside)[0]]
    U = g.microbatches
    b = parallel.padded_rows(rows // (g.minibatches * U), mesh)
    micro = NamedSharding(mesh, PartitionSpec(None, parallel.DATA))
    outputs = getattr(advantages.options_of(g), "critic_outputs", 1)
    readings = (2 * outputs,) if outputs > 1 else ()  # DAE's: its outputs, log π and the action (`ppo.dae_readings`)
    shapes = [(U, b, T)] * 3 + [(U, b, T, *readings), (U, b, T)]
    dtypes = (jnp.int32, bool, bool, jnp.float32, jnp.float32)
    batch = [jax.ShapeDtypeStruct(shape, dt, sharding=micro) for shape, dt in zip(shapes, dtypes)]
    update = ppo.make_critic_update(model_cfg, g, mesh)
    trunk = trunk_of(state.critic, params)
    programs.append(compile_program("critic update", update.lower(*critic, *batch, trunk=trunk), beside)[0])
    return programs
