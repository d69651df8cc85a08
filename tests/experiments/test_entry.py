"""The entry scripts as a user meets them: one-line errors, --help, refused method switches, runs killed at any
moment (SIGKILL) and resumed, and the README's library example."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from esroll.metrics import read_metrics

from conftest import REPO


def run_train(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "experiments.train", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.mark.e2e
@pytest.mark.parametrize(
    "args, expected",
    [
        (["--config.es.sigmaa=0.1"], r"unknown key 'es\.sigmaa' \(did you mean 'es\.sigma'\?\)"),
        (["--config.es.sigma=-1"], r"invalid value for 'es\.sigma': -1\.0"),
        (["--config.es.shaping=foo"], r"^error: config: invalid value for 'es\.shaping': 'foo' \(expected one of "),
        (["--config.model.path=/no/such/model"], r"'model\.path'.*/no/such/model"),
        (["--config.data.task=gsm8k", "--config.data.path={bad}"], r"{bad}:2: missing key 'answer'"),
        (["--config.method=grpo"], r"--config\.method=grpo.*keeps its optimizer.*--config=configs/default\.py:grpo"),
        # keys the run would not read (a data file of a generated task, a GRPO option on ES, an unused curriculum
        # method's setting), and a held-out size the data cannot give
        (
            ["--config.data.path=/x.jsonl"],
            r"^error: --config\.data\.path: not read by this run: data\.task 'arithmetic'",
        ),
        (["--config.grpo.group_size=4"], r"^error: --config\.grpo\.group_size: not read.*method 'looroll'"),
        (["--config.curriculum.prefix_gain=3"], r"--config\.curriculum\.prefix_gain: .*curriculum\.prefix is False"),
        (["--config.data.eval_size=5000"], r"'data\.eval_size': 5000 \(expected at most \d+: data\.task='arithmetic'"),
    ],
)
def test_expected_errors_are_one_line(tmp_path, args, expected):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?"}\n')
    args = [a.replace("{bad}", str(bad)) for a in args]
    workdir = tmp_path / "run"
    proc = run_train("--config", "configs/default.py:quick", "--workdir", str(workdir), *args)
    assert re.search(expected.replace("{bad}", re.escape(str(bad))), one_line_error(proc))
    assert not workdir.exists() or not any(workdir.iterdir())  # a failed start claims nothing


@pytest.mark.e2e
def test_print_config_resolves_and_marks_what_the_run_does_not_read(tmp_path):
    """--print_config shows the file's values with the overrides applied, marks the overrides and the keys the run
    does not read, and exits 0 without a workdir; an override the run would not read is still refused."""
    proc = run_train(
        "--config=configs/gsm8k_qwen3.py:0.6b,grpo,cpu",
        "--config.model.path=assets/tiny-qwen3-arith",
        "--config.optimizer.lr=3e-6",
        "--print_config",
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "* optimizer.lr = 3e-06" in lines and "  grpo.group_size = 2" in lines
    assert "  data.task = 'gsm_symbolic'" in lines and "  optimizer.weight_decay = 0.0" in lines
    assert "  data.n_examples = 200" in lines  # read by gsm_symbolic
    assert "  data.path = ''  # not read: data.task 'gsm_symbolic' does not read it" in lines
    assert "  es.population = 4  # not read: method 'grpo' reads no ES setting" in lines
    # the registered options of estimators and variants this run does not use
    assert "  grpo.adv.maxpo.k = 2  # not read: only grpo.advantage 'maxpo' reads it, and this run's is 'grpo'" in lines
    assert any(line.startswith("  grpo.variant_options.stare.alpha = 0.5  # not read: only the GRPO") for line in lines)
    assert not [line for line in lines if "not read" in line and line.lstrip("* ").startswith(("grpo.g", "train."))]
    # an override the run would not read is shown, marked; a run with it is refused
    args = ["--config=configs/gsm8k_qwen3.py:0.6b,cpu", "--config.model.path=m", "--config.data.path=x"]
    proc = run_train(*args, "--print_config")
    assert proc.returncode == 0 and "* data.path = 'x'  # not read: data.task 'gsm_symbolic'" in proc.stdout
    proc = run_train(*args, f"--workdir={tmp_path / 'run'}")
    assert "--config.data.path: not read by this run" in one_line_error(proc) and not (tmp_path / "run").exists()


@pytest.mark.e2e
def test_help_lists_variants_and_keys():
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.train", "--help", "--config=configs/default.py:grpo"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    for text in ("--workdir", "grpo_quick", "es.sigma = 0.005", "optimizer.lr = 0.0001", "method = 'grpo'"):
        assert text in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.compare", "--help", "--config=configs/compare.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and "gsm8k_qwen3_<size>" in proc.stdout and "time_budget_s = 150.0" in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench", "--help"], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0 and "generate_vs_hf" in proc.stdout and "grpo_step_vs_trl" in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.pretrain_tiny", "--help"], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0 and "--stop_at STOP_AT stop at the first evaluation" in " ".join(proc.stdout.split())


# ---- a user's code failing, and the corrected rerun

USER_ENV = """
import dataclasses

from esroll.agents import Turn, parse_action, register_env


@dataclasses.dataclass(frozen=True)
class FragileOptions:
    max_turns: int = 2
    broken: bool = True
    wordy: bool = False


class Fragile:
    actions = ("left", "right")
    instructions = "Fragile: say left or right."

    def __init__(self, options=FragileOptions()):
        self.options = options

    @property
    def solved(self):
        return False

    def reset(self, seed):
        self.turns = 0
        return self.view()

    def view(self):
        return " ".join(str(i) for i in range(100)) if self.options.wordy else "x"

    def step(self, action):
        if self.options.broken:
            return 1 / 0
        self.turns += 1
        return Turn(self.view(), 0.0, self.turns >= self.options.max_turns, parse_action(action, self.actions) is not None)


register_env("fragile", Fragile, options=FragileOptions)
"""


@pytest.mark.e2e
def test_a_failing_user_environment_says_one_line_and_blocks_no_corrected_rerun(tmp_path):
    """An environment whose step raises ends the run with one line naming its file and line (the traceback kept in
    WORKDIR/error.log); an observation longer than its room names the full key; each corrected rerun takes over the
    workdir of a run that never completed a step, without --overwrite, moving it aside."""
    (tmp_path / "fragile_env.py").write_text(USER_ENV)
    (tmp_path / "my_config.py").write_text("import fragile_env  # noqa: F401\nfrom configs.agents import get_config\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    workdir = tmp_path / "run"

    def train(*overrides: str) -> subprocess.CompletedProcess:
        args = ["--config", f"{tmp_path / 'my_config.py'}:fragile,grpo,quick", "--workdir", str(workdir)]
        return subprocess.run(
            [sys.executable, "-m", "experiments.train", *args, *overrides],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    line = one_line_error(train())
    where = f"{tmp_path / 'fragile_env.py'}:{USER_ENV.splitlines().index('            return 1 / 0') + 1}, in step"
    log = workdir / "error.log"
    assert line == f"error: ZeroDivisionError raised at {where}: division by zero; the full traceback is in {log}"
    assert "Traceback" in log.read_text() and "ZeroDivisionError: division by zero" in log.read_text()
    line = one_line_error(train("--config.env.options.fragile.broken=False", "--config.env.options.fragile.wordy=True"))
    assert re.fullmatch(
        r"error: env\.max_observation_tokens: an observation of \d+ tokens does not fit its 24 \(turn 0, row 0: "
        r"'0 1 2 3 .*'\.\.\.\): raise it or shorten the environment's observations",
        line,
    )
    proc = train("--config.env.options.fragile.broken=False")
    assert proc.returncode == 0, proc.stderr
    assert f"never completed a step: moved to {workdir / 'replaced-2'}" in proc.stdout
    assert [r["step"] for r in read_metrics(workdir / "metrics.jsonl") if "eval_accuracy" in r] == [0, 2]
    assert (workdir / "replaced-1" / "error.log").is_file() and (workdir / "replaced-2" / "config.json").is_file()


# ---- killed at any moment


def tb_scalars(tb: Path) -> list[tuple[str, int]]:
    """(tag, step) of every scalar in the TensorBoard event files under `tb` (TFRecord framing, no TensorFlow)."""
    from tensorboardX.proto import event_pb2

    out = []
    for f in sorted(tb.glob("events.out.tfevents.*")):
        data = f.read_bytes()
        i = 0
        while i + 12 <= len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            event = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
            i += 12 + n + 4
            out += [(v.tag, event.step) for v in event.summary.value]
    return out


QUICK = [
    "--config",
    "configs/default.py:quick",
    "--config.train.steps=8",
    "--config.train.checkpoint_every=4",
    "--config.train.eval_every=2",
]


def kill_when(workdir: Path, step: int, checkpoint: int | None = None, sig=signal.SIGKILL) -> tuple[int, str]:
    """Start the run, send it `sig` as soon as metrics.jsonl holds `step` (and, if given, the checkpoint of step
    `checkpoint` is finalised); returns its exit status and what it wrote to stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "experiments.train", *QUICK, "--workdir", str(workdir)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        # A pytest-xdist worker ignores SIGINT, and a child inherits that (Python then installs no KeyboardInterrupt
        # handler): give the run the terminal's default, as a user's shell does.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        saved = checkpoint is None or (workdir / "checkpoints" / str(checkpoint)).is_dir()
        if saved and any(r["step"] >= step for r in read_metrics(workdir / "metrics.jsonl")):
            os.kill(proc.pid, sig)
            break
        time.sleep(0.01)
    _, err = proc.communicate()
    return proc.returncode, err


@pytest.mark.e2e
def test_sigkill_and_ctrl_c_then_resume(tmp_path):
    """Killed after step 2 (before the first checkpoint, at 4) and after step 5 (once it is saved), then stopped by
    Ctrl-C (SIGINT) after step 6, which prints one line saying where to resume from, then run to the end: every step
    is logged once in metrics.jsonl, samples.jsonl and TensorBoard, and the exported model is bit-identical to an
    uninterrupted run's. The uninterrupted run goes on beside the killed ones."""
    log = tmp_path / "straight.err"
    with log.open("w") as err:
        straight = subprocess.Popen(
            [sys.executable, "-m", "experiments.train", *QUICK, "--workdir", str(tmp_path / "straight")],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    killed = tmp_path / "killed"
    assert kill_when(killed, 2)[0] == -signal.SIGKILL
    assert not (killed / "checkpoints").exists() or not any((killed / "checkpoints").glob("[0-9]*"))
    assert kill_when(killed, 5, checkpoint=4)[0] == -signal.SIGKILL
    status, err = kill_when(killed, 6, checkpoint=4, sig=signal.SIGINT)
    assert status == 130 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(
        r"\[esroll\] interrupted at step [67]; rerun the same command to resume from its checkpoint at step 4", last
    )
    resumed = run_train(*QUICK, "--workdir", str(killed))
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from step 4" in resumed.stdout
    assert straight.wait(timeout=300) == 0, log.read_text()
    steps = [r["step"] for r in read_metrics(killed / "metrics.jsonl")]
    assert steps == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    scalars = tb_scalars(killed / "tb")
    assert len(scalars) == len(set(scalars)) and {s for _, s in scalars} == set(range(9))
    assert sorted(scalars) == sorted(tb_scalars(tmp_path / "straight" / "tb"))
    for f in ("model.safetensors",):
        assert (killed / "final" / f).read_bytes() == (tmp_path / "straight" / "final" / f).read_bytes()
    a, b = read_metrics(killed / "metrics.jsonl"), read_metrics(tmp_path / "straight" / "metrics.jsonl")
    assert [r.get("eval_accuracy") for r in a] == [r.get("eval_accuracy") for r in b]
    samples = (killed / "samples.jsonl").read_text()
    assert samples == (tmp_path / "straight" / "samples.jsonl").read_text()
    assert [r["step"] for r in read_metrics(killed / "samples.jsonl")] == [s for s in (0, 2, 4, 6, 8) for _ in range(4)]


# ---- the README's library example


def readme_example() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("## Using the library", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.e2e
def test_readme_library_example_runs(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", readme_example()], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    fitness = [float(x) for x in re.findall(r"mean fitness ([0-9.]+)", proc.stdout)]
    assert len(fitness) == 3 and all(0 <= f <= 1 for f in fitness)
    assert len(set(fitness)) > 1  # the parameters moved between steps


@pytest.mark.parametrize("path", sorted(p.name for p in (REPO / "configs").glob("*.py") if p.name != "__init__.py"))
def test_help_lists_the_variants_of_every_shipped_config_file(path):
    from experiments._entry import help_text

    text = help_text(["train", f"--config=configs/{path}"])
    variants = text.split(f"variants of configs/{path}", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    assert len(variants) >= 2 and all(line.startswith("  ") for line in variants), text


@pytest.mark.e2e
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (the plan extra)")
def test_importing_esroll_on_a_host_without_tpus_silences_the_tpu_probe():
    """With libtpu installed and no TPU, a plain script that imports the library and runs JAX prints nothing."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    code = "import esroll.rewards, jax, jax.numpy as jnp; print(jax.default_backend(), int(jnp.ones(3).sum()))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["cpu", "3"], proc.stderr
    assert proc.stderr == "", proc.stderr


def test_outside_code_names_the_users_frame_and_never_esrolls(tmp_path, monkeypatch):
    """An error raised in a user's module (directly, or inside numpy called from it) is placed at the user's line; one
    raised inside esroll is not the user's (it keeps its traceback)."""
    from esroll.agents import ENVIRONMENTS, make_env
    from esroll.errors import outside_code
    from esroll.steps.segment import split_text

    (tmp_path / "users_envs.py").write_text(
        "import numpy as np\n\n\ndef broken(options):\n    return {}['missing']\n\n\n"
        "def negative(options):\n    return np.zeros(-1)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import users_envs

    options = type(make_env("frozenlake", {}).options)
    for name, line in (("broken", 5), ("negative", 9)):
        ENVIRONMENTS.add(f"test_{name}", getattr(users_envs, name), options=options)
        try:
            with pytest.raises(Exception) as e:
                make_env(f"test_{name}")
            assert outside_code(e.value) == f"{tmp_path / 'users_envs.py'}:{line}, in {name}"
        finally:
            del ENVIRONMENTS[f"test_{name}"]
    with pytest.raises(ValueError) as e:
        split_text("x", "")
    assert outside_code(e.value) is None
