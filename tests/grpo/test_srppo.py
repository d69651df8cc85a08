"""SR-PPO (`grpo.advantage = "srppo"`): its advantages by hand and their sum on random rows, pass@k tending to
reachability on a FrozenLake map enumerated whole, the success head's cross-entropy update by hand, and a quick run."""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax.numpy as jnp
import numpy as np
import pytest

from esroll.grpo.advantages import Group, estimate
from esroll.grpo.estimators.srppo import SrPpoOptions, pass_at_k

LOGIT_08 = math.log(4.0)  # σ(log 4) = 0.8


def test_srppo_advantages_by_hand():
    """One completion of 3 tokens with p̂ = 0.5, 0.8, 0.2 before them. k = 1, success: A = 0.8 − 0.5, 0.2 − 0.8,
    1 − 0.2 = 0.3, −0.6, 0.8. k = 4, failure: q = 0.9375, 0.9984, 0.5904, A = 0.0609, −0.408, −0.5904. k = ∞ with the
    threshold 0.3, success: q = 1, 1, 0, A = 0, −1, 1. The success head's target is the outcome at every token."""
    logits = np.array([[[0.0, LOGIT_08, -LOGIT_08, 0.0]]])
    mask = np.array([[[1, 1, 1, 0]]], bool)
    won = estimate("srppo", Group(np.array([[1.0]]), token_mask=mask, values=logits), SrPpoOptions(k=1))
    np.testing.assert_allclose(won.advantage[0, 0], [0.3, -0.6, 0.8, 0], atol=1e-6)
    np.testing.assert_array_equal(won.returns[0, 0], [1, 1, 1, 0])
    assert won.metrics["value_prompt"] == pytest.approx(0.5)
    assert won.metrics["success_head_brier"] == pytest.approx((0.25 + 0.04 + 0.64) / 3)
    lost = estimate("srppo", Group(np.array([[0.0]]), token_mask=mask, values=logits), SrPpoOptions(k=4))
    np.testing.assert_allclose(lost.advantage[0, 0], [0.0609, -0.408, -0.5904, 0], atol=1e-6)
    np.testing.assert_array_equal(lost.returns[0, 0], [0, 0, 0, 0])
    reach = SrPpoOptions(k=math.inf, reach_threshold=0.3)
    inf = estimate("srppo", Group(np.array([[1.0]]), token_mask=mask, values=logits), reach)
    np.testing.assert_allclose(inf.advantage[0, 0], [0, -1, 1, 0], atol=1e-7)


@pytest.mark.parametrize("k", [1.0, 4.0, math.inf])
def test_srppo_advantages_sum_to_the_outcome_minus_the_first_q(k):
    """Σ_t A_t = outcome − q_k(s_0) on random rows whose generated tokens have gaps (an episode's environment tokens);
    a reward outside [0, 1] is clipped into it; an invalid row gets 0 and no target."""
    rng = np.random.default_rng(1)
    X, M, N = 3, 2, 12
    mask = rng.random((X, M, N)) < 0.6
    mask[..., 0] = True
    logits = rng.normal(0, 2, (X, M, N))
    rewards = rng.choice([0.0, 1.0, 1.5, -0.1], (X, M))
    valid = np.ones((X, M), bool)
    valid[2, 1] = False
    o = SrPpoOptions(k=k, reach_threshold=0.4)
    est = estimate("srppo", Group(rewards, valid=valid, token_mask=mask, values=logits), o)
    q0 = pass_at_k(1 / (1 + np.exp(-logits[..., 0])), k, 0.4)
    expected = np.where(valid, np.clip(rewards, 0, 1) - q0, 0.0)
    np.testing.assert_allclose(np.where(mask, est.advantage, 0).sum(-1), expected, atol=1e-5)
    assert not est.advantage[2, 1].any() and not est.returns[2, 1].any()
    np.testing.assert_array_equal(est.returns[valid], np.where(mask, np.clip(rewards, 0, 1)[..., None], 0)[valid])


def test_pass_at_k_tends_to_reachability_on_an_enumerated_frozenlake():
    """A 3 × 3 FrozenLake map, 4 turns, the uniform policy over the four moves: every action sequence is played, so
    P(success | the actions so far) is the share of its continuations that reach G, and reachability whether any
    does. pass@1 is P itself; pass@k rises with k, is within 1e-9 of reachability at k = 10⁴, and at k = ∞ (threshold
    0) equals it wherever it is."""
    from esroll.agents import make_env

    env = make_env("frozenlake", {"size": 3, "max_turns": 4})
    moves = env.actions
    won = {}
    for seq in itertools.product(range(4), repeat=4):
        env.reset(seed=7)
        reward = 0.0
        for a in seq:
            turn = env.step(moves[a])
            reward += turn.reward
            if turn.done:
                break
        won[seq] = reward > 0.5
    assert 0 < np.mean(list(won.values())) < 1  # a map the policy sometimes solves
    prefixes = [p for n in range(5) for p in itertools.product(range(4), repeat=n)]
    p = np.array([np.mean([w for s, w in won.items() if s[: len(pre)] == pre]) for pre in prefixes])
    reach = np.array([any(w for s, w in won.items() if s[: len(pre)] == pre) for pre in prefixes], float)
    assert 0 < reach.mean() < 1 and ((p > 0) & (p < 1)).any()
    np.testing.assert_allclose(pass_at_k(p, 1), p, atol=1e-12)
    assert np.all(pass_at_k(p, 4) >= pass_at_k(p, 2) - 1e-12) and np.all(pass_at_k(p, 2) >= p - 1e-12)
    np.testing.assert_allclose(pass_at_k(p, 1e4), reach, atol=1e-9)
    np.testing.assert_array_equal(pass_at_k(p, math.inf, 0.0), reach)


def test_the_success_heads_cross_entropy_update_by_hand(tmp_path):
    """`make_value_update(loss="logistic")` on a value head alone: one plain-SGD step (lr 1) moves w by
    −Σ (σ(v) − y)·h / n and b by −Σ (σ(v) − y) / n over the n positions read, y the 0/1 outcome; the loss is the mean
    of softplus(v) − y·v there (h from a cache-free forward of the policy)."""
    import optax

    from conftest import build_tiny_hf
    from esroll.critic import TRUNK, make_value_update
    from esroll.models import forward, load_hf
    from test_grpo import scored_rows

    build_tiny_hf("qwen3", tmp_path, initializer_range=0.2)
    cfg, params = load_hf(tmp_path)
    rng = np.random.default_rng(5)
    w = rng.normal(0, 0.3, (cfg.hidden_size, 1)).astype(np.float32)
    head = {"value_head": jnp.asarray(w), "value_bias": jnp.asarray([-0.2], jnp.float32)}
    prompt, prompt_mask, completion, completion_mask = scored_rows(cfg.vocab_size, rows=3)
    B, P, N = 3, prompt.shape[1], completion.shape[1]
    tokens, mask = np.concatenate([prompt, completion], 1), np.concatenate([prompt_mask, completion_mask], 1)
    h = np.asarray(forward(cfg, params, jnp.asarray(tokens), mask_BxT=jnp.asarray(mask), return_hidden=True)[0])
    v = h.astype(np.float64) @ w[:, 0] - 0.2
    at = np.zeros((B, P + N), bool)
    at[:, P - 1 : P - 1 + N] = completion_mask
    y = np.broadcast_to(np.array([1.0, 0.0, 1.0])[:, None], (B, P + N)).astype(np.float32)
    update = make_value_update(dataclasses.replace(cfg, head="value"), optax.sgd(1.0), None, loss="logistic")
    trunk = {k: params[k] for k in TRUNK}
    old = np.zeros((B, P + N), np.float32)  # not read by the cross-entropy
    new, _, loss = update(head, optax.sgd(1.0).init(head), tokens, mask, at, old, y, trunk=trunk)
    err = np.where(at, 1 / (1 + np.exp(-v)) - y, 0.0)
    n = at.sum()
    np.testing.assert_allclose(
        np.asarray(new["value_head"])[:, 0], w[:, 0] - (err[..., None] * h).sum((0, 1)) / n, atol=1e-5
    )
    np.testing.assert_allclose(np.asarray(new["value_bias"]), [-0.2 - err.sum() / n], atol=1e-5)
    bce = np.where(at, np.logaddexp(0, v) - y * v, 0.0).sum() / n
    assert float(loss) == pytest.approx(bce, rel=1e-4)


def test_srppo_options_are_checked():
    from esroll.config import ConfigError

    for bad in ({"k": 0.5}, {"reach_threshold": 1.0}, {"critic_lr": 0.0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            SrPpoOptions(**bad)


@pytest.mark.e2e
def test_the_shipped_srppo_config_trains_a_success_head(tmp_path):
    """configs/step_level.py:quick,srppo: one completion for each of 16 prompts a step, two steps; the success head
    starts at p̂ = 0.5 (a zero head), moves, and its cross-entropy is logged."""
    from conftest import shipped_config
    from configs import step_level
    from esroll.metrics import read_metrics
    from esroll.train import train_and_evaluate

    cfg = shipped_config(step_level.get_config, "quick,srppo")
    assert cfg.grpo.advantage == "srppo" and cfg.grpo.group_size == 1 and cfg.train.prompts_per_step == 16
    train_and_evaluate(cfg, tmp_path, progress=False)
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "value_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert steps[0]["value_prompt"] == pytest.approx(0.5) and steps[1]["value_prompt"] != pytest.approx(0.5)
    assert steps[0]["value_loss"] == pytest.approx(math.log(2), rel=1e-3)  # BCE of p̂ = 0.5 on 0/1 targets
    assert all(np.isfinite(r["success_head_brier"]) for r in steps)
