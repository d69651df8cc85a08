"""Will a training step fit? Compile the programs a step runs, for real devices or for a TPU topology that is not
there (JAX's deviceless ahead-of-time compilation), and add up what each device holds.

A GRPO step (`plan_grpo`) runs the cast, `generate` (the step's completions, in chunks), the optimizer `update` of one
minibatch, and evaluation's `generate`. An ES step (`plan_es`) runs five programs: `cast` (master weights → the decoding copy), `ask` (this step's low-rank factors),
`generate` (one chunk of the population's rows, perturbed), `tell` (estimate and optimizer update of the masters,
donated), and held-out evaluation's `generate` (greedy, unperturbed). Each is compiled exactly as the trainer
runs it — from the same functions, shardings and settings, on the target's devices — and its per-device memory is read from the compiler (`memory_analysis`: arguments, outputs, temporaries,
aliased donations). Buffers that live through the step but are not a program's arguments (the masters and optimizer
state while decoding) are added to that program's figure; the step's peak is the largest sum.

Shapes: the model's from its config (a local config.json or `esroll.models.presets`), the step's from the experiment
config, the prompt length from the caller (the trainer knows it from the data: its one prompt bucket).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from esroll import grpo, memory, parallel, sharding
from esroll.es import method as es_method
from esroll.config import ExperimentConfig, make_optimizer
from esroll.models import ModelConfig, Perturbation, abstract_params, member_slots
from esroll.sampling import lower_generate

GiB = memory.GiB


@dataclasses.dataclass
class Program:
    name: str
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    other_resident_bytes: int  # live buffers that are not this program's arguments
    compile_s: float

    @property
    def peak_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.other_resident_bytes


@dataclasses.dataclass
class Plan:
    method: str
    platform: str
    mesh_shape: dict[str, int]
    device_kind: str
    device_memory_bytes: int | None
    prompt_len: int
    new_tokens: int
    rows_per_step: int
    rows_per_device: int  # per chunk
    chunks: int
    eval_rows_per_device: int
    resident: dict[str, int]  # bytes per device: masters, optimizer state, decoding copy
    programs: list[Program]

    @property
    def peak_bytes_per_device(self) -> int:
        return max(p.peak_bytes for p in self.programs)

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory_bytes is None else self.peak_bytes_per_device <= self.device_memory_bytes

    @property
    def peak_program(self) -> Program:
        return max(self.programs, key=lambda p: p.peak_bytes)

    def largest_buffer(self) -> tuple[str, int]:
        """The largest single term of the peak program's figure, named."""
        p = self.peak_program
        terms = {f"{p.name} temporaries": p.temp_bytes, f"{p.name} outputs": p.output_bytes}
        terms[f"{p.name} arguments"] = p.argument_bytes
        terms.update({f"resident {k}": v for k, v in self.resident.items()})
        name = max(terms, key=terms.get)
        return name, terms[name]

    def to_json(self) -> dict[str, Any]:
        return {
            **{k: v for k, v in dataclasses.asdict(self).items() if k != "programs"},
            "programs": [{**dataclasses.asdict(p), "peak_bytes": p.peak_bytes} for p in self.programs],
            "peak_bytes_per_device": self.peak_bytes_per_device,
            "fits": self.fits,
            "largest_buffer": self.largest_buffer()[0],
        }

    def refusal(self) -> str:
        """One line for a step that does not fit."""
        name, size = self.largest_buffer()
        return (
            f"the {self.method} step needs {self.peak_bytes_per_device / GiB:.1f} GiB per device in "
            f"'{self.peak_program.name}' but a {self.device_kind} has {self.device_memory_bytes / GiB:.1f} GiB; "
            f"largest: {name} {size / GiB:.1f} GiB (rows per device {self.rows_per_device}; lower "
            f"parallel.rows_per_device, raise parallel.model, or use more devices)"
        )


_OOM = re.compile(r"HLO temporaries \(([\d.]+)([KMGT])\)")


def _compile(name: str, lowered, other_resident: int) -> tuple[Program, Any]:
    """Compile and read the memory figures. A TPU compiler that finds the program cannot fit refuses to compile
    (RESOURCE_EXHAUSTED, naming the temporaries it needed): that figure is recorded, arguments and outputs as 0."""
    t0 = time.perf_counter()
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        found = _OOM.search(str(e))
        if "RESOURCE_EXHAUSTED" not in str(e) or not found:
            raise
        temp = float(found.group(1)) * 1024 ** "KMGT".index(found.group(2)) * 1024
        return Program(name, 0, 0, 0, int(temp), int(other_resident), round(time.perf_counter() - t0, 1)), None
    dt = time.perf_counter() - t0
    m = compiled.memory_analysis()
    program = Program(
        name,
        int(m.argument_size_in_bytes),
        int(m.output_size_in_bytes),
        int(m.alias_size_in_bytes),
        int(m.temp_size_in_bytes),
        int(other_resident),
        round(dt, 1),
    )
    return program, compiled


@dataclasses.dataclass
class _Target:
    """What both plans share: the config, the devices, and the decoding copy's abstract shards."""

    cfg: ExperimentConfig
    model_cfg: ModelConfig
    mesh: Mesh
    platform: str
    prompt_len: int
    eos_ids: tuple[int, ...]
    shrink: bool

    def __post_init__(self):
        self.device = self.mesh.devices.flat[0]
        self.limit = memory.device_memory_bytes(self.device)
        self.shapes = abstract_params(self.model_cfg)
        self.compute = sharding.decoding_copy(self.mesh, self.shapes, self.cfg.model.dtype)
        self.key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=parallel.replicated(self.mesh))
        self.data = parallel.data_size(self.mesh)

    def resident(self, params, state) -> dict[str, int]:
        """Bytes per device of the buffers that live through a step."""
        return memory.resident_bytes(params, state, self.compute)

    def auto_rows(self, rows: int, resident: dict[str, int]) -> int:
        """The trainer's first guess for a rollout of `rows` rows (`esroll.memory.rows_per_device`)."""
        return memory.rows_per_device(self.cfg, self.model_cfg, self.prompt_len, self.mesh, resident, rows)

    def lower_chunk(self, per_device: int, temperature: float, deltas=None, member_B=None):
        """`generate` on one chunk of `per_device` rows per device (perturbed with `deltas` when given, the step's
        rows those of members `member_B`: the member tables are as large as the trainer's, `member_slots`)."""
        chunk, rows = self.data * per_device, parallel.rows(self.mesh)
        prompt = jax.ShapeDtypeStruct((chunk, self.prompt_len), jnp.int32, sharding=rows)
        mask = jax.ShapeDtypeStruct((chunk, self.prompt_len), bool, sharding=rows)
        perturb, slots = None, None
        if deltas is not None:
            perturb = Perturbation(deltas, jax.ShapeDtypeStruct((chunk,), jnp.int32, sharding=rows))
            slots = member_slots(member_B, self.data, chunk)
        return lower_generate(
            self.model_cfg,
            self.compute,
            prompt,
            self.key,
            max_new_tokens=self.cfg.train.max_new_tokens,
            temperature=temperature,
            eos_ids=self.eos_ids,
            prompt_mask=mask,
            perturb=perturb,
            phases=self.cfg.parallel.decode_phases,
            unroll=self.cfg.parallel.scan_unroll,
            member_slots=slots,
        )

    def fit_rows(self, name: str, per_device: int, temperature: float, beside: int, deltas=None, member_B=None):
        """Compile a chunk of `per_device` rows per device (its arguments hold the decoding copy; `beside` bytes
        live next to it); halve an automatic row count while the step does not fit. Returns (program, rows)."""
        auto = not self.cfg.parallel.rows_per_device
        while True:
            program, _ = _compile(name, self.lower_chunk(per_device, temperature, deltas, member_B), beside)
            if (
                not (self.shrink and auto and self.limit is not None and per_device > 1)
                or program.peak_bytes <= self.limit
            ):
                return program, per_device
            per_device = max(1, per_device // 2)

    def plan(self, rows: int, per_device: int, eval_per_device: int, resident, programs) -> Plan:
        return Plan(
            method=self.cfg.method,
            platform=self.platform,
            mesh_shape=dict(self.mesh.shape),
            device_kind=getattr(self.device, "device_kind", str(self.device)),
            device_memory_bytes=self.limit,
            prompt_len=self.prompt_len,
            new_tokens=self.cfg.train.max_new_tokens,
            rows_per_step=rows,
            rows_per_device=per_device,
            chunks=-(-rows // (self.data * per_device)),
            eval_rows_per_device=eval_per_device,
            resident=resident,
            programs=programs,
        )


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
    t = _Target(cfg, model_cfg, mesh, platform, prompt_len, eos_ids, shrink)
    es_cfg = cfg.es_config
    params = sharding.with_shardings(t.shapes, sharding.master_shardings(mesh, t.shapes), cfg.model.master_dtype)
    strategy = es_method.compiled_strategy(es_method.strategy_config(es_cfg), cfg.optimizer, mesh)
    state = sharding.with_shardings(
        jax.eval_shape(strategy.init, params, t.key), es_method.state_shardings(es_cfg, cfg.optimizer, mesh, params)
    )
    resident = t.resident(params, state)
    masters_and_state = resident["masters"] + resident["optimizer state"]
    deltas = jax.eval_shape(strategy.ask, state, t.compute)
    deltas = sharding.with_shardings(deltas, sharding.delta_shardings(mesh, deltas, t.compute))
    fitness = jax.ShapeDtypeStruct((cfg.es.population,), jnp.float32, sharding=parallel.replicated(mesh))
    programs = [
        _compile("cast", sharding.caster(mesh, cfg.model.dtype).lower(params), resident["optimizer state"])[0],
        _compile("ask", strategy.ask.lower(state, t.compute), masters_and_state)[0],
        _compile("tell", strategy.tell.lower(params, state, fitness), 0)[0],
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


def plan_grpo(
    cfg: ExperimentConfig,
    model_cfg: ModelConfig,
    mesh: Mesh,
    *,
    platform: str,
    prompt_len: int,
    eos_ids: tuple[int, ...] = (0,),
    shrink: bool = True,
) -> Plan:
    """Compile a GRPO step of `cfg` for `mesh` and measure it: the cast of the sharded masters to the decoding
    copy, sampling the step's X·G completions (`generate`, in chunks as for ES), one optimizer update on one minibatch
    (`esroll.grpo.make_update`: gradient accumulated over its microbatches), and evaluation's `generate`."""
    t = _Target(cfg, model_cfg, mesh, platform, prompt_len, eos_ids, shrink)
    g = cfg.grpo
    params = sharding.with_shardings(t.shapes, sharding.master_shardings(mesh, t.shapes), cfg.model.master_dtype)
    make_state = functools.partial(grpo.init_state, g, make_optimizer(cfg.optimizer))
    state = sharding.with_shardings(
        jax.eval_shape(make_state, params), grpo.state_shardings(g, cfg.optimizer, mesh, params)
    )
    resident = t.resident(params, state)
    masters_and_state = resident["masters"] + resident["optimizer state"]
    rows, N = grpo.method.rows_per_step(cfg), cfg.train.max_new_tokens

    # One minibatch of U microbatches of b rows, b padded to a multiple of the data axis (masked rows).
    U = g.microbatches
    b = rows // (g.minibatches * U)
    b += -b % t.data
    micro = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, parallel.DATA))
    batch = grpo.Rollouts.abstract(U, b, prompt_len, N, micro)
    on_policy = jax.ShapeDtypeStruct((), bool, sharding=parallel.replicated(mesh))
    update = grpo.make_update(model_cfg, grpo.update_config(g), cfg.optimizer, mesh, cfg.model.dtype)
    programs = [
        _compile("cast", sharding.caster(mesh, cfg.model.dtype).lower(params), resident["optimizer state"])[0],
        _compile("update", update.lower(params, state, batch, on_policy), 0)[0],
    ]
    gen, per_device = t.fit_rows("generate", t.auto_rows(rows, resident), g.temperature, masters_and_state)
    evaluation, eval_per_device = t.fit_rows(
        "evaluate", t.auto_rows(min(256, cfg.data.eval_size), resident), 0.0, masters_and_state
    )
    return t.plan(rows, per_device, eval_per_device, resident, [*programs, gen, evaluation])


def plan_step(cfg: ExperimentConfig, model_cfg: ModelConfig, mesh: Mesh, **kwargs) -> Plan:
    """The plan of `cfg.method`'s step (`esroll.methods.MethodSpec.plan`: `plan_es`, `plan_grpo`, ...)."""
    from esroll.methods import lookup  # the registry of methods imports this module's planners

    return lookup(cfg).plan(cfg, model_cfg, mesh, **kwargs)


def topology_mesh(name: str, model: int) -> tuple[Mesh, str]:
    """A ("data", "model") mesh over a TPU topology's devices (e.g. "v5e:8x8"), for deviceless compilation; and the
    platform to compile for. Needs libtpu (the `plan` extra)."""
    from jax.experimental import topologies

    # No chip is touched: let several planning processes load libtpu at once (it otherwise takes a host-wide lock),
    # and spare a host that is not a TPU VM libtpu's metadata-server probe and its screen of warnings.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    if importlib.util.find_spec("libtpu") is None:
        raise ValueError(
            f"--topology={name}: planning for a TPU needs libtpu, which is not installed: pip install -e '.[plan]'"
        )
    try:
        topo = topologies.get_topology_desc(topology_name=name, platform="tpu")
    except Exception as e:  # noqa: BLE001 — libtpu missing, unknown topology name
        raise ValueError(f"--topology={name}: cannot describe this TPU topology ({str(e).splitlines()[0]})") from None
    return parallel.make_mesh(model=model, devices=np.array(topo.devices).reshape(-1)), "tpu"
