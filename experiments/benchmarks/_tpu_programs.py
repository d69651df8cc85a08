"""The cases `experiments.benchmarks.tpu_cost` compiles and a training step's programs, lowered for a TPU topology
that is not there.

A `Case` names a model preset (narrowed and made shallower where it says so), a topology, the experiment config
(`configs/gsm8k_qwen3.py`'s argument, with overrides) and the rows per chip (the plan's in `docs/plans/`, or its
own); `CASES` are the real ones, `QUICK` a small one. `CaseTarget(case)` holds the case's mesh (the topology's
devices, `esroll.plan.topology_mesh`), its ES and GRPO configs, row counts and shapes, and lowers each program at any
depth of the model (`at_depth`), from abstract arguments (`jax.ShapeDtypeStruct`s) with the trainer's shardings:
`lower_decode` (one decode step, plain or perturbed through the rows' member tables), `lower_prefill`, `lower_tell`
(ES's `tell`) and `lower_update` (GRPO's update of one microbatch scored at once, `update_settings`). The masters,
ES state, member deltas and GRPO state are built by the planner's own helpers (`esroll.sharding.master_copy`,
`esroll.es.plan.abstract_state` / `abstract_deltas`, `esroll.grpo.plan.abstract_state`), so they are the trainer's.
`decode_weights_bytes`, `layer_weights_bytes`, `factor_bytes` and `cache_bytes` are the bytes one chip must move;
`device_bytes` the bytes one device holds of a tree of abstract arrays.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding, PartitionSpec

from esroll import grpo, parallel, sharding
from esroll.config import from_config_dict
from esroll.es import method as es_method
from esroll.es import plan as es_planner
from esroll.grpo import plan as grpo_planner
from esroll.models import attention
from esroll.models import (
    STACKED,
    KVCache,
    Perturbation,
    abstract_params,
    forward,
    init_cache,
    member_slots,
    model_config,
    most_members,
)
from esroll.plan import topology_mesh
from esroll.sampling_layout import constrain_tables

REPO = Path(__file__).resolve().parents[2]
PROMPT = 256  # prompt tokens, as the plans use (new tokens: the config's train.max_new_tokens)
DATA, MODEL = parallel.DATA, parallel.MODEL


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    preset: str
    topology: str
    config: str  # configs/gsm8k_qwen3.py's argument (the ES variant; ",grpo" is appended for GRPO)
    es_plan: str | None  # docs/plans/<...>.json: the planner's rows per device for ES decoding
    layers: int | None = None  # None: the preset's depth
    widths: tuple = ()  # (ModelConfig field, value) replacing the preset's
    rows_per_device: int = 0  # 0: the plan's
    prompt: int = PROMPT
    overrides: tuple = ()  # (dotted config key, value), applied to both configs


CASES = {
    "0.6b": Case("0.6b", "qwen3-0.6b", "v5e:2x2", "0.6b", "docs/plans/0.6b_v5e-2x2.json"),
    "8b": Case("8b", "qwen3-8b", "v5e:8x8", "8b", "docs/plans/8b_v5e-8x8.json"),
}
QUICK = Case(
    "quick",
    "qwen3-0.6b",
    "v5e:2x2",
    "0.6b",
    None,
    layers=2,
    widths=(
        ("hidden_size", 256),
        ("intermediate_size", 768),
        ("num_heads", 4),
        ("num_kv_heads", 2),
        ("head_dim", 64),
        ("vocab_size", 1024),
        ("tie_word_embeddings", False),
    ),
    rows_per_device=2,
    prompt=16,
    overrides=(
        ("parallel.model", 2),
        ("es.population", 4),
        ("train.prompts_per_step", 1),
        ("train.max_new_tokens", 16),
        ("grpo.group_size", 2),
        ("grpo.microbatches", 1),
    ),
)


def _config(case: Case, method: str | None = None):
    get_config = importlib.import_module("configs.gsm8k_qwen3").get_config
    c = get_config(case.config + (f",{method}" if method else ""))
    for key, value in case.overrides:
        node = c
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return from_config_dict(c.to_dict())


def device_bytes(tree) -> int:
    """Bytes one device holds of `tree` (ShapeDtypeStructs with shardings)."""
    return sum(
        math.prod(x.sharding.shard_shape(tuple(x.shape))) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
    )


def sds(shape, dtype, mesh, *spec):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=NamedSharding(mesh, PartitionSpec(*spec)))


def tree_shardings(tree):
    return jax.tree.map(lambda x: x.sharding, tree)


def _auto(tree):
    """The shardings of `tree`'s leaves with their layouts left to the compiler."""
    return jax.tree.map(lambda x: Format(Layout.AUTO, x.sharding), tree)


class CaseTarget:
    """One case's mesh, configs, row counts and shapes, and its programs lowered at any depth of its model."""

    def __init__(self, case: Case):
        self.case = case
        self.cfg = _config(case)
        self.grpo_cfg = _config(case, "grpo")
        self.mesh, _ = topology_mesh(case.topology, self.cfg.parallel.model)
        kernel = attention.choose(self.cfg.model.attention, self.mesh)
        self.model_cfg = dataclasses.replace(
            model_config(case.preset, case.layers), **dict(case.widths), attention=kernel
        )
        self.data, self.model = parallel.data_size(self.mesh), parallel.model_size(self.mesh)
        self.tensor_parallel = self.model > 1
        per_device = case.rows_per_device
        if not per_device:
            per_device = json.loads((REPO / case.es_plan).read_text())["rows_per_device"]
        self.rows_per_device = per_device
        self.rows = self.data * per_device  # one chunk of the population's rows
        self.new_tokens = self.cfg.train.max_new_tokens
        self.slots = case.prompt + self.new_tokens
        self.members = self.cfg.es.population
        self.rows_per_member = self.cfg.train.prompts_per_step * self.cfg.es.samples
        self.dtype = jnp.dtype(self.cfg.model.dtype)
        self.key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=parallel.replicated(self.mesh))

    def at_depth(self, depth: int):
        return dataclasses.replace(self.model_cfg, num_layers=depth)

    def compute(self, model_cfg):
        """The decoding copy of `model_cfg`'s parameters: abstract, in `model.dtype`, under the compute rules."""
        return sharding.decoding_copy(self.mesh, abstract_params(model_cfg), self.dtype)

    def masters(self, model_cfg, dtype):
        """The masters of `model_cfg`'s parameters: abstract, in `dtype`, under the master rules."""
        return sharding.master_copy(self.mesh, abstract_params(model_cfg), dtype)

    @functools.cached_property
    def strategy(self):
        return es_planner.trainer_strategy(self.cfg, self.mesh)

    def es_state(self, masters):
        return es_planner.abstract_state(self.cfg, self.mesh, masters, self.key)

    def member_deltas(self, model_cfg, compute):
        masters = self.masters(model_cfg, self.cfg.model.master_dtype)
        return es_planner.abstract_deltas(self.cfg, self.mesh, self.es_state(masters), compute)

    def members_per_device(self) -> int:
        """The most distinct members among one device's rows of the first chunk (rows member-major)."""
        return most_members(es_method.member_rows(self.cfg)[: self.rows], self.rows_per_device)

    # ---- the cache and the two ways `generate` partitions a step

    def cache_specs(self):
        """Keys and values [L, B, K, S, H]: rows over data, kv heads over model (where they divide)."""
        heads = MODEL if self.tensor_parallel and self.model_cfg.num_kv_heads % self.model == 0 else None
        kv = PartitionSpec(None, DATA, heads, None, None)
        return KVCache(kv, kv, PartitionSpec(DATA, None), PartitionSpec())

    def abstract_cache(self, model_cfg, slots):
        c = model_cfg
        kv = (c.num_layers, self.rows, c.num_kv_heads, slots, c.head_dim)
        specs = self.cache_specs()
        return KVCache(
            sds(kv, self.dtype, self.mesh, *specs.k),
            sds(kv, self.dtype, self.mesh, *specs.v),
            sds((self.rows, slots), bool, self.mesh, *specs.valid_BxS),
            sds((), jnp.int32, self.mesh),
        )

    def constrain_cache(self, cache):
        if not self.tensor_parallel:
            return cache
        specs = self.cache_specs()
        return jax.tree.map(
            lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, s)),
            cache,
            specs,
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )

    def logits_sharding(self):
        vocab = MODEL if self.tensor_parallel and self.model_cfg.vocab_size % self.model == 0 else None
        return NamedSharding(self.mesh, PartitionSpec(DATA, None, vocab))

    def per_device(self, fn, in_specs, out_specs):
        """`fn` as `generate` runs it: per device under `shard_map` over the rows without a model axis, else as
        written (GSPMD)."""
        if self.tensor_parallel:
            return fn
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    # ---- the programs

    def perturbation(self, model_cfg, compute):
        member_B = sds((self.rows,), jnp.int32, self.mesh, DATA)
        return Perturbation(self.member_deltas(model_cfg, compute), member_B)

    def perturbation_spec(self):
        return Perturbation(PartitionSpec(), PartitionSpec(DATA))

    @functools.cached_property
    def member_slots(self) -> int:
        """The member tables' size the trainer compiles `generate` with: the most distinct members in one device's
        rows over every chunk of a step's rows (`esroll.models.member_slots`, rows member-major)."""
        return member_slots(es_method.member_rows(self.cfg), self.data, self.rows)

    def tables(self, perturb):
        """`perturb` as member tables (`Perturbation.tables`), as `generate` hands them to each decode step: [G, U,
        ...] (layer-stacked [L, G, U, ...]), G one block per device along data (split over it), U `member_slots`;
        and each row's entry. Where `member_slots` is 0, each row's factors instead, as `generate` then has them."""

        def table(path, x):
            axis = int(path[0].key == STACKED)  # [L, M, ...] stacked, [M, ...] single
            shape = (*x.shape[:axis], self.data, self.member_slots, *x.shape[axis + 1 :])
            spec = list(x.sharding.spec) + [None] * (len(x.shape) - len(x.sharding.spec))
            spec[axis : axis + 1] = [DATA, None]
            return sds(shape, x.dtype, self.mesh, *spec)

        def row(path, x):  # no fewer members than rows: each row's factors (`Perturbation.per_row`)
            axis = int(path[0].key == STACKED)
            shape = (*x.shape[:axis], self.rows, *x.shape[axis + 1 :])
            spec = list(x.sharding.spec) + [None] * (len(shape) - len(x.sharding.spec))
            spec[axis] = DATA
            return sds(shape, x.dtype, self.mesh, *spec)

        if not self.member_slots:
            return Perturbation(jax.tree_util.tree_map_with_path(row, perturb.deltas), None)
        slot_B = sds((self.rows,), jnp.int32, self.mesh, DATA)
        return Perturbation(jax.tree_util.tree_map_with_path(table, perturb.deltas), None, slot_B)

    def lower_decode(self, depth: int, perturbed: bool):
        cfg = self.at_depth(depth)
        params = self.compute(cfg)
        cache = self.abstract_cache(cfg, self.slots)
        token = sds((self.rows,), jnp.int32, self.mesh, DATA)
        perturb = self.tables(self.perturbation(cfg, params)) if perturbed else None
        unroll = self.cfg.parallel.scan_unroll

        def step(params, cache, token_B, perturb):
            logits, cache = forward(cfg, params, token_B[:, None], cache=cache, perturb=perturb, unroll=unroll)
            return logits, self.constrain_cache(cache)

        specs = self.cache_specs()
        perturb_spec = None if perturb is None else jax.tree.map(lambda x: x.sharding.spec, perturb)
        run = self.per_device(
            step, (PartitionSpec(), specs, PartitionSpec(DATA), perturb_spec), (PartitionSpec(DATA), specs)
        )
        # Layouts of what lives in `generate`'s loop (weights, cache, factors) are the compiler's choice, as they are
        # inside that loop: with the default entry layouts a lone step converts the whole cache on entry and exit.
        cache_formats = _auto(cache)
        return jax.jit(
            run,
            donate_argnums=(1,),
            in_shardings=(_auto(params), cache_formats, token.sharding, _auto(perturb)),
            out_shardings=(self.logits_sharding(), cache_formats),
        ).lower(params, cache, token, perturb)

    def build_tables(self, perturb):
        """`perturb`'s member tables built in the program, as `generate` builds them before prefilling: each
        device's own under `shard_map`, one block per device along data under GSPMD."""
        if not self.member_slots:
            return perturb.per_row()
        if not self.tensor_parallel:
            return perturb.tables(self.member_slots)
        tables = perturb.tables(self.member_slots, self.data)
        return tables._replace(deltas=constrain_tables(tables.deltas, self.mesh, DATA))

    def lower_prefill(self, depth: int):
        cfg = self.at_depth(depth)
        params = self.compute(cfg)
        prompt = sds((self.rows, self.case.prompt), jnp.int32, self.mesh, DATA)
        mask = sds((self.rows, self.case.prompt), bool, self.mesh, DATA)
        perturb = self.perturbation(cfg, params)
        unroll = self.cfg.parallel.scan_unroll

        if not self.tensor_parallel:  # per device, as `generate` runs it: the attention kernel as it is
            cfg = dataclasses.replace(cfg, attention=cfg.attention.local())

        def prefill(params, prompt_BxP, mask_BxP, perturb):
            B = prompt_BxP.shape[0]
            cache = self.constrain_cache(init_cache(cfg, B, self.slots, self.dtype))  # as `generate`, every slot
            _, cache = forward(
                cfg,
                params,
                prompt_BxP[:, :-1],
                mask_BxT=mask_BxP[:, :-1],
                cache=cache,
                perturb=self.build_tables(perturb),  # once, as `generate` does before prefilling
                unroll=unroll,
                attend_slots=0,
            )
            return self.constrain_cache(cache)

        run = self.per_device(
            prefill,
            (PartitionSpec(), PartitionSpec(DATA), PartitionSpec(DATA), self.perturbation_spec()),
            self.cache_specs(),
        )
        cache_formats = _auto(self.abstract_cache(cfg, self.slots))  # as it enters the decode loop
        return jax.jit(
            run,
            in_shardings=(tree_shardings(params), prompt.sharding, mask.sharding, tree_shardings(perturb)),
            out_shardings=cache_formats,
        ).lower(params, prompt, mask, perturb)

    def lower_tell(self):
        masters = self.masters(self.model_cfg, self.cfg.model.master_dtype)
        state = self.es_state(masters)
        fitness = sds((self.members,), jnp.float32, self.mesh)
        return self.strategy.tell.lower(masters, state, fitness), masters, state

    def update_rows(self) -> int:
        g, train = self.grpo_cfg.grpo, self.grpo_cfg.train
        b = train.prompts_per_step * g.group_size // (g.minibatches * g.microbatches)
        return b + -b % self.data

    def update_settings(self):
        """GRPO's settings for one microbatch scored at once (see `experiments.benchmarks.tpu_cost`'s docstring)."""
        return dataclasses.replace(self.grpo_cfg.grpo, microbatches=1, logprob_chunk=0)

    def grpo_state(self, model_cfg):
        """GRPO's masters and state (optimizer moments; no reference policy at beta 0), with their shardings."""
        c = self.grpo_cfg
        masters = self.masters(model_cfg, c.model.master_dtype)
        return masters, grpo_planner.abstract_state(self.update_settings(), c.optimizer, self.mesh, masters)

    def lower_update(self, depth: int, rows: int):
        c, g = self.grpo_cfg, self.update_settings()
        cfg = self.at_depth(depth)
        masters, state = self.grpo_state(cfg)
        b, P, N = rows, self.case.prompt, c.train.max_new_tokens
        batch = grpo.Rollouts.abstract(1, b, P, N, NamedSharding(self.mesh, PartitionSpec(None, DATA)))
        on_policy = sds((), bool, self.mesh)
        update = grpo.make_update(cfg, grpo.update_config(g), c.optimizer, self.mesh, c.model.dtype)
        return update.lower(masters, state, batch, on_policy)

    # ---- bytes that must move

    def decode_weights_bytes(self) -> int:
        params = self.compute(self.model_cfg)
        head = "embed" if self.model_cfg.tie_word_embeddings else "lm_head"
        return device_bytes([params[STACKED], params["final_norm"], params[head]])

    def layer_weights_bytes(self) -> int:
        return device_bytes(self.compute(self.model_cfg)[STACKED])

    def factor_bytes(self) -> int:
        """The factors of the distinct members among one device's rows."""
        compute = self.compute(self.model_cfg)
        per_member = device_bytes(self.member_deltas(self.model_cfg, compute)) / self.members
        return int(per_member * self.members_per_device())

    def cache_bytes(self, slots: int) -> int:
        cache = self.abstract_cache(self.model_cfg, slots)
        return device_bytes([cache.k, cache.v])
