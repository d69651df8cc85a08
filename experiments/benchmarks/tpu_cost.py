"""Per-chip cost of a training step's accelerator programs, from the TPU compiler's cost model, without a TPU.

    python -m experiments.benchmarks.tpu_cost [--quick] [--cases 0.6b,8b] [--programs decode_plain,...]
                                              [--rows-per-device N] [--json PATH]
    python -m experiments.benchmarks.tpu_cost --cases 0.6b --breakdown decode_plain [--hlo-out DIR]

Each program is compiled ahead of time for a deviceless TPU topology (`jax.experimental.topologies`, as
`esroll.plan.topology_mesh` does; needs libtpu) and its `compiled.cost_analysis()` is read: `flops`, `bytes accessed`
and `optimal_seconds` of the per-device SPMD program, so every figure is per chip. Parameters, caches, factors and
batches are `jax.ShapeDtypeStruct`s with the trainer's shardings (`esroll.sharding`): the decoding copy in
`model.dtype` (bfloat16) under the compute rules for decoding, float32 masters and moments under the master rules
for `tell` and the update. Programs:

    decode_plain      one decode step: `forward` of 1 token per row over the layer-stacked KV cache of prompt + new
                      slots (donated, written in place), as `generate` runs it: under `shard_map` over the rows when
                      the mesh has no model axis, else partitioned by GSPMD with the cache's rows over "data" and its
                      kv heads over "model";
    decode_perturbed  the same step with the rows' ES members' low-rank factors as member tables
                      (`Perturbation.tables`: each device's table of the distinct members among its rows, split over
                      "data" one block per device, and each row's entry) as `generate` builds them once per call
                      and hands them to every step;
    prefill           the prompt's forward (prompt - 1 tokens) into a fresh cache of every slot (as `generate`
                      allocates it once), reading none of it, perturbed as ES rolls out: the members' factors
                      (`strategy.ask`'s) built into member tables, then the forward;
    tell              the ES strategy's `tell` (estimate and optimizer update of the donated masters and moments);
    update            GRPO's `make_update` on one microbatch of the trainer's rows, the completions scored at once
                      (microbatches 1, logprob_chunk 0: memory knobs, the same arithmetic per row), so that no loop
                      but the layer scans is left in the program; the trainer's update of a minibatch sums
                      `microbatches` such gradients before its one optimizer step. Where a chip cannot hold that
                      program (the compiler refuses it), it is compiled at r and r/2 rows, r the trainer's halved
                      until it fits, and extrapolated linearly in the rows (`_update_program`).

The layouts of what stays on the chip across `generate`'s decode loop (weights, cache, factors) and of the cache the
prefill hands to it are the compiler's choice (`Layout.AUTO`), as inside that loop: with default entry layouts a
lone step would convert the whole cache on entry and exit. `tell` and the update run as their own programs in the
trainer and keep the default layouts.

A while loop's body is counted once by the cost model, whatever its trip count. Hence one program per step above,
and the layer scan (`lax.scan` over the stacked layers, `parallel.scan_unroll` layers per iteration: 1 in these
configs) is resolved by compiling each program at three depths, 0, d and L layers (d = 4; 3 and 4 for a model of
at most 4 layers; at 2 the compiler keeps the small stacks in on-chip memory, a different program): the model is
cost(depth) = a + b·depth + c·[depth > 0] (a: what runs once, b·depth: what runs once but grows with depth, such
as the optimizer over the layers' leaves, c: one iteration of the layer loop), and the figure reported is
a + b·L + c·L. `tell` has no loop and is compiled once. The cost model gives -1 s to each ConcatBitcast (buffers
joined in place) in the entry and in loop bodies; those are added back (`uncosted_ops`). `valid` marks a figure
whose programs kept no loop but the layer scan, one layer per iteration, and no negative time.

Rows and shapes: the real configs (configs/gsm8k_qwen3.py: model axis, population, prompts per step, GRPO's group
size and microbatches) at the rows per device the planner chose (docs/plans/*_v5e-*.json), prompt 256 and 512 new
tokens as the plans use. Cases: Qwen3-0.6B on v5e:2x2 and Qwen3-8B on v5e:8x8; --quick: a Qwen3 of 2 layers,
narrowed (hidden 256, vocabulary 1024, untied head), on v5e:2x2 (mesh 2 x 2) with a few rows, short prompts
and a small population.

Against the roofline of a v5e chip (819e9 B/s HBM, 197e12 bf16 FLOP/s): roofline_s = max(must_move_bytes / 819e9,
flops / 197e12), flops the program's own (as above), and `roofline_ratio` = optimal_seconds / roofline_s. The bytes
that must move, per device (each tensor's shard as its sharding gives it):

    decode     the weights the step reads (layers, final norm, the head: the embedding when tied, else lm_head; the
               embedding rows gathered are left out), the KV cache read (every slot), and, perturbed, the factors of
               the distinct members among the device's rows (rows are member-major, prompts x samples per member);
    prefill    the layers' weights (the head's logits are unused) and the cache written, plus those factors;
    tell       the perturbed leaves' masters and their optimizer moments, each read once and written once;
    update     the masters and moments, read and written, and the gradient (the masters' size), written and read.

The cost model gives a plain large bfloat16 matrix product only about a fifth of the peak's FLOP/s, so a
compute-bound program is also judged against what the model can give at all: its **calibration program**, only the
must-do work of that program at the same shapes and shardings, compiled and resolved through the layers the same
way, and `over_calibration` = optimal_seconds / the calibration's optimal_seconds (the goal: <= 1.3):

    prefill    the prompt's embedding rows, each layer's weight products (q, k, v, o, gate, up, down) and attention
               contractions (q·kᵀ, then its product with v) over the prompt - 1 tokens, the keys and values written
               out; no norm, rotary, softmax, mask, perturbation or cache allocation;
    tell       each perturbed leaf's estimate Σ_k w_k A_k B_kᵀ / √r from the directions' factors (given as arguments,
               not regenerated) and the trainer's optimizer applied to the donated masters and moments;
    update     the masters cast and gathered layer by layer as the update does, the same products and contractions
               over prompt + completion, the head over the completion tokens and their log-softmax at the tokens
               weighted by the advantages, its gradient (no rematerialisation) and the optimizer's update; at the
               update's rows, halved and extrapolated as the update is where it does not fit.

Per decode step also `bytes_over_weights_kv` = bytes accessed / (weights + KV cache read), and per case
`perturbed_over_plain` = plain optimal_seconds / perturbed optimal_seconds (the goal: >= 0.95; EGGROLL's anchor is
0.91 of inference on an H100). `BENCHMARKS` for `experiments.bench`: the headline `tpu_cost` is the smallest
perturbed_over_plain over the cases run.

`--breakdown PROGRAM` says where a program's layer body spends its bytes: the instructions of the layer scan's body
(compiled at the model's depth), each with the bytes it reads and writes by the convention of XLA's cost analysis
(a slice of a layer-stacked operand counts as the slice; an in-place update as its update), largest first, beside
the cost model's own layer-body figure. A copy of a layer's keys and values or weights before a product shows as a
`dynamic-slice` fusion of that size.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import math
import os
import re
import time
from pathlib import Path

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import optax
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding, PartitionSpec

from esroll import es, grpo, parallel, sharding
from esroll.es import method as es_method
from esroll.config import from_config_dict, make_optimizer
from esroll.models import (
    STACKED,
    KVCache,
    Perturbation,
    forward,
    init_cache,
    member_slots,
    model_config,
    most_members,
    param_shapes,
)
from esroll.sampling_layout import _constrain_tables

REPO = Path(__file__).resolve().parents[2]
HBM_BYTES_PER_S = 819e9  # TPU v5e
PEAK_FLOPS = 197e12  # TPU v5e, bfloat16
PROMPT = 256  # prompt tokens, as the plans use (new tokens: the config's train.max_new_tokens)
FIELDS = ("flops", "bytes_accessed", "optimal_seconds")
PROGRAMS = ("decode_plain", "decode_perturbed", "prefill", "tell", "update")
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


def _device_bytes(tree) -> int:
    """Bytes one device holds of `tree` (ShapeDtypeStructs with shardings)."""
    return sum(
        math.prod(x.sharding.shard_shape(tuple(x.shape))) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)
    )


def _sds(shape, dtype, mesh, *spec):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=NamedSharding(mesh, PartitionSpec(*spec)))


def _shardings(tree):
    return jax.tree.map(lambda x: x.sharding, tree)


def _auto(tree):
    """The shardings of `tree`'s leaves with their layouts left to the compiler."""
    return jax.tree.map(lambda x: Format(Layout.AUTO, x.sharding), tree)


def _abstract(model_cfg, dtype, shardings_of):
    shapes = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, jnp.dtype(dtype)),
        param_shapes(model_cfg),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings_of(shapes))


def _computations(hlo: str) -> dict[str, list[str]]:
    """An optimized HLO module's computations by name, each its instruction lines."""
    out, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{$", line)
        if head:
            name = head.group(1)
            out[name] = []
        elif line.startswith("}"):
            name = None
        elif name and " = " in line:
            out[name].append(line.strip())
    return out


def _loops(hlo: str) -> list[tuple[str, int]]:
    """(body computation, trip count) of every while loop of an optimized HLO module (trip count -1 where its
    condition is not `i < constant`)."""
    computations = _computations(hlo)
    loops = []
    for condition, body in re.findall(r"\bwhile\(.*?condition=%?([\w.\-]+), body=%?([\w.\-]+)", hlo):
        text = "\n".join(computations.get(condition, []))
        found = re.search(r"constant\((\d+)\)", text)
        loops.append((body, int(found.group(1)) if found and "direction=LT" in text else -1))
    return loops


def _trip_counts(hlo: str) -> list[int]:
    """The trip count of every while loop of an optimized HLO module (-1 where its condition is not `i < constant`)."""
    return [trip for _, trip in _loops(hlo)]


def _uncosted(hlo: str) -> int:
    """ConcatBitcast custom calls (buffers joined in place, no data moved) in the computations whose cost the model
    sums, the entry and the while bodies: it gives each -1 s (conditional branches' are not summed)."""
    bodies = set(re.findall(r"\bwhile\(.*?body=%?([\w.\-]+)", hlo))
    count, current = 0, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) \(", line)
        if head:
            current = "ENTRY" if head.group(1) else head.group(2)
        elif 'custom_call_target="ConcatBitcast"' in line and (current == "ENTRY" or current in bodies):
            count += 1
    return count


def _cost(lowered) -> dict:
    """The cost model's figures of the compiled program (absent keys: 0), the trip counts of its while loops and its
    compile time."""
    t0 = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - t0
    ca = compiled.cost_analysis()
    ca = (ca[0] if ca else {}) if isinstance(ca, (list, tuple)) else (ca or {})
    hlo = compiled.as_text()
    raw, uncosted = float(ca.get("optimal_seconds", 0.0)), _uncosted(hlo)
    return {
        "flops": float(ca.get("flops", 0.0)),
        "bytes_accessed": float(ca.get("bytes accessed", 0.0)),
        "optimal_seconds": raw + uncosted,
        "optimal_seconds_raw": raw,
        "uncosted_ops": uncosted,
        "trip_counts": _trip_counts(hlo),
        "compile_s": round(seconds, 1),
    }


def _depths(layers: int) -> tuple[int, int, int]:
    return (0, 3, 4) if layers <= 4 else (0, 4, layers)


def _through_layers(lower, layers: int, known: dict | None = None) -> dict:
    """`lower(depth)` compiled at `_depths(layers)` (but for the depths `known` already holds the cost of) and
    resolved to `layers` layers (the module docstring); `counted` keeps each depth's own figures. `valid`: every loop
    left is a layer scan of one layer per iteration (trip count = depth, none at depth 0) and every optimal_seconds
    is non-negative (the cost model gives -1 s for an op it cannot cost)."""
    depths = _depths(layers)
    costs = {d: (known or {}).get(d) or _cost(lower(d)) for d in depths}
    d0, d1, d2 = depths
    out = {}
    for f in FIELDS:
        a = costs[d0][f]
        b = (costs[d2][f] - costs[d1][f]) / (d2 - d1)
        c = costs[d1][f] - a - b * d1
        out[f] = a + b * layers + c * layers
        out[f"{f}_once"], out[f"{f}_per_layer_outside_loop"], out[f"{f}_layer_body"] = a, b, c
    out["counted"] = costs
    out["trip_counts"] = {d: costs[d]["trip_counts"] for d in depths}
    out["valid"] = all(
        all(n == d for n in costs[d]["trip_counts"]) and (d == 0) == (not costs[d]["trip_counts"]) for d in depths
    ) and all(costs[d]["optimal_seconds"] >= 0 for d in depths)
    out["compile_s"] = sum(costs[d]["compile_s"] for d in depths)
    return out


def _once(lowered) -> dict:
    """A program without loops, compiled once; `valid` as in `_through_layers`."""
    out = _cost(lowered)
    out["valid"] = not out["trip_counts"] and out["optimal_seconds"] >= 0
    return out


def _roofline(program: dict, must_move: int, **parts) -> dict:
    roofline = max(must_move / HBM_BYTES_PER_S, program["flops"] / PEAK_FLOPS)
    return {
        **program,
        "must_move_bytes": must_move,
        **{f"must_move_{k}_bytes": v for k, v in parts.items()},
        "roofline_s": roofline,
        "roofline_ratio": program["optimal_seconds"] / roofline,
    }


class _Target:
    """One case's mesh, configs, row counts and shapes."""

    def __init__(self, case: Case):
        from esroll.plan import topology_mesh

        self.case = case
        self.cfg = _config(case)
        self.grpo_cfg = _config(case, "grpo")
        self.model_cfg = dataclasses.replace(model_config(case.preset, case.layers), **dict(case.widths))
        self.mesh, _ = topology_mesh(case.topology, self.cfg.parallel.model)
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
        return _abstract(model_cfg, self.dtype, lambda s: sharding.compute_shardings(self.mesh, s))

    def masters(self, model_cfg, dtype):
        return _abstract(model_cfg, dtype, lambda s: sharding.master_shardings(self.mesh, s))

    @functools.cached_property
    def strategy(self):
        return es_method.compiled_strategy(es_method.strategy_config(self.cfg.es_config), self.cfg.optimizer, self.mesh)

    def es_state(self, masters):
        es_cfg = self.cfg.es_config
        shardings = es_method.state_shardings(es_cfg, self.cfg.optimizer, self.mesh, masters)
        state = jax.eval_shape(self.strategy.init, masters, self.key)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)

    def member_deltas(self, model_cfg, compute):
        masters = self.masters(model_cfg, self.cfg.model.master_dtype)
        deltas = jax.eval_shape(self.strategy.ask, self.es_state(masters), compute)
        shardings = sharding.delta_shardings(self.mesh, deltas, compute)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), deltas, shardings)

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
            _sds(kv, self.dtype, self.mesh, *specs.k),
            _sds(kv, self.dtype, self.mesh, *specs.v),
            _sds((self.rows, slots), bool, self.mesh, *specs.valid_BxS),
            _sds((), jnp.int32, self.mesh),
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
        member_B = _sds((self.rows,), jnp.int32, self.mesh, DATA)
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
            return _sds(shape, x.dtype, self.mesh, *spec)

        def row(path, x):  # no fewer members than rows: each row's factors (`Perturbation.per_row`)
            axis = int(path[0].key == STACKED)
            shape = (*x.shape[:axis], self.rows, *x.shape[axis + 1 :])
            spec = list(x.sharding.spec) + [None] * (len(shape) - len(x.sharding.spec))
            spec[axis] = DATA
            return _sds(shape, x.dtype, self.mesh, *spec)

        if not self.member_slots:
            return Perturbation(jax.tree_util.tree_map_with_path(row, perturb.deltas), None)
        slot_B = _sds((self.rows,), jnp.int32, self.mesh, DATA)
        return Perturbation(jax.tree_util.tree_map_with_path(table, perturb.deltas), None, slot_B)

    def lower_decode(self, depth: int, perturbed: bool):
        cfg = self.at_depth(depth)
        params = self.compute(cfg)
        cache = self.abstract_cache(cfg, self.slots)
        token = _sds((self.rows,), jnp.int32, self.mesh, DATA)
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
        return tables._replace(deltas=_constrain_tables(tables.deltas, self.mesh, DATA))

    def lower_prefill(self, depth: int):
        cfg = self.at_depth(depth)
        params = self.compute(cfg)
        prompt = _sds((self.rows, self.case.prompt), jnp.int32, self.mesh, DATA)
        mask = _sds((self.rows, self.case.prompt), bool, self.mesh, DATA)
        perturb = self.perturbation(cfg, params)
        unroll = self.cfg.parallel.scan_unroll

        def prefill(params, prompt_BxP, mask_BxP, perturb):
            B, P = prompt_BxP.shape
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
            in_shardings=(_shardings(params), prompt.sharding, mask.sharding, _shardings(perturb)),
            out_shardings=cache_formats,
        ).lower(params, prompt, mask, perturb)

    def lower_tell(self):
        masters = self.masters(self.model_cfg, self.cfg.model.master_dtype)
        state = self.es_state(masters)
        fitness = _sds((self.members,), jnp.float32, self.mesh)
        return self.strategy.tell.lower(masters, state, fitness), masters, state

    def update_rows(self) -> int:
        g, train = self.grpo_cfg.grpo, self.grpo_cfg.train
        b = train.prompts_per_step * g.group_size // (g.minibatches * g.microbatches)
        return b + -b % self.data

    def update_settings(self):
        """GRPO's settings for one microbatch scored at once (see the module docstring)."""
        return dataclasses.replace(self.grpo_cfg.grpo, microbatches=1, logprob_chunk=0)

    def grpo_state(self, model_cfg):
        """GRPO's masters and state (optimizer moments; no reference policy at beta 0), with their shardings."""
        c, g = self.grpo_cfg, self.update_settings()
        masters = self.masters(model_cfg, c.model.master_dtype)
        state = jax.eval_shape(functools.partial(grpo.init_state, g, make_optimizer(c.optimizer)), masters)
        shardings = grpo.state_shardings(g, c.optimizer, self.mesh, masters)
        return masters, jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)

    def lower_update(self, depth: int, rows: int):
        c, g = self.grpo_cfg, self.update_settings()
        cfg = self.at_depth(depth)
        masters, state = self.grpo_state(cfg)
        b, P, N = rows, self.case.prompt, c.train.max_new_tokens
        batch = grpo.Rollouts.abstract(1, b, P, N, NamedSharding(self.mesh, PartitionSpec(None, DATA)))
        on_policy = _sds((), bool, self.mesh)
        update = grpo.make_update(cfg, grpo.update_config(g), c.optimizer, self.mesh, c.model.dtype)
        return update.lower(masters, state, batch, on_policy)

    # ---- calibration programs: only the must-do work of a program, at its shapes and shardings

    def _bare_layers(self, cfg, x_BxTxD, layers, layer_params=lambda w: w):
        """The layers' weight products and attention contractions on activations x, nothing else (no norm, rotary,
        softmax, mask or bias): per layer q, k, v = x·W_q, x·W_k, x·W_v; s = q·kᵀ (float32), o = s·v; x += o·W_o;
        x += (x·W_gate ⊙ x·W_up)·W_down. A `lax.scan` over the stacked layers as `forward` runs them. Returns the
        activations and each layer's keys and values [L, B, T, K, H] (what a prefill writes into the cache)."""
        c = self.model_cfg
        K, G, H = c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim
        rows = PartitionSpec(DATA) if self.tensor_parallel else PartitionSpec()

        def keep(x):  # activations stay split over the rows, as the model's are
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, rows)) if self.tensor_parallel else x

        def layer(x, w):
            w = layer_params(w)
            B, T, _ = x.shape
            q = (x @ w["q"]).reshape(B, T, K, G, H)
            k = (x @ w["k"]).reshape(B, T, K, H)
            v = (x @ w["v"]).reshape(B, T, K, H)
            s = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32).astype(x.dtype)
            o = jnp.einsum("bkgts,bskh->btkgh", s, v).reshape(B, T, K * G * H)
            x = keep(x + o @ w["o"])
            x = keep(x + ((x @ w["gate"]) * (x @ w["up"])) @ w["down"])
            return x, (k, v)

        weights = {n: layers[n] for n in ("q", "k", "v", "o", "gate", "up", "down")}
        return jax.lax.scan(layer, keep(x_BxTxD), weights, unroll=self.cfg.parallel.scan_unroll)

    def lower_prefill_calibration(self, depth: int):
        """The prefill's must-do work: the prompt's embedding rows, every layer's weight products and attention
        contractions over the prompt - 1 tokens, and the keys and values written out (as many bytes as the cache
        slots the prefill fills). No cache allocated beyond them, no perturbation, no norm or softmax."""
        cfg = self.at_depth(depth)
        params = self.compute(cfg)
        prompt = _sds((self.rows, self.case.prompt), jnp.int32, self.mesh, DATA)

        def prefill(params, prompt_BxP):
            x = params["embed"][prompt_BxP[:, :-1]]
            _, (k, v) = self._bare_layers(cfg, x, params[STACKED])
            return k, v

        kv = PartitionSpec(None, DATA)
        run = self.per_device(prefill, (PartitionSpec(), PartitionSpec(DATA)), (kv, kv))
        out = NamedSharding(self.mesh, kv)
        return jax.jit(run, in_shardings=(_shardings(params), prompt.sharding), out_shardings=(out, out)).lower(
            params, prompt
        )

    def lower_tell_calibration(self):
        """`tell`'s must-do work: each perturbed leaf's estimate Σ_k w_k A_k B_kᵀ / √r from the directions' factors
        (given, split as the master leaf is: the noise's regeneration is left out) and the optimizer's update of the
        donated masters and moments with the trainer's optimizer (optax), each read and written once."""
        es_cfg = self.cfg.es_config
        masters = self.masters(self.model_cfg, self.cfg.model.master_dtype)
        state = self.es_state(masters)
        train = es.trainable(es_cfg, masters)
        directions, rank = es_cfg.num_directions, es_cfg.rank
        optimizer = make_optimizer(self.cfg.optimizer)

        def factor(x, side):  # [L, E, n, r] (stacked) or [E, n, r]: n the master's in (side 0) or out (1) axis
            spec = list(x.sharding.spec) + [None] * (x.ndim - len(x.sharding.spec))
            lead, n = spec[:-2], spec[x.ndim - 2 + side]
            shape = (*x.shape[:-2], directions, x.shape[x.ndim - 2 + side], rank)
            return _sds(shape, jnp.float32, self.mesh, *lead, None, n, None)

        a = jax.tree.map(lambda x: factor(x, 0), train)
        b = jax.tree.map(lambda x: factor(x, 1), train)
        w = _sds((directions,), jnp.float32, self.mesh)
        splits = _shardings(train)

        def tell(train, opt_state, a, b, w_E):
            def estimate(a, b, x, split):
                spec = "...eir,...eor->...io"
                g = jnp.einsum(spec, a * (w_E[:, None, None] / math.sqrt(rank)), b)
                return jax.lax.with_sharding_constraint(g.astype(x.dtype), split)

            grad = jax.tree.map(estimate, a, b, train, splits)
            updates, opt_state = optimizer.update(jax.tree.map(jnp.negative, grad), opt_state, train)
            return optax.apply_updates(train, updates), opt_state

        return jax.jit(
            tell, donate_argnums=(0, 1), out_shardings=(_shardings(train), _shardings(state.opt_state))
        ).lower(train, state.opt_state, a, b, w)

    def lower_update_calibration(self, depth: int, rows: int):
        """The GRPO update's must-do work on `rows` rows of prompt + completion: the masters cast to the compute
        dtype and gathered layer by layer as the update does, the forward's weight products and attention
        contractions (`_bare_layers`) and the head over the completion tokens, their log-softmax at the tokens
        weighted by the advantages, its gradient (`jax.grad`: the backward's products, no rematerialisation), and
        the optimizer's update of the masters and moments (read and written once)."""
        c = self.grpo_cfg
        cfg = self.at_depth(depth)
        masters, state = self.grpo_state(cfg)
        P, N = self.case.prompt, c.train.max_new_tokens
        tokens = _sds((rows, P + N), jnp.int32, self.mesh, DATA)
        advantage = _sds((rows,), jnp.float32, self.mesh, DATA)
        optimizer = make_optimizer(c.optimizer)
        mesh, dtype = self.mesh, jnp.dtype(c.model.dtype)

        def gather_layer(w):
            w = jax.lax.with_sharding_constraint(w, sharding.master_shardings(mesh, w, layer=True))
            return jax.lax.with_sharding_constraint(w, sharding.compute_shardings(mesh, w, layer=True))

        def loss(masters, tokens_BxS, advantage_B):
            p = jax.tree.map(lambda x: x.astype(dtype), masters)
            top = {k: v for k, v in p.items() if k != STACKED}
            top = jax.lax.with_sharding_constraint(top, sharding.compute_shardings(mesh, top))
            x = top["embed"][tokens_BxS[:, :-1]]
            x, _ = self._bare_layers(cfg, x, p[STACKED], gather_layer)
            head = top["embed"].T if cfg.tie_word_embeddings else top["lm_head"]
            logits = jnp.einsum("bnd,dv->bnv", x[:, P - 1 :], head, preferred_element_type=jnp.float32)
            chosen = jnp.take_along_axis(logits, tokens_BxS[:, P:, None], axis=-1)[..., 0]
            logp = chosen - jax.nn.logsumexp(logits, axis=-1)
            return -(logp * advantage_B[:, None]).sum()

        def update(masters, opt_state, tokens_BxS, advantage_B):
            grads = jax.grad(loss)(masters, tokens_BxS, advantage_B)
            grads = jax.lax.with_sharding_constraint(grads, sharding.master_shardings(mesh, grads))
            updates, opt_state = optimizer.update(grads, opt_state, masters)
            return optax.apply_updates(masters, updates), opt_state

        return jax.jit(update, out_shardings=(_shardings(masters), _shardings(state.opt_state))).lower(
            masters, state.opt_state, tokens, advantage
        )

    # ---- bytes that must move

    def decode_weights_bytes(self) -> int:
        params = self.compute(self.model_cfg)
        head = "embed" if self.model_cfg.tie_word_embeddings else "lm_head"
        return _device_bytes([params[STACKED], params["final_norm"], params[head]])

    def layer_weights_bytes(self) -> int:
        return _device_bytes(self.compute(self.model_cfg)[STACKED])

    def factor_bytes(self) -> int:
        """The factors of the distinct members among one device's rows."""
        compute = self.compute(self.model_cfg)
        per_member = _device_bytes(self.member_deltas(self.model_cfg, compute)) / self.members
        return int(per_member * self.members_per_device())

    def cache_bytes(self, slots: int) -> int:
        cache = self.abstract_cache(self.model_cfg, slots)
        return _device_bytes([cache.k, cache.v])


def _update_program(t: _Target, layers: int, log, lower=None) -> dict:
    """The update's figures at the trainer's microbatch rows b (`lower(depth, rows)`: `t.lower_update` by default,
    or its calibration). When b rows do not fit a chip unchunked (the TPU compiler refuses the program), the rows are
    halved until they do, r, and the figures are extrapolated linearly in the rows from r and r/2 to b (a
    microbatch's work is linear in its rows; the optimizer step is constant). The depth components (`*_once`,
    `*_layer_body`, ...) and `counted` are then those of r rows, `counted_half_rows` those of r/2."""
    lower = lower or t.lower_update
    b = rows = t.update_rows()
    while True:
        try:
            full = _cost(lower(layers, rows))
            break
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e) or rows // 2 % t.data or rows < 2 * t.data:
                raise
            log(f"  update: {rows} rows do not fit unchunked ({str(e).splitlines()[0][:120]}); halving", flush=True)
            rows //= 2
    program = _through_layers(lambda d: lower(d, rows), layers, known={layers: full})
    program["rows_compiled"] = [rows]
    if rows == b:
        return program
    half = _through_layers(lambda d: lower(d, rows // 2), layers)
    for f in FIELDS:
        program[f] = program[f] + (b - rows) * (program[f] - half[f]) / (rows - rows // 2)
    program["rows_compiled"] = [rows, rows // 2]
    program["counted_half_rows"] = half["counted"]
    program["valid"] = program["valid"] and half["valid"]
    program["compile_s"] += half["compile_s"]
    return program


def run_case(case: Case, log=print, programs_wanted=None) -> dict:
    """The figures of `case`'s programs (`programs_wanted`: the names to compile, None: all of PROGRAMS)."""
    t = _Target(case)
    c = t.model_cfg
    L = c.num_layers
    log(
        f"{case.name}: {case.preset} ({L} layers) on {case.topology}, mesh {dict(t.mesh.shape)}, "
        f"{t.rows_per_device} rows per device ({t.rows} per chunk), population {t.members}, "
        f"prompt {case.prompt} + {t.new_tokens} new",
        flush=True,
    )
    weights, layers = t.decode_weights_bytes(), t.layer_weights_bytes()
    kv, factors = t.cache_bytes(t.slots), t.factor_bytes()
    programs = {}

    wanted = set(programs_wanted or PROGRAMS)

    def record(name, program, must_move, calibration=None, **parts):
        if name not in wanted:
            return
        programs[name] = p = _roofline(program(), must_move, **parts)
        log(f"  {name}: {p['optimal_seconds'] * 1e3:.3f} ms, compiled in {p['compile_s']:.0f} s", flush=True)
        if calibration is not None:
            cal = calibration()
            p["calibration"] = {
                k: cal[k] for k in (*FIELDS, "valid", "compile_s", *(["rows_compiled"] * ("rows_compiled" in cal)))
            }
            p["over_calibration"] = p["optimal_seconds"] / cal["optimal_seconds"]
            log(
                f"  {name} calibration: {cal['optimal_seconds'] * 1e3:.3f} ms (program / calibration "
                f"{p['over_calibration']:.2f}), compiled in {cal['compile_s']:.0f} s",
                flush=True,
            )

    record(
        "decode_plain",
        lambda: _through_layers(lambda d: t.lower_decode(d, perturbed=False), L),
        weights + kv,
        weights=weights,
        kv_cache=kv,
    )
    record(
        "decode_perturbed",
        lambda: _through_layers(lambda d: t.lower_decode(d, perturbed=True), L),
        weights + kv + factors,
        weights=weights,
        kv_cache=kv,
        factors=factors,
    )
    written = t.cache_bytes(case.prompt - 1)
    record(
        "prefill",
        lambda: _through_layers(t.lower_prefill, L),
        layers + written + factors,
        calibration=lambda: _through_layers(t.lower_prefill_calibration, L),
        weights=layers,
        kv_cache_written=written,
        factors=factors,
    )
    if "tell" in wanted:
        lowered, masters, state = t.lower_tell()
        trained = _device_bytes(es.trainable(t.cfg.es_config, masters))
        moments = _device_bytes(state.opt_state)
        record(
            "tell",
            lambda: _once(lowered),
            2 * (trained + moments),
            calibration=lambda: _once(t.lower_tell_calibration()),
            masters=2 * trained,
            moments=2 * moments,
        )
    if "update" in wanted:
        masters, state = t.grpo_state(t.model_cfg)
        m, s = _device_bytes(masters), _device_bytes(state.opt_state)
        record(
            "update", lambda: _update_program(t, L, log), 2 * m + 2 * s + 2 * m,
            calibration=lambda: _update_program(t, L, log, t.lower_update_calibration), masters=2 * m,
            moments=2 * s, gradients=2 * m,
        )  # fmt: skip
    for name in ("decode_plain", "decode_perturbed"):
        if name in programs:
            programs[name]["bytes_over_weights_kv"] = programs[name]["bytes_accessed"] / (weights + kv)
    if "decode_perturbed" in programs:
        # What the perturbed step receives per device (its rows' member tables), beside the distinct members' it must
        # read.
        factor_arguments = _device_bytes(t.tables(t.perturbation(c, t.compute(c))))
        programs["decode_perturbed"]["factor_argument_bytes"] = factor_arguments
    ratio = None
    if "decode_plain" in programs and "decode_perturbed" in programs:
        ratio = programs["decode_plain"]["optimal_seconds"] / programs["decode_perturbed"]["optimal_seconds"]
    return {
        "topology": case.topology,
        "device_kind": getattr(t.mesh.devices.flat[0], "device_kind", ""),
        "mesh": dict(t.mesh.shape),
        "model": case.preset,
        "shapes": {
            "layers": c.num_layers,
            "hidden": c.hidden_size,
            "intermediate": c.intermediate_size,
            "heads": c.num_heads,
            "kv_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "vocab": c.vocab_size,
            "tied_embedding": c.tie_word_embeddings,
            "dtype": str(t.dtype),
            "master_dtype": t.cfg.model.master_dtype,
            "rows_per_device": t.rows_per_device,
            "rows": t.rows,
            "population": t.members,
            "rows_per_member": t.rows_per_member,
            "members_per_device": t.members_per_device(),
            "member_slots": t.member_slots,
            "rank": t.cfg.es.rank,
            "prompt": case.prompt,
            "new_tokens": t.new_tokens,
            "decode_cache_slots": t.slots,
            "update_rows": t.update_rows(),
            "update_completion_tokens": t.grpo_cfg.train.max_new_tokens,
            "grpo_microbatches_per_update": t.grpo_cfg.grpo.microbatches,
            "depths_compiled": list(_depths(c.num_layers)),
        },
        "programs": programs,
        "perturbed_over_plain": ratio,
    }


_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4}
_ITEMSIZE.update({"s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16})
_SHAPE = re.compile(r"\b(" + "|".join(_ITEMSIZE) + r")\[([\d,]*)\](\{[^}]*\})?")
_SKIP = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all", "partition-id", "replica-id"}


def _shapes_bytes(text: str) -> int:
    """Bytes of every array shape written in `text` (unpadded: dims × itemsize)."""
    return sum(math.prod(int(d) for d in dims.split(",") if d) * _ITEMSIZE[t] for t, dims, _ in _SHAPE.findall(text))


def _split_instruction(line: str):
    """(name, output shape text, opcode, operand text, attributes) of one HLO instruction line."""
    line = line.removeprefix("ROOT ")
    name, rest = line.split(" = ", 1)
    if rest.startswith("("):  # a tuple shape: up to its matching parenthesis
        depth = 0
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                break
        shape, rest = rest[: i + 1], rest[i + 2 :]
    else:
        shape, rest = rest.split(" ", 1)
    opcode, rest = rest.split("(", 1)
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            break
    return name.lstrip("%"), shape, opcode, rest[:i], rest[i + 1 :]


def _operands(text: str) -> list[str]:
    """The operand texts of an instruction (split at top-level commas)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1, "{": 1, "}": -1, "[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    if text[start:].strip():
        parts.append(text[start:].strip())
    return parts


def _fusion_bytes(lines: list[str], layers: int) -> tuple[int, list[str]]:
    """Bytes a fusion moves, by the convention of XLA's HloCostAnalysis: each operand read once, except one used
    only by dynamic-slices inside (the slices' bytes), a layer-stacked one (leading axis `layers`, read through a
    window of a matrix product: one layer's bytes) or the buffer of an in-place dynamic-update-slice (nothing); the
    output written, except an in-place dynamic-update-slice's (its update's bytes). Also the notable ops inside
    (dynamic-slice, dynamic-update-slice, transpose, copy, dot, convolution, gather, reduce)."""
    parsed = [_split_instruction(line) for line in lines]
    by_name = {p[0]: p for p in parsed}
    params = [name for name, _, opcode, _, _ in parsed if opcode == "parameter"]
    users = {name: [] for name in by_name}
    for name, _, opcode, args, _ in parsed:
        for j, operand in enumerate(_operands(args)):
            ref = operand.split()[-1].lstrip("%") if operand else ""
            if ref in users:
                users[ref].append((name, opcode, j))
    root = _split_instruction(next(line for line in lines if line.startswith("ROOT ")))
    roots = [root]
    if root[2] == "tuple":
        roots = [by_name[o.split()[-1].lstrip("%")] for o in _operands(root[3])]
    in_place = set()
    written = 0
    for r in roots:
        if r[2] == "dynamic-update-slice":
            ops = _operands(r[3])
            in_place.add(ops[0].split()[-1].lstrip("%"))
            written += _shapes_bytes(ops[1])
        else:
            written += _shapes_bytes(r[1])
    read = 0
    for name in params:
        uses = users[name]
        if name in in_place:
            continue
        if uses and all(op == "dynamic-slice" and j == 0 for _, op, j in uses):
            read += sum(_shapes_bytes(by_name[u][1]) for u, _, _ in uses)
        else:
            shape = _SHAPE.search(by_name[name][1])
            stacked = shape and layers > 1 and shape.group(2).split(",")[0] == str(layers)
            read += _shapes_bytes(by_name[name][1]) // (layers if stacked else 1)
    notable = sorted(
        {
            p[2]
            for p in parsed
            if p[2] in ("dynamic-slice", "dynamic-update-slice", "transpose", "copy", "dot", "convolution", "gather")
            or p[2].startswith("reduce")
        }
    )
    return read + written, notable


def breakdown(hlo: str) -> list[dict]:
    """The instructions of every while loop's body of an optimized HLO module, each with the bytes it moves (XLA's
    HloCostAnalysis convention: operands read and output written; see `_fusion_bytes`), largest first. What the
    layer body of a decode step spends its bytes on, instruction by instruction."""
    comps = _computations(hlo)
    rows = []
    for body, trip in _loops(hlo):
        parsed = [_split_instruction(line) for line in comps.get(body, [])]
        shapes = {p[0]: p[1] for p in parsed}  # operands are named, their shapes are their definitions'
        for name, shape, opcode, args, attrs in parsed:
            if opcode in _SKIP or opcode == "while":
                continue
            operands = [shapes.get(o.split()[-1].lstrip("%"), o) for o in _operands(args) if o]
            inside = []
            called = re.search(r"calls=%?([\w.\-]+)", attrs)
            if opcode == "fusion" and called and called.group(1) in comps:
                moved, inside = _fusion_bytes(comps[called.group(1)], trip)
                kind = re.search(r"kind=(\w+)", attrs)
                opcode = f"fusion:{kind.group(1) if kind else ''}"
            elif opcode == "dynamic-update-slice":
                moved = 2 * _shapes_bytes(operands[1])
            elif opcode == "dynamic-slice":
                moved = 2 * _shapes_bytes(shape)
            else:
                moved = sum(_shapes_bytes(o) for o in operands) + _shapes_bytes(shape)
            rows.append({"body": body, "name": name, "opcode": opcode, "bytes": moved, "shape": shape, "ops": inside})
    return sorted(rows, key=lambda r: -r["bytes"])


def breakdown_table(rows: list[dict], limit: int = 40) -> str:
    lines = [f"{'MB':>10}  {'opcode':<24}{'name':<36}output shape; ops inside"]
    for r in rows[:limit]:
        inside = f"; {','.join(r['ops'])}" if r["ops"] else ""
        lines.append(f"{r['bytes'] / 1e6:>10.2f}  {r['opcode']:<24}{r['name'][:35]:<36}{r['shape'][:90]}{inside}")
    lines.append(f"{sum(r['bytes'] for r in rows) / 1e6:>10.2f}  in all ({len(rows)} instructions)")
    return "\n".join(lines)


def layer_breakdown(case: Case, program: str, hlo_out: Path | None = None) -> str:
    """`breakdown_table` of `program`'s layer body at the model's depth, with the cost model's layer-body bytes (c in
    the module docstring's model, from the three depths) to check the attribution against."""
    t = _Target(case)
    lower = {
        "decode_plain": lambda d: t.lower_decode(d, perturbed=False),
        "decode_perturbed": lambda d: t.lower_decode(d, perturbed=True),
        "prefill": t.lower_prefill,
    }
    if program not in lower:
        raise ValueError(f"--breakdown: one of {', '.join(lower)}, not {program!r}")
    L = t.model_cfg.num_layers
    depth = _depths(L)[2]
    hlo = lower[program](depth).compile().as_text()
    if hlo_out:
        hlo_out.mkdir(parents=True, exist_ok=True)
        (hlo_out / f"{case.name}_{program}_depth{depth}.hlo.txt").write_text(hlo)
    body = _through_layers(lower[program], L)["bytes_accessed_layer_body"]
    head = (
        f"{case.name} {program}, depth {depth}, {t.rows_per_device} rows per chip: the layer body's instructions "
        f"(cost model's layer body: {body / 1e6:.2f} MB)"
    )
    return head + "\n" + breakdown_table(breakdown(hlo))


def table(results: dict) -> str:
    """One row per (case, program)."""
    head = (
        f"{'case':<6}{'program':<18}{'optimal ms':>11}{'roofline ms':>12}{'ratio':>7}{'GFLOP':>10}"
        f"{'GB accessed':>12}{'GB must move':>13}{'acc/(w+kv)':>11}{'/calib':>8}"
    )
    lines = [head]
    for name, r in results.items():
        for prog, p in r["programs"].items():
            extra = f"{p['bytes_over_weights_kv']:>11.3f}" if "bytes_over_weights_kv" in p else f"{'':>11}"
            calib = f"{p['over_calibration']:>8.2f}" if "over_calibration" in p else ""
            lines.append(
                f"{name:<6}{prog:<18}{p['optimal_seconds'] * 1e3:>11.3f}{p['roofline_s'] * 1e3:>12.3f}"
                f"{p['roofline_ratio']:>7.2f}{p['flops'] / 1e9:>10.1f}{p['bytes_accessed'] / 1e9:>12.3f}"
                f"{p['must_move_bytes'] / 1e9:>13.3f}{extra}{calib}"
            )
        if r["perturbed_over_plain"] is not None:
            lines.append(f"{name:<6}perturbed/plain decode (plain s / perturbed s): {r['perturbed_over_plain']:.3f}")
    return "\n".join(lines)


def _chosen(quick: bool, cases=None, rows_per_device: int = 0) -> list[Case]:
    """The cases named (QUICK for `quick`, all by default), at `rows_per_device` rows per chip when given."""
    chosen = [QUICK] if quick else [CASES[n] for n in (cases or list(CASES))]
    return [dataclasses.replace(c, rows_per_device=rows_per_device) if rows_per_device else c for c in chosen]


def measure(quick: bool, cases=None, log=print, programs=None, rows_per_device: int = 0) -> dict:
    """Every chosen case's figures (`programs`: the program names to compile, None: all; `rows_per_device`: rows
    per chip in place of the plan's, 0: the plan's)."""
    results = {case.name: run_case(case, log, programs) for case in _chosen(quick, cases, rows_per_device)}
    log(table(results), flush=True)
    ratios = [r["perturbed_over_plain"] for r in results.values() if r["perturbed_over_plain"] is not None]
    return {
        "tpu_cost": min(ratios) if ratios else None,
        "jax_version": jax.__version__,
        "hbm_bytes_per_s": HBM_BYTES_PER_S,
        "peak_flops": PEAK_FLOPS,
        "cases": results,
    }


def tpu_cost(args) -> dict:
    return measure(args.quick)


BENCHMARKS = {"tpu_cost": tpu_cost}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 layers at Qwen3-0.6B's widths, a few rows")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--programs", default=",".join(PROGRAMS), help=f"comma-separated, of {', '.join(PROGRAMS)}")
    parser.add_argument("--rows-per-device", type=int, default=0, help="rows per chip (default: the plan's)")
    parser.add_argument(
        "--breakdown",
        metavar="PROGRAM",
        help="print the bytes of each instruction of PROGRAM's layer body (decode_plain, decode_perturbed, prefill) "
        "at the model's depth for each case, beside the cost model's layer-body bytes, instead of the figures",
    )
    parser.add_argument("--hlo-out", type=Path, help="with --breakdown: write each compiled HLO text here")
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    programs = [p for p in args.programs.split(",") if p]
    unknown = sorted(set(programs) - set(PROGRAMS)) + sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown program or case: {', '.join(unknown)}")
    if args.breakdown:
        for case in _chosen(args.quick, cases, args.rows_per_device):
            print(layer_breakdown(case, args.breakdown, args.hlo_out), flush=True)
        return {}
    results = measure(args.quick, cases, programs=programs, rows_per_device=args.rows_per_device)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return results


if __name__ == "__main__":
    jax.config.update("jax_platforms", "cpu")  # compiled for the topology; keep JAX off any local accelerator
    main()
