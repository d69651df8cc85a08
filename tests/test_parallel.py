"""esroll.parallel on the 8 fake CPU devices of conftest: meshes, placement round trips, device-count start-up.

The start-up helpers (`use_cpu_cores_as_devices`, `maybe_initialize_distributed`) are run against a stand-in for the
`jax` module they see, so they never reconfigure this process's backend; tests/test_train.py runs the real thing
in a subprocess (test_entry_scripts_use_one_cpu_device_per_core).
"""

from __future__ import annotations

import os
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from esroll import parallel

from conftest import REPO


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() == 8, "conftest asks XLA for 8 CPU devices"
    return parallel.make_mesh()


# ---------------------------------------------------------------- make_mesh


def test_make_mesh_spans_all_devices_by_default(mesh):
    assert mesh.axis_names == (parallel.AXIS, parallel.MODEL) == ("data", "model")
    assert dict(mesh.shape) == {"data": 8, "model": 1}
    assert list(mesh.devices.flat) == jax.devices()
    assert list(parallel.make_mesh(0).devices.flat) == jax.devices()


def test_make_mesh_takes_the_first_n_devices():
    assert list(parallel.make_mesh(3).devices.flat) == jax.devices()[:3]
    assert list(parallel.make_mesh(8).devices.flat) == jax.devices()


def test_make_mesh_model_axis_groups_consecutive_devices():
    mesh = parallel.make_mesh(8, model=2)
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    assert parallel.data_size(mesh) == 4 and parallel.model_size(mesh) == 2
    assert [d.id for d in mesh.devices[1]] == [jax.devices()[2].id, jax.devices()[3].id]
    with pytest.raises(ValueError, match=r"'parallel.model' = 3 must be >= 1 and divide the 8 devices"):
        parallel.make_mesh(8, model=3)


def test_make_mesh_refuses_more_devices_than_exist():
    with pytest.raises(ValueError, match=r"^--mesh_devices=9 but only 8 devices exist$"):
        parallel.make_mesh(9)


def test_shardings(mesh):
    assert parallel.rows(mesh).spec == PartitionSpec("data") and parallel.rows(mesh).mesh == mesh
    assert parallel.replicated(mesh).spec == PartitionSpec() and parallel.replicated(mesh).mesh == mesh


# ---------------------------------------------------------------- placement


@pytest.mark.parametrize("num_devices", [8, 4, 1])
def test_put_rows_splits_the_leading_axis(num_devices):
    mesh = parallel.make_mesh(num_devices)
    x = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    y = parallel.put_rows(mesh, x)
    chex.assert_shape(y, (16, 3))
    assert y.sharding == parallel.rows(mesh) and y.dtype == np.float32
    per_device = 16 // num_devices
    shards = sorted(y.addressable_shards, key=lambda s: s.index[0].start or 0)
    assert [s.device for s in shards] == jax.devices()[:num_devices]
    for i, shard in enumerate(shards):
        np.testing.assert_array_equal(shard.data, x[i * per_device : (i + 1) * per_device])
    np.testing.assert_array_equal(np.asarray(y), x)


def test_put_with_any_sharding(mesh):
    """`put` places a host array with the sharding given: here its second axis is split, 2 columns a device."""
    x = np.arange(3 * 16).reshape(3, 16)
    y = parallel.put(NamedSharding(mesh, PartitionSpec(None, "data")), x.tolist())  # any array-like
    assert y.sharding.spec == PartitionSpec(None, "data")
    for shard in y.addressable_shards:
        i = jax.devices().index(shard.device)
        np.testing.assert_array_equal(shard.data, x[:, 2 * i : 2 * i + 2])
    np.testing.assert_array_equal(np.asarray(y), x)


def test_put_replicated_copies_every_leaf_to_every_device(mesh):
    tree = {
        "host": np.arange(6, dtype=np.int32).reshape(2, 3),
        "scalar": np.float32(2.5),
        "device": jnp.ones((4,), jnp.bfloat16),
        "nested": [np.array([True, False])],
    }
    out = parallel.put_replicated(mesh, tree)
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    for leaf, ref in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
        assert leaf.sharding == parallel.replicated(mesh) and leaf.dtype == np.asarray(ref).dtype
        assert len(leaf.addressable_shards) == 8
        for shard in leaf.addressable_shards:
            np.testing.assert_array_equal(shard.data, ref)


def test_put_replicated_keeps_an_already_replicated_array(mesh):
    x = parallel.put_replicated(mesh, np.arange(5.0))
    assert parallel.put_replicated(mesh, x) is x
    other = parallel.put_replicated(parallel.make_mesh(2), np.arange(5.0))  # replicated, but on another mesh
    moved = parallel.put_replicated(mesh, other)
    assert moved.sharding == parallel.replicated(mesh)
    np.testing.assert_array_equal(moved, np.arange(5.0))


def test_put_replicated_typed_prng_key(mesh):
    key = jax.random.key(7)
    out = parallel.put_replicated(mesh, {"key": key})["key"]
    assert jax.dtypes.issubdtype(out.dtype, jax.dtypes.prng_key)
    assert jax.random.key_impl(out) == jax.random.key_impl(key)
    assert out.sharding == parallel.replicated(mesh)
    np.testing.assert_array_equal(jax.random.key_data(out), jax.random.key_data(key))
    np.testing.assert_array_equal(jax.random.normal(out, (3,)), jax.random.normal(key, (3,)))  # the same stream


# ---------------------------------------------------------------- local_rows and gather_to_all


@pytest.mark.parametrize("num_devices", [8, 3])
def test_local_rows_round_trip(num_devices):
    mesh = parallel.make_mesh(num_devices)
    x = np.random.default_rng(0).normal(size=(num_devices * 2, 4)).astype(np.float32)
    idx, vals = parallel.local_rows(parallel.put_rows(mesh, x))
    np.testing.assert_array_equal(idx, np.arange(len(x)))  # one process holds every row, in order
    chex.assert_trees_all_close(vals, x)
    np.testing.assert_array_equal(parallel.gather_to_all(vals, idx, len(x)), x)


def test_local_rows_of_a_computed_array_and_of_a_replicated_one(mesh):
    x = np.arange(24, dtype=np.float32).reshape(8, 3)
    doubled = jax.jit(lambda a: 2 * a, out_shardings=parallel.rows(mesh))(parallel.put_rows(mesh, x))
    idx, vals = parallel.local_rows(doubled)
    np.testing.assert_array_equal(idx, np.arange(8))
    np.testing.assert_array_equal(vals, 2 * x)
    idx, vals = parallel.local_rows(parallel.put_replicated(mesh, x))  # 8 copies of every row count once
    np.testing.assert_array_equal(idx, np.arange(8))
    np.testing.assert_array_equal(vals, x)


def test_gather_to_all_places_rows_and_zero_fills():
    local = np.array([[1, 2], [3, 4]], np.int64)
    full = parallel.gather_to_all(local, np.array([3, 0]), 5)
    np.testing.assert_array_equal(full, [[3, 4], [0, 0], [0, 0], [1, 2], [0, 0]])
    assert full.dtype == np.int64


def test_gather_to_all_sums_the_processes_disjoint_rows(monkeypatch):
    """Across processes each contributes its rows over zeros; the all-gather's sum is the whole array."""
    x = np.arange(12.0).reshape(6, 2)
    mine, theirs = np.array([0, 2, 4]), np.array([1, 3, 5])
    theirs_full = np.zeros_like(x)
    theirs_full[theirs] = x[theirs]
    gathered = []

    def allgather(full):
        gathered.append(full.copy())
        return np.stack([full, theirs_full])

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(parallel.multihost_utils, "process_allgather", allgather)
    np.testing.assert_array_equal(parallel.gather_to_all(x[mine], mine, 6), x)
    assert len(gathered) == 1
    np.testing.assert_array_equal(gathered[0][theirs], 0)


# ---------------------------------------------------------------- start-up


class FakeConfig:
    """Stands in for jax.config: records updates instead of reconfiguring this process's backend."""

    def __init__(self, num_cpu_devices=-1, platforms="cpu"):
        self.jax_num_cpu_devices, self.jax_platforms, self.updates = num_cpu_devices, platforms, []

    def update(self, name, value):
        self.updates.append((name, value))
        setattr(self, name, value)


@pytest.fixture
def fake_jax(monkeypatch):
    """parallel's view of `jax` replaced by a stand-in; the real jax.config must come out untouched."""
    before = jax.config.jax_num_cpu_devices
    fake = types.SimpleNamespace(config=FakeConfig())
    monkeypatch.setattr(parallel, "jax", fake)
    yield fake
    assert jax.config.jax_num_cpu_devices == before


@pytest.fixture
def no_device_count_flag(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")


def test_cpu_cores_leaves_an_explicit_device_count_alone(fake_jax, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=3")
    assert parallel.use_cpu_cores_as_devices() == -1
    assert fake_jax.config.updates == []


def test_cpu_cores_one_device_per_core_of_the_affinity_mask(fake_jax, no_device_count_flag, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # the machine's count, not this process's share
    assert parallel.use_cpu_cores_as_devices() == 3
    assert fake_jax.config.updates == [("jax_num_cpu_devices", 3)]


def test_cpu_cores_falls_back_to_cpu_count_without_affinity(fake_jax, no_device_count_flag, monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS and Windows have none
    monkeypatch.setattr(os, "cpu_count", lambda: 5)
    assert parallel.use_cpu_cores_as_devices() == 5
    assert fake_jax.config.updates == [("jax_num_cpu_devices", 5)]


def test_cpu_cores_falls_back_to_one_when_the_count_is_unknown(fake_jax, no_device_count_flag, monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert parallel.use_cpu_cores_as_devices() == 1
    assert fake_jax.config.updates == [("jax_num_cpu_devices", 1)]


def test_cpu_cores_keeps_a_count_already_configured(fake_jax, no_device_count_flag, monkeypatch):
    fake_jax.config.jax_num_cpu_devices = 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert parallel.use_cpu_cores_as_devices() == 4
    assert fake_jax.config.updates == []


def test_cpu_cores_one_device_for_a_large_model(fake_jax, no_device_count_flag, monkeypatch):
    """Above SMALL_MODEL_PARAMS the count is left to JAX (one CPU device); at or below it, one per core."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert parallel.use_cpu_cores_as_devices(model_params=parallel.SMALL_MODEL_PARAMS + 1) == -1
    assert fake_jax.config.updates == []
    assert parallel.use_cpu_cores_as_devices(model_params=parallel.SMALL_MODEL_PARAMS) == 2
    assert fake_jax.config.updates == [("jax_num_cpu_devices", 2)]


@pytest.mark.e2e
def test_entry_counts_the_parameters_of_a_local_model_folder(tmp_path):
    from experiments._entry import _model_params

    assert _model_params(str(REPO / "assets/tiny-qwen3-arith")) == 429_312
    assert _model_params(str(tmp_path / "missing")) == 0  # unknown: the run reports the missing folder itself
    assert _model_params("Qwen/Qwen3-0.6B") == 0


class FakeDistributed:
    def __init__(self, initialized=False):
        self.initialized, self.calls = initialized, []

    def is_initialized(self):
        return self.initialized

    def initialize(self, **kwargs):
        self.calls.append(kwargs)


def test_distributed_not_started_unless_asked(fake_jax, monkeypatch):
    fake_jax.distributed = FakeDistributed()
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    parallel.maybe_initialize_distributed(False)
    assert fake_jax.distributed.calls == [] and fake_jax.config.updates == []
    fake_jax.distributed.initialized = True  # asked, but already running
    parallel.maybe_initialize_distributed(True)
    assert fake_jax.distributed.calls == [] and fake_jax.config.updates == []


def test_distributed_from_the_environment_uses_gloo_on_cpu(fake_jax, monkeypatch):
    fake_jax.distributed = FakeDistributed()
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    parallel.maybe_initialize_distributed(False)
    assert fake_jax.config.updates == [("jax_cpu_collectives_implementation", "gloo")]
    assert fake_jax.distributed.calls == [{"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 2}]


def test_distributed_auto_detection_when_asked_without_a_coordinator(fake_jax, monkeypatch):
    fake_jax.distributed = FakeDistributed()
    fake_jax.config.jax_platforms = "tpu"
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    parallel.maybe_initialize_distributed(True)
    assert fake_jax.config.updates == []  # no gloo off CPU
    assert fake_jax.distributed.calls == [{}]


def test_trainer_device_count_follows_the_model_size_on_cpu():
    """On a CPU host the trainers (and the peer benchmarks, `_idtask.esroll_meshes`, which report esroll as its
    trainers would run) split small models over every device and keep one device for a model over
    SMALL_MODEL_PARAMS."""
    from experiments.benchmarks._idtask import esroll_meshes

    assert jax.default_backend() == "cpu" and jax.device_count() > 1
    small, large = parallel.SMALL_MODEL_PARAMS, parallel.SMALL_MODEL_PARAMS + 1
    assert parallel.trainer_device_count(small) == jax.device_count()
    assert parallel.trainer_device_count(large) == 1
    shapes = lambda n: {"w": jax.ShapeDtypeStruct((n,), jnp.float32)}  # noqa: E731
    big = esroll_meshes(shapes(large))
    assert {k: m.size for k, m in big.items()} == {"ours": 1, "ours_split": jax.device_count()}
    few = esroll_meshes(shapes(small))
    assert {k: m.size for k, m in few.items()} == {"ours": jax.device_count(), "ours_1device": 1}
