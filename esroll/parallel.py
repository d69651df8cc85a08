"""The mesh and the little multi-host plumbing the trainers need.

The mesh has two axes, "data" × "model", spanning every device of every process. The rows of a rollout (ES population
members × prompts, GRPO completions, held-out questions) are split over "data"; the parameters are split over "model"
(attention heads, MLP columns, vocabulary: tensor parallelism, see `esroll.sharding`), which is 1 unless a model does
not fit one device. Noise is regenerated from seeds on every device, so no
perturbation crosses devices or hosts; what does cross is each row's outcome (reward, length and, when the caller
asks, its completion tokens and log-probabilities), in one exchange per rollout (`esroll.rollout`), and for GRPO
the gradients.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from esroll.errors import InputError

DATA = "data"
MODEL = "model"
AXIS = DATA  # the axis rows are split over


def maybe_initialize_distributed(enabled: bool) -> None:
    """Start `jax.distributed` when asked by config or by the environment (JAX_COORDINATOR_ADDRESS and friends).

    On CPU the cross-process collectives use gloo.
    """
    if not (enabled or os.environ.get("JAX_COORDINATOR_ADDRESS")) or jax.distributed.is_initialized():
        return
    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    coordinator = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if coordinator:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
        )
    else:
        jax.distributed.initialize()  # cluster auto-detection (TPU pods, SLURM, ...)


SMALL_MODEL_PARAMS = 20_000_000  # above this, one CPU device (see use_cpu_cores_as_devices)


def use_cpu_cores_as_devices(model_params: int = 0) -> int:
    """Expose one XLA CPU device per core this process may run on, unless the device count is already set or the
    model is large.

    XLA runs one CPU device's decode step of a small model on about one and a half cores (its small GEMMs do not split
    well), so on a CPU host the trainers and benchmarks split rows over one device per core instead; `generate` then
    decodes each device's rows in its own loop (measured: 1.8 -> 2.1x transformers' speed on a 4-layer hidden-256
    model). A model of more than SMALL_MODEL_PARAMS parameters (`model_params`, 0 if unknown) keeps one device: its
    GEMMs fill every core, and each device would hold its own copy of the weights. Measured on 2 cores: with
    Qwen3-0.6B shapes in bfloat16, two devices made a steady ES step 1.3-1.7x slower and took 1.8x the peak memory;
    at the benchmarks' "mid" shape (hidden 1024, 2 layers, 34M parameters) greedy decoding of 64 rows ran 1.8-2.1x
    faster on one device than split over two, while at hidden 256 (5M) the split is 1.15x faster. Call before JAX
    initialises its backends (first thing in an entry script); it does not touch accelerators. Returns the count in
    effect (-1: left to JAX).
    """
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return -1
    if model_params > SMALL_MODEL_PARAMS:
        return jax.config.jax_num_cpu_devices
    if jax.config.jax_num_cpu_devices == -1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        jax.config.update("jax_num_cpu_devices", cores)
    return jax.config.jax_num_cpu_devices


def trainer_device_count(model_params: int) -> int:
    """The devices the trainers run a model of `model_params` parameters on in this process: on a CPU host one for a
    model over SMALL_MODEL_PARAMS (its entry script kept one device, `use_cpu_cores_as_devices`), else all of them."""
    if jax.default_backend() == "cpu" and model_params > SMALL_MODEL_PARAMS:
        return 1
    return jax.device_count()


def make_mesh(num_devices: int = 0, model: int = 1, devices=None) -> Mesh:
    """A ("data", "model") mesh over all devices (or the first `num_devices`; or `devices`, e.g. a deviceless TPU
    topology's), `model` devices along the model axis. Devices are laid out so that a model-axis group is
    consecutive in `jax.devices()` order: on one host (or one slice's nearest chips) where the tensor-parallel
    all-reduces of every layer are cheapest."""
    devices = list(jax.devices() if devices is None else devices)
    if num_devices:
        if num_devices > len(devices):
            raise InputError(f"--mesh_devices={num_devices} but only {len(devices)} devices exist")
        devices = devices[:num_devices]
    if model < 1 or len(devices) % model:
        raise InputError(f"config: 'parallel.model' = {model} must be >= 1 and divide the {len(devices)} devices")
    return Mesh(np.array(devices).reshape(len(devices) // model, model), (DATA, MODEL))


def data_size(mesh: Mesh) -> int:
    """Devices along the data axis: rows of a rollout are padded to a multiple of this."""
    return mesh.shape[DATA]


def padded_rows(rows: int, mesh: Mesh) -> int:
    """`rows` rounded up to a multiple of the data axis: what a batch split over it holds once masked rows (which
    add nothing to a loss, a gradient or a value) fill its last devices."""
    data = data_size(mesh)
    return -(-rows // data) * data


def model_size(mesh: Mesh) -> int:
    return mesh.shape.get(MODEL, 1)


def rows(mesh: Mesh) -> NamedSharding:
    """Leading axis split over the mesh."""
    return NamedSharding(mesh, PartitionSpec(AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def put(sharding: NamedSharding, x: np.ndarray) -> jax.Array:
    """A host array known to every process, placed with `sharding` (each device takes its slice)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def put_rows(mesh: Mesh, x: np.ndarray) -> jax.Array:
    """A host array known to every process, split along its leading axis over the mesh."""
    return put(rows(mesh), x)


def put_replicated(mesh: Mesh, tree):
    """Copies of a pytree on every device (every process must pass the same values)."""
    sharding = replicated(mesh)

    def place(x):
        if isinstance(x, jax.Array) and x.sharding == sharding:
            return x
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(place(jax.random.key_data(x)), impl=jax.random.key_impl(x))
        return put(sharding, x)

    return jax.tree.map(place, tree)


def replicate(mesh: Mesh, tree):
    """Copies of a pytree of device arrays (split any way over `mesh`) on every device, gathered on the devices (no
    round trip through a host, so it holds on several hosts)."""
    return jax.jit(lambda t: t, out_shardings=replicated(mesh))(tree)


def local_rows(x: jax.Array) -> tuple[np.ndarray, np.ndarray]:
    """(row indices, values) of the rows of a row-split array that live on this process."""
    shards = sorted({(s.index[0].start or 0, s.index[0].stop or x.shape[0]): s for s in x.addressable_shards}.items())
    idx = np.concatenate([np.arange(a, b) for (a, b), _ in shards])
    vals = np.concatenate([np.asarray(s.data) for _, s in shards])
    return idx, vals


def to_host(tree):
    """A pytree of global arrays as host numpy arrays on every process: a collective where an array is split across
    processes (every process must call it), a local copy otherwise."""

    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)


def broadcast_from_lead(values: tuple[int, ...]) -> tuple[int, ...]:
    """Process 0's values of a tuple of small ints, on every process."""
    if jax.process_count() == 1:
        return values
    return tuple(int(x) for x in multihost_utils.broadcast_one_to_all(np.asarray(values, np.int64)))


def gather_to_all(local: np.ndarray, idx: np.ndarray, total: int) -> np.ndarray:
    """Assemble a [total, ...] array from each process's disjoint (idx, values); every process gets all of it."""
    full = np.zeros((total,) + local.shape[1:], local.dtype)
    full[idx] = local
    return full if jax.process_count() == 1 else multihost_utils.process_allgather(full).sum(0)
