"""Sharded equals unsharded, once for every method: a run on 8 fake CPU devices ends where the same run on one
device ends, within the float tolerance a sharded sum's other order of addition leaves. (Two processes against one:
tests/test_train.py::test_two_processes_equal_one.)"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from conftest import EIGHT, ONE, assert_params_match, quick_config, strict_quick
from esroll.models import load_hf
from esroll.train import train_and_evaluate


def es_case(tmp_path):
    """LOO-ROLL, 2 steps: the 8 devices split the population; the parameters match one device (every entry to 1e-4,
    99.9% of them to 1e-6: `assert_params_match`)."""
    cfg = quick_config("quick", steps=2, eval_every=100, checkpoint_every=100, export=False)
    one = train_and_evaluate(cfg, tmp_path / "one", mesh_devices=1, progress=False)
    eight = train_and_evaluate(cfg, tmp_path / "eight", mesh_devices=8, progress=False)
    assert len(jax.devices()) == 8
    assert_params_match(one["params"], eight["params"])


def grpo_case(tmp_path):
    """One GRPO step on 8 devices as a 4 × 2 data × model mesh (masters and optimizer state split over both axes,
    sampling and the update tensor-parallel over "model", rows split over "data"; 2 microbatches, remat, chunked
    log-probabilities) against 1 device (1 microbatch, no remat): the same completions and rewards, the gradient norm
    to 1e-5 relative, and the parameters to 1e-7 wherever the gradient is not float noise. AdamW's first step is
    lr·g/(|g| + 1e-8), so an entry whose gradient is ~1e-8 (tied-embedding rows of tokens the model never predicts,
    cancellations) moves by a fraction of lr that depends on the summation order; the comparison covers the entries
    whose 1-device step is at least 0.99·lr (|g| ≳ 1e-6), about 90% of them. ε_low = ε_high = 0, so that any ratio
    ρ ≠ 1 would clip."""
    train = dict(steps=1, eval_every=100, checkpoint_every=100, export=False)
    cfg = strict_quick(ONE, **train)
    eight_cfg = strict_quick(EIGHT, 2, **train)
    one = train_and_evaluate(cfg, tmp_path / "one", mesh_devices=1, progress=False)
    eight = train_and_evaluate(eight_cfg, tmp_path / "eight", mesh_devices=8, progress=False)
    assert eight["params"]["layers"]["up"].sharding.spec == PartitionSpec(None, "data", "model")
    _, initial = load_hf(cfg.model.path)
    compared = 0
    for before, x, y in zip(*(jax.tree.leaves(p) for p in (initial, one["params"], eight["params"]))):
        before, x, y = np.asarray(before), np.asarray(x), np.asarray(y)
        solid = np.abs(before - x) >= 0.99 * cfg.optimizer.lr
        np.testing.assert_allclose(x[solid], y[solid], rtol=0, atol=1e-7)
        compared += solid.sum()
    assert compared > 0.8 * sum(x.size for x in jax.tree.leaves(initial))
    rec = [json.loads((tmp_path / d / "metrics.jsonl").read_text().splitlines()[1]) for d in ("one", "eight")]
    assert rec[0]["reward_mean"] == rec[1]["reward_mean"] and rec[0]["frac_groups_all_equal"] < 1
    np.testing.assert_allclose(rec[0]["grad_norm"], rec[1]["grad_norm"], rtol=1e-5)
    np.testing.assert_allclose(rec[0]["loss"], rec[1]["loss"], atol=1e-6)  # ≈ 0 at ρ = 1: advantages are centred
    assert rec[1]["clip_fraction"] == 0.0


def ppo_case(tmp_path):
    """Two PPO steps on the 4 × 2 mesh against one device: the critic (split like the policy, its update in 2
    microbatches at remat "dots" against 1 without remat) reads the same values, so after its first update the second step's value before the first token, its value loss and its explained
    variance agree to float tolerance."""
    train = dict(steps=2, eval_every=100, checkpoint_every=100, export=False)
    ppo = {"advantage": "gae", "adv": {"gae": {"critic_lr": 1e-3}}}
    one = train_and_evaluate(strict_quick({**ONE, **ppo}, **train), tmp_path / "one", mesh_devices=1, progress=False)
    eight_cfg = strict_quick({**EIGHT, **ppo}, 2, **train)
    eight = train_and_evaluate(eight_cfg, tmp_path / "eight", mesh_devices=8, progress=False)
    rec = [json.loads((tmp_path / d / "metrics.jsonl").read_text().splitlines()[2]) for d in ("one", "eight")]
    assert rec[0]["reward_mean"] == rec[1]["reward_mean"] and rec[0]["value_prompt"] != 0
    for key in ("value_prompt", "value_loss", "explained_variance"):
        np.testing.assert_allclose(rec[0][key], rec[1][key], rtol=1e-4, atol=1e-6, err_msg=key)
    assert_params_match(one["params"], eight["params"])


CASES = {"es": es_case, "grpo": grpo_case, "ppo": ppo_case}


@pytest.mark.e2e
@pytest.mark.parametrize("method", CASES)
def test_sharded_equals_unsharded(method, tmp_path):
    CASES[method](tmp_path)
