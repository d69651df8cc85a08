"""Workdir paths: local folders made absolute, URLs (gs://bucket/run) kept as they are, and a workdir on an object
store exercised end to end on an in-memory stand-in for gs:// (no network)."""

from __future__ import annotations

import importlib
import json
import os

import pytest
from etils import epath

from esroll.checkpoint import Checkpointer, check_workdir, claim_workdir, workdir_path
from esroll.errors import InputError
from esroll.metrics import MetricsWriter, plot_eval_curve, read_metrics


def test_workdir_path_keeps_a_url():
    p = workdir_path("gs://bucket/run")
    assert isinstance(p, epath.Path)
    assert str(p) == os.fspath(p) == "gs://bucket/run"
    assert str(p / "checkpoints") == "gs://bucket/run/checkpoints"
    assert str(workdir_path(p)) == "gs://bucket/run"  # idempotent
    assert str(workdir_path("s3://b/x/") / "tb") == "s3://b/x/tb"


def test_workdir_path_makes_a_local_path_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for given in ("run", "./run", tmp_path / "run", f"{tmp_path}/other/../run"):
        p = workdir_path(given)
        assert isinstance(p, epath.Path) and str(p) == str(tmp_path / "run"), given


def test_workdir_path_refuses_an_unknown_scheme():
    with pytest.raises(InputError, match="memory://x: unsupported URL scheme"):
        workdir_path("memory://x")


def test_checkpointer_hands_orbax_the_url_unchanged(monkeypatch):
    import orbax.checkpoint as ocp

    seen = []

    class Manager:
        def __init__(self, directory, options=None):
            seen.append(directory)

    monkeypatch.setattr(ocp, "CheckpointManager", Manager)
    assert str(Checkpointer("gs://bucket/run").dir) == "gs://bucket/run/checkpoints"
    assert isinstance(seen[0], epath.Path) and str(seen[0]) == "gs://bucket/run/checkpoints"


@pytest.fixture
def fake_gcs(monkeypatch):
    """gs:// served from memory: epath (no TensorFlow here) reaches gs:// through fsspec's "gcs" filesystem, which is
    replaced by an in-memory one that names paths as gcsfs does ("bucket/run/file"). tensorboardX's own gs:// writer
    (which needs google-cloud-storage) is restored afterwards."""
    from etils.epath import backend
    from fsspec.implementations.memory import MemoryFileSystem
    from fsspec.utils import stringify_path
    from tensorboardX import record_writer

    class FakeGCS(MemoryFileSystem):
        protocol = ("gs", "gcs")
        root_marker = ""
        cachable = False
        store: dict = {}  # noqa: RUF012
        pseudo_dirs: list = [""]  # noqa: RUF012

        def __init__(self, *args, finalize_on_close=None, **kwargs):
            super().__init__(*args, **kwargs)

        @classmethod
        def _strip_protocol(cls, path):
            path = stringify_path(path)
            for prefix in ("gs://", "gcs://"):
                path = path.removeprefix(prefix)
            return path.strip("/")

    monkeypatch.setitem(importlib.import_module("fsspec.registry")._registry, "gcs", FakeGCS)
    monkeypatch.setitem(record_writer.REGISTERED_FACTORIES, "gs", record_writer.REGISTERED_FACTORIES["gs"])
    backend._FileSystemSpecBackend._get_filesystem.cache_clear()
    yield FakeGCS
    backend._FileSystemSpecBackend._get_filesystem.cache_clear()


def test_a_workdir_on_an_object_store(fake_gcs):
    """The workdir guard, metrics.jsonl, tb/ and the plot, on gs:// (checkpoints aside: orbax's gs:// support needs
    google-cloud-storage and tensorstore's network access)."""
    url = "gs://bucket/run"
    w = workdir_path(url)
    assert check_workdir(url, {"a": 1}, overwrite=False) is False
    assert Checkpointer.latest_in(url) is None
    claim_workdir(url, {"a": 1})
    assert set(fake_gcs.store) == {"bucket/run/config.json"}  # no temporary file left
    assert json.loads((w / "config.json").read_text()) == {"a": 1}
    assert check_workdir(url, {"a": 1}, overwrite=False) is True

    metrics = MetricsWriter(url, keep_through=None)
    sample = {"example": 0, "prompt": "1+1", "answer": "2", "completion": " 3", "scores": {"accuracy": 0.0}}
    for step in range(3):
        metrics.write({"step": step, "wall_time": float(step), "eval_accuracy": 0.1 * step})
        metrics.write_samples(step, [sample])
    metrics.close()
    assert [r["step"] for r in read_metrics(f"{url}/samples.jsonl")] == [0, 1, 2]
    assert [r["step"] for r in read_metrics(f"{url}/metrics.jsonl")] == [0, 1, 2]
    (first,) = (w / "tb").glob("events.out.tfevents.*")
    assert b"eval_accuracy" in first.read_bytes()

    # A restart from the checkpoint of step 1 keeps steps 0-1 and rewrites tb/ from them.
    metrics = MetricsWriter(url, keep_through=1)
    assert [r["step"] for r in metrics.records()] == [0, 1]
    assert read_metrics(f"{url}/samples.jsonl") == [{"step": s, **sample} for s in (0, 1)]
    metrics.write({"step": 2, "wall_time": 2.5, "eval_accuracy": 0.3})
    metrics.close()
    assert [r["wall_time"] for r in read_metrics(w / "metrics.jsonl")] == [0.0, 1.0, 2.5]
    (second,) = (w / "tb").glob("events.out.tfevents.*")
    assert second != first

    plot_eval_curve(w / "metrics.jsonl", w / "eval_accuracy.png", title="es")
    assert (w / "eval_accuracy.png").read_bytes().startswith(b"\x89PNG")

    with pytest.raises(InputError, match=r"gs://bucket/run/config\.json: this workdir holds a run with a different"):
        check_workdir(url, {"a": 2}, overwrite=False)
    assert check_workdir(url, {"a": 2}, overwrite=True) is False
    claim_workdir(url, {"a": 2})
    assert json.loads((w / "config.json").read_text()) == {"a": 2}
    assert json.loads((w / "replaced-1" / "config.json").read_text()) == {"a": 1}
    assert [r["step"] for r in read_metrics(w / "replaced-1" / "metrics.jsonl")] == [0, 1, 2]
    assert sorted(p.name for p in w.iterdir()) == ["config.json", "replaced-1"]


def test_metrics_in_a_relative_local_workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()  # claim_workdir's
    metrics = MetricsWriter("run", keep_through=None)
    metrics.write({"step": 0, "wall_time": 0.0, "eval_accuracy": 0.5})
    metrics.close()
    assert read_metrics(tmp_path / "run" / "metrics.jsonl") == [{"step": 0, "wall_time": 0.0, "eval_accuracy": 0.5}]
    assert len(list((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))) == 1
    import matplotlib

    backend = matplotlib.get_backend()
    matplotlib.use("svg")  # stands for a notebook's inline backend, which the plot must leave in place
    try:
        plot_eval_curve("run/metrics.jsonl", "run/eval_accuracy.png")
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(backend)
    assert (tmp_path / "run" / "eval_accuracy.png").read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["eval_accuracy.png", "metrics.jsonl", "tb"]


def test_save_hf_to_an_object_store(fake_gcs, tmp_path):
    """An export into a gs:// workdir (train's workdir/final) holds the same files as a local one."""
    from esroll.models import load_hf, save_hf

    from conftest import SHIPPED_MODEL

    cfg, params = load_hf(SHIPPED_MODEL)
    local = save_hf(tmp_path / "final", cfg, params)
    remote = save_hf("gs://bucket/run/final", cfg, params)
    assert str(remote) == "gs://bucket/run/final"
    assert sorted(p.name for p in remote.iterdir()) == sorted(p.name for p in local.iterdir())
    for f in local.iterdir():
        assert (remote / f.name).read_bytes() == f.read_bytes(), f.name


def test_wilson_interval_matches_worked_values():
    """By hand, z = 1.96: p 0.5 of 100 is 0.5 ± 1.96·√(0.0025 + 0.000096)/1.0384 = (0.4038, 0.5962); p 0 of 10 is
    (0, 0.3842/1.3842 = 0.2775); p 1 of 10, the mirror image."""
    import numpy as np

    from esroll.metrics import wilson_interval

    np.testing.assert_allclose(wilson_interval(0.5, 100), (0.4038, 0.5962), atol=1e-4)
    np.testing.assert_allclose(wilson_interval(0.0, 10), (0.0, 0.2775), atol=1e-4)
    np.testing.assert_allclose(wilson_interval(1.0, 10), (0.7225, 1.0), atol=1e-4)
