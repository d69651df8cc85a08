"""Will a training step fit? Compile the programs a step runs, for real devices or for a TPU topology that is not
there (JAX's deviceless ahead-of-time compilation), and add up what each device holds.

This module knows no method: each method package plans its own step from the pieces here (`esroll.es.plan`,
`esroll.grpo.plan`; `esroll.methods.MethodSpec.plan`), as it builds its own step. A `Target` holds what every plan
shares (the config, the devices, the decoding copy's abstract shards, the chunked `generate`); `compile_program`
compiles one program and reads its memory; `Target.plan` gathers the programs into a `Plan`. Each program is compiled
exactly as the trainer runs it — from the same functions, shardings and settings, on the target's devices — and its
per-device memory is read from the compiler (`memory_analysis`: arguments, outputs, temporaries, aliased donations).
Buffers that live through the step but are not a program's arguments (the masters and optimizer state while decoding)
are added to that program's figure; the step's peak is the largest sum.

Shapes: the model's from its config (a local config.json or `esroll.models.presets`), the step's from the experiment
config, the prompt length from the caller (the trainer knows it from the data: its one prompt bucket).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from esroll import memory, parallel, sharding
from esroll.config import ExperimentConfig
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
    # A policy-gradient plan asked to choose (`esroll.grpo.plan.remat_options`): each remat policy's update, and the
    # cheapest that fits (None: none fits).
    remat: dict[str, dict] = dataclasses.field(default_factory=dict)
    remat_choice: str | None = None

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


def compile_program(name: str, lowered, other_resident: int) -> tuple[Program, Any]:
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
class Target:
    """What every method's plan shares: the config, the devices, the decoding copy's abstract shards (`compute`), the
    sharded abstract masters (`masters`), and `generate` on one chunk of rows (`lower_chunk`, `fit_rows`)."""

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

    def masters(self):
        """The master weights as the trainer holds them: abstract, in `model.master_dtype`, split over every device."""
        return sharding.master_copy(self.mesh, self.shapes, self.cfg.model.master_dtype)

    def cast(self, params, beside: int) -> Program:
        """The cast of the masters `params` to the decoding copy, compiled (`beside` bytes live next to it)."""
        return compile_program("cast", sharding.caster(self.mesh, self.cfg.model.dtype).lower(params), beside)[0]

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
            program, _ = compile_program(name, self.lower_chunk(per_device, temperature, deltas, member_B), beside)
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
