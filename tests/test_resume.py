"""Exact resumption, once for every kind of run: stopped after 2 of its 4 steps and restarted, a run ends with the
parameters of the 4 steps straight through, bit for bit, and so does its ledger (each step's FLOPs and their running
sum). The runs: ES with a learning-rate warm-up and cosine decay, a linear σ schedule and the curriculum (ADS,
AdaPrefix); GRPO on a 4 × 2 data × model mesh with an estimator that keeps a running state (BV-Blend), a variant
whose gate is state too (STARE) and the curriculum; ES on agent episodes; a bf16 model with float32 masters; and PPO,
whose critic and its optimizer are state."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import EIGHT, REPO, check_exact_resume, quick_config, strict_quick
from esroll import ledger
from esroll.curriculum import CurriculumConfig
from esroll.config import from_config_dict
from esroll.data import make_splits
from esroll.es import estimators
from esroll.experiment import check_names
from esroll.metrics import read_metrics
from esroll.models import load_hf
from esroll.task import load_task

CURRICULUM = CurriculumConfig(ads=True, prefix=True, prefix_source="target", prefix_init=0.5, prefix_horizon=6)


def es_case():
    """ES with schedules of horizon 3 (shorter than the run) and the training-loop curriculum, whose controller ES
    drives from the shared prompts: the learning rate, σ and the curriculum's state continue exactly."""
    cfg = quick_config("quick", steps=4, checkpoint_every=2, eval_every=2, export=False)
    cfg = dataclasses.replace(
        cfg,
        optimizer=dataclasses.replace(cfg.optimizer, schedule="cosine", lr_final=1e-4, horizon=3, warmup_steps=1),
        es=dataclasses.replace(cfg.es, sigma_schedule="linear", sigma_final=cfg.es.sigma / 2, sigma_horizon=3),
        curriculum=CURRICULUM,
    )

    def check(steps, final, workdir):
        assert steps[0]["prefix_tokens"] > 0 and steps[0]["prefix_assistance"] == 1.0
        assert any(key.startswith("ads_weight[difficulty=") for key in steps[-1])
        lr = cfg.optimizer.lr
        cosine = [1e-4 + (lr - 1e-4) * (1 + np.cos(np.pi * k / 2)) / 2 for k in (1, 2)]  # after the warm-up step
        np.testing.assert_allclose([r["lr"] for r in steps], [0.0, lr, *cosine], rtol=1e-6)
        sigma = cfg.es.sigma
        np.testing.assert_allclose(
            [r["sigma"] for r in steps], [sigma, sigma * 5 / 6, sigma * 4 / 6, sigma / 2], rtol=1e-6
        )
        # the ledger's figures: the update's is the ES update's; the rollout's lies between every row stopping after
        # one token and none stopping early
        task, _ = load_task(cfg, *make_splits(cfg.data))
        rank, P, N = cfg.es.rank, task.prompt_multiple, cfg.train.max_new_tokens
        E = estimators.num_directions(cfg.method, cfg.es.population)
        assert all(r["flops_update"] == ledger.es_update_flops(task.cfg, E, rank) for r in steps)
        rows = cfg.es.population * cfg.train.prompts_per_step
        least = ledger.generate_flops(task.cfg, rows, P, 1, perturb_rank=rank)
        most = ledger.generate_flops(task.cfg, rows, P, N, perturb_rank=rank)
        assert all(least <= r["flops_generate"] <= most for r in steps)

    return cfg, {}, check


def grpo_case():
    """GRPO on 8 devices as a 4 × 2 mesh, 2 microbatches with remat; BV-Blend's per-cluster history (checkpointed
    with the optimizer state) and STARE, whose gate opens after the first step (its entropy thresholds sit above the
    policy's entropy)."""
    stare = {
        "variants": ("stare",),
        "variant_options": {"stare": {"quantile": 0.8, "entropy_low": 5.0, "entropy_high": 6.0}},
    }
    cfg = strict_quick({**EIGHT, "advantage": "bv_blend", **stare}, 2, steps=4, checkpoint_every=2, eval_every=2)
    cfg = dataclasses.replace(cfg, curriculum=CURRICULUM)

    def check(steps, final, workdir):
        assert steps[0]["prefix_tokens"] > 0 and steps[0]["prefix_assistance"] == 1.0
        assert any(key.startswith("ads_weight[difficulty=") for key in steps[-1])
        assert steps[0]["bv_blend_weight"] == 0 and steps[-1]["bv_blend_weight"] > 0  # history builds up and is used
        assert [r["stare_open"] for r in steps] == [0, 1, 1, 1] and steps[-1]["stare_tokens"] > 0
        keys = {"reward_mean", "reward_std", "loss", "kl", "clip_fraction", "frac_groups_all_equal", "grad_norm"}
        assert all(keys | {"entropy"} <= set(r) for r in steps)

    return cfg, {}, check


def agent_case():
    """LOO-ROLL on `configs/agents.py:quick` episodes: every member's episodes depend only on the run's seed and the
    step. On a 2-device mesh (rows and checkpoints still sharded): on all 8 fake CPU devices each turn of an episode
    costs ~7x as much on 2 cores, for no property of its own."""
    from configs.agents import get_config

    cd = get_config("quick")
    cd.model.path = str(REPO / "assets" / "tiny-qwen3-agent")
    cd.train.steps = 4
    cfg = check_names(from_config_dict(cd.to_dict()))

    def check(steps, final, workdir):
        for r in steps:
            assert 0 <= r["episode_solved"] <= 1 and 1 <= r["episode_turns"] <= 8 and 0 <= r["valid_actions"] <= 1
            assert np.isfinite(r["fitness_mean"])
        evals = [r for r in read_metrics(workdir / "split" / "metrics.jsonl") if "eval_accuracy" in r]
        assert [r["step"] for r in evals] == [0, 2, 4] and all({"eval_return", "eval_turns"} <= set(r) for r in evals)

    return cfg, {"mesh_devices": 2}, check


def bf16_case():
    """The shipped model decoded in bf16, its masters in float32: the 4 steps at Adam 1e-4 move >= 99% of the master
    entries of every perturbed matrix (in bf16 most such updates round away); the embedding, not perturbed, stays as
    loaded. (Evaluated only before and after the 4 steps, on 8 held-out questions.)"""
    cfg = quick_config("quick", steps=4, eval_every=4, checkpoint_every=2)
    cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, eval_size=8),
        model=dataclasses.replace(cfg.model, dtype="bfloat16", master_dtype="float32"),
        optimizer=dataclasses.replace(cfg.optimizer, lr=1e-4),
        train=dataclasses.replace(cfg.train, export=False),
    )

    def check(steps, final, workdir):
        _, initial = load_hf(cfg.model.path, dtype=jnp.float32)
        assert final["layers"]["q"].dtype == np.float32
        for name in ("q", "k", "v", "o", "gate", "up", "down"):
            changed = np.mean(np.asarray(final["layers"][name]) != np.asarray(initial["layers"][name], np.float32))
            assert changed >= 0.99, (name, changed)
        np.testing.assert_array_equal(final["embed"], np.asarray(initial["embed"]))  # frozen

    return cfg, {}, check


def ppo_case():
    """PPO (GAE from a learned critic) on 8 devices as a 4 × 2 mesh: the critic and its Adam state are split and
    checkpointed with the policy's, and from the second step on the critic's values shape the policy's advantages,
    so a critic restored wrongly would change the final policy."""
    cfg = strict_quick(
        {**EIGHT, "advantage": "gae", "adv": {"gae": {"critic_lr": 1e-3}}}, 2, steps=4, checkpoint_every=2
    )
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_every=4))

    def check(steps, final, workdir):
        assert steps[0]["value_prompt"] == 0.0  # a zero value head at the start
        assert all(r["value_loss"] > 0 for r in steps) and all(r["value_prompt"] != 0 for r in steps[1:])

    return cfg, {}, check


CASES = {"es": es_case, "grpo": grpo_case, "agent": agent_case, "bf16": bf16_case, "ppo": ppo_case}


@pytest.mark.e2e
@pytest.mark.parametrize("case", CASES)
def test_a_resumed_run_ends_bit_identical(case, tmp_path):
    cfg, run, check = CASES[case]()
    steps, final = check_exact_resume(cfg, tmp_path, **run)
    full = [r for r in read_metrics(tmp_path / "full" / "metrics.jsonl") if r["step"] > 0 and "tokens_per_s" in r]
    assert [r["flops"] for r in full] == [r["flops"] for r in steps]  # the ledger resumes with the run
    total = 0
    for r in full:
        total += r["flops_generate"] + r["flops_update"]
        assert r["flops"] == total and all(r[k] >= 0 for k in ("s_rollout", "s_scoring", "s_update"))
    check(steps, final, tmp_path)
