"""The training loop: outputs, exact resumption, sharded == unsharded, multi-process == single-process, bad input."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys

import chex
import jax
import numpy as np
import pytest

from configs.default import get_config
from esroll.config import from_config_dict
from esroll.errors import InputError
from esroll.experiment import check_names
from esroll.metrics import read_metrics
from esroll.train import train_and_evaluate

from conftest import REPO, assert_params_match, quick_config, xla_flags


def quick(**train_overrides):
    return quick_config("quick", **train_overrides)


TWO_STEPS = quick(steps=2, eval_every=100, checkpoint_every=100, export=False)


@pytest.mark.e2e
def test_quick_run_writes_everything(tmp_path):
    import torch
    import transformers

    out = train_and_evaluate(quick(), tmp_path, progress=False)
    records = read_metrics(tmp_path / "metrics.jsonl")
    steps = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert {"step", "wall_time", "fitness_mean", "fitness_std", "tokens_per_s"} <= set(r)
    assert [r["step"] for r in records if "eval_accuracy" in r] == [0, 2, 3]
    assert (tmp_path / "eval_accuracy.png").stat().st_size > 0
    assert any((tmp_path / "tb").iterdir())
    # The exported model loads in transformers and agrees with the trained parameters.
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"), dtype=torch.float32).eval()
    from esroll.models import forward, load_hf

    cfg, params = load_hf(tmp_path / "final")
    chex.assert_trees_all_equal(params, jax.device_get(out["params"]))
    ids = np.array([[5, 9, 17, 3, 40]])
    ours, _ = forward(cfg, params, ids)
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    assert np.abs(np.asarray(ours) - ref).max() < 1e-4


def scheduled():
    """4 quick steps with a learning-rate warm-up and cosine decay and a linear σ schedule, both of horizon 3 (shorter
    than the run), and the training-loop curriculum (ADS and AdaPrefix, whose controller ES drives from the shared
    prompts). Extended (test_raising_steps_continues_a_finished_run_exactly) runs of
    it must end where `scheduled_run`, the run straight through, ends."""
    from esroll.curriculum import CurriculumConfig

    cfg = quick(steps=4, checkpoint_every=2, eval_every=2, export=False)
    return dataclasses.replace(
        cfg,
        optimizer=dataclasses.replace(cfg.optimizer, schedule="cosine", lr_final=1e-4, horizon=3, warmup_steps=1),
        es=dataclasses.replace(cfg.es, sigma_schedule="linear", sigma_final=cfg.es.sigma / 2, sigma_horizon=3),
        curriculum=CurriculumConfig(ads=True, prefix=True, prefix_source="target", prefix_init=0.5, prefix_horizon=6),
    )


@pytest.fixture(scope="module")
def scheduled_run(tmp_path_factory):
    """The final parameters of `scheduled()` run straight through its 4 steps."""
    out = train_and_evaluate(scheduled(), tmp_path_factory.mktemp("scheduled"), progress=False)
    return jax.device_get(out["params"])


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """The parameters of 2 steps of the quick config on one device: what the two processes below must match."""
    out = train_and_evaluate(TWO_STEPS, tmp_path_factory.mktemp("one"), mesh_devices=1, progress=False)
    return jax.device_get(out["params"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.e2e
def test_two_processes_equal_one(tmp_path, one_device):
    """Two processes with two CPU devices each (gloo collectives on localhost), each process's two devices one model
    axis (the weights split over them, the rows over the processes), match one process on one device."""
    script = REPO / "tests" / "multiprocess_worker.py"
    port = _free_port()
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags(2),
        "JAX_PLATFORMS": "cpu",
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
        "JAX_NUM_PROCESSES": "2",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "multi"), str(tmp_path / f"p{i}.npz")],
            env={**env, "JAX_PROCESS_ID": str(i)},
            cwd=REPO,
        )
        for i in range(2)
    ]
    assert all(p.wait(timeout=600) == 0 for p in procs)
    # The export gathers the model split over both processes' devices (each holds half of every layer).
    from esroll.models import load_hf

    _, exported = load_hf(tmp_path / "multi" / "final")
    trained = np.load(tmp_path / "p0.npz")
    for name in ("q", "down"):  # split over the model axis by columns / by rows
        np.testing.assert_array_equal(np.asarray(exported["layers"][name]), trained[f"['layers']['{name}']"])
    flat_single = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(one_device)}
    for i in range(2):
        got = np.load(tmp_path / f"p{i}.npz")
        assert set(got.files) == set(flat_single)
        assert_params_match([got[k] for k in sorted(got.files)], [flat_single[k] for k in sorted(got.files)])


def test_config_errors(tmp_path):
    cd = get_config("quick")
    cd.es.sigmaa = 0.1
    with pytest.raises(ValueError, match="unknown key 'es.sigmaa'"):
        from_config_dict(cd.to_dict())
    cd = get_config("quick")
    cd.es.sigma = -1.0
    with pytest.raises(ValueError, match="invalid value for 'es.sigma'"):
        from_config_dict(cd.to_dict())
    d = get_config("quick").to_dict()
    d["train"]["steps"] = "ten"
    with pytest.raises(ValueError, match="key 'train.steps' must be int"):
        from_config_dict(d)
    cd = get_config("eggroll")
    cd.es.population = 7  # what eggroll needs of the ES settings: checked with the method's other needs
    with pytest.raises(ValueError, match=r"es.population.*a multiple of 2 for eggroll \(2 members per direction\)"):
        check_names(from_config_dict(cd.to_dict()))
    cd = get_config("quick")
    cd.es.sigmaa = 0.1
    with pytest.raises(InputError, match=r"unknown key 'es.sigmaa' \(did you mean 'es.sigma'\?\)"):
        from_config_dict(cd.to_dict())
    cd = get_config("quick")
    cd.optimizer.schedule = "cosine"  # a schedule needs its horizon declared
    with pytest.raises(InputError, match="invalid value for 'optimizer.horizon'"):
        from_config_dict(cd.to_dict())
    cd = get_config("quick")
    cd.es.sigma_schedule = "linear"
    cd.es.sigma_horizon = 10  # σ may not decay to 0: the estimator divides by it
    with pytest.raises(InputError, match="invalid value for 'es.sigma_final'"):
        from_config_dict(cd.to_dict())


@pytest.mark.parametrize("method", ["looroll", "eggroll"])
def test_es_refuses_the_grpo_variants(method):
    """The GRPO variants (STARE, ACPO, the progress advantage) change GRPO's step and loss: an ES config that selects
    one is refused with one line naming `grpo.variants`; their options (inert while unselected) are accepted, and
    GRPO takes all of them."""
    for name in ("stare", "acpo", "progress"):
        cd = get_config("quick")
        cd.method = method
        cd.grpo.variants = (name,)
        expected = rf"^config: invalid value for 'method': '{method}' \(expected grpo for grpo.variants"
        with pytest.raises(InputError, match=expected) as e:
            check_names(from_config_dict(cd.to_dict()))
        assert "\n" not in str(e.value), str(e.value)
        cd.method = "grpo"
        assert check_names(from_config_dict(cd.to_dict())).grpo.variants == (name,)
    cd = get_config("quick")
    cd.method = method
    cd.grpo.variant_options.stare.update(alpha=1.0, entropy_low=0.1)
    cd.grpo.variant_options.acpo.update(min=0.05, scale=3.0)
    assert check_names(from_config_dict(cd.to_dict())).method == method


@pytest.mark.e2e
def test_failed_start_leaves_nothing_then_runs_and_a_finished_run_is_left_alone(tmp_path):
    """A run that cannot start (no model folder) writes nothing; the corrected command then trains in the same
    workdir; rerunning the finished run reports it complete and changes no file."""
    workdir = tmp_path / "w"
    bad = dataclasses.replace(quick(), model=dataclasses.replace(quick().model, path=str(tmp_path / "no-model")))
    with pytest.raises(InputError, match="'model.path'.*no-model"):
        train_and_evaluate(bad, workdir, progress=False)
    assert not workdir.exists() or not any(workdir.iterdir())
    done = train_and_evaluate(quick(), workdir, progress=False)
    assert done["steps"] == 3 and done["ran_steps"] == 3 and done["resumed_from"] == 0
    before = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}
    again = train_and_evaluate(quick(), workdir, progress=False)
    assert again["ran_steps"] == 0 and again["resumed_from"] == 3
    assert again["final_eval_accuracy"] == done["final_eval_accuracy"]
    assert {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()} == before


def test_workdir_with_other_config_is_refused(tmp_path):
    from esroll.checkpoint import check_workdir, claim_workdir

    assert check_workdir(tmp_path, {"a": 1, "es": {"sigma": 0.1}}, overwrite=False) is False
    assert not (tmp_path / "config.json").exists()  # checking writes nothing
    claim_workdir(tmp_path, {"a": 1, "es": {"sigma": 0.1}})
    (tmp_path / "metrics.jsonl").write_text("precious\n")
    assert check_workdir(tmp_path, {"a": 1, "es": {"sigma": 0.1}}, overwrite=False) is True
    with pytest.raises(InputError, match=r"config\.json.*'es\.sigma' was 0\.1, now 0\.2.*--overwrite"):
        check_workdir(tmp_path, {"a": 1, "es": {"sigma": 0.2}}, overwrite=False)
    assert (tmp_path / "metrics.jsonl").read_text() == "precious\n"
    assert check_workdir(tmp_path, {"a": 1, "es": {"sigma": 0.2}}, overwrite=True) is False
    claim_workdir(tmp_path, {"a": 1, "es": {"sigma": 0.2}})
    assert (tmp_path / "replaced-1" / "metrics.jsonl").read_text() == "precious\n"
    assert json.loads((tmp_path / "config.json").read_text()) == {"a": 1, "es": {"sigma": 0.2}}
    # A run that never completed a step (its evaluation before training only, no checkpoint) is no run to keep: a
    # corrected config takes the workdir without --overwrite, the old files moved aside all the same.
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "eval_accuracy": 0.5}\n')
    assert check_workdir(tmp_path, {"a": 1, "es": {"sigma": 0.3}}, overwrite=False) is False
    assert claim_workdir(tmp_path, {"a": 1, "es": {"sigma": 0.3}}) == tmp_path / "replaced-2"
    assert json.loads((tmp_path / "replaced-2" / "config.json").read_text()) == {"a": 1, "es": {"sigma": 0.2}}
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "eval_accuracy": 0.5}\n{"step": 1}\n')
    with pytest.raises(InputError, match=r"'es\.sigma' was 0\.3, now 0\.4"):
        check_workdir(tmp_path, {"a": 1, "es": {"sigma": 0.4}}, overwrite=False)


@pytest.mark.e2e
def test_entry_scripts_use_one_cpu_device_per_core():
    """`parallel.use_cpu_cores_as_devices` (called first by the entry scripts) gives one CPU device per available core,
    and leaves an explicit --xla_force_host_platform_device_count alone."""
    code = (
        "from esroll import parallel; parallel.use_cpu_cores_as_devices(); import jax, os; "
        "print(len(jax.devices('cpu')), len(os.sched_getaffinity(0)))"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "JAX_PLATFORMS": "cpu"},
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out[0] == out[1]
    flags = {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=3"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=flags, cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[0] == "3"


def test_a_workdir_without_a_run_is_written_into_not_moved(tmp_path):
    """Only a run of another config (config.json) is ever moved aside; other files in the workdir stay put."""
    from esroll.checkpoint import check_workdir, claim_workdir

    (tmp_path / "notes.txt").write_text("mine\n")
    assert check_workdir(tmp_path, {"a": 1}, overwrite=True) is False
    claim_workdir(tmp_path, {"a": 1})
    assert (tmp_path / "notes.txt").read_text() == "mine\n" and not (tmp_path / "replaced-1").exists()


@pytest.mark.e2e
def test_a_step_that_cannot_fit_the_devices_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """Where devices report their memory, the trainer compiles the ES step for them first (as experiments.plan does)
    and refuses one that cannot fit, naming the largest buffer; here the CPU devices are said to hold 1 MiB."""
    from esroll import memory

    monkeypatch.setattr(memory, "device_memory_bytes", lambda device: 2**20)
    cfg = quick(steps=2, eval_every=100, checkpoint_every=100, export=False)
    with pytest.raises(
        InputError,
        match=r"^config: the looroll step needs .* GiB per device in '\w+' but a .* has "
        r"0\.0 GiB; largest: .* GiB \(rows per device 1; lower parallel\.rows_per_device",
    ):
        train_and_evaluate(cfg, tmp_path / "run", mesh_devices=1, progress=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.e2e
def test_raising_steps_continues_a_finished_run_exactly(tmp_path, capsys, scheduled_run):
    """A finished 2-step run rerun with train.steps = 4 continues from its last checkpoint and ends bit-identical to the
    4-step run (its schedules' horizons shorter than the new length; the curriculum's state carried over); the old
    config is kept beside the new one. Lowering train.steps, or changing anything else, is refused with the remedy,
    and changes no file. (The loop's extension is the same for every method; GRPO's state, reference model included,
    resumes exactly: tests/test_resume.py::test_a_resumed_run_ends_bit_identical[grpo].)"""
    four = scheduled()
    two = dataclasses.replace(four, train=dataclasses.replace(four.train, steps=2))
    workdir = tmp_path / "extended"
    assert train_and_evaluate(two, workdir, progress=False)["ran_steps"] == 2
    capsys.readouterr()
    extended = train_and_evaluate(four, workdir, progress=False)
    assert extended["resumed_from"] == 2 and extended["ran_steps"] == 2
    chex.assert_trees_all_equal(scheduled_run, jax.device_get(extended["params"]))
    out = capsys.readouterr().out
    assert "extending the run (train.steps 2 -> 4) from its checkpoint at step 2" in out
    assert "optimizer.horizon = 3" in out and "es.sigma_horizon = 3" in out
    assert json.loads((workdir / "config.before-extension-1.json").read_text())["train"]["steps"] == 2
    assert json.loads((workdir / "config.json").read_text())["train"]["steps"] == 4
    steps = [r["step"] for r in read_metrics(workdir / "metrics.jsonl") if "tokens_per_s" in r]
    assert steps == [1, 2, 3, 4]

    before = {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}
    for changed in (
        dataclasses.replace(four, train=dataclasses.replace(four.train, steps=3)),
        dataclasses.replace(four, seed=1),
    ):
        with pytest.raises(InputError, match=r"only raising train\.steps or train\.time_budget_s.*replaced-N"):
            train_and_evaluate(changed, workdir, progress=False)
    assert {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()} == before


@pytest.mark.e2e
def test_raising_the_time_budget_continues_a_run(tmp_path):
    """A run stopped by its time budget (a budget so small that one step exceeds it) continues when rerun without a
    budget, to the same parameters as a run that never had one."""
    cfg = quick(steps=2, checkpoint_every=100, eval_every=100, export=False)
    budgeted = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, time_budget_s=1e-9))
    full = train_and_evaluate(cfg, tmp_path / "full", progress=False)
    assert train_and_evaluate(budgeted, tmp_path / "w", progress=False)["steps"] == 1
    assert train_and_evaluate(budgeted, tmp_path / "w", progress=False)["ran_steps"] == 0  # finished: left alone
    resumed = train_and_evaluate(cfg, tmp_path / "w", progress=False)
    assert resumed["resumed_from"] == 1 and resumed["steps"] == 2
    chex.assert_trees_all_equal(jax.device_get(full["params"]), jax.device_get(resumed["params"]))
