"""HyGAE (`grpo.advantage = "hygae"`): the turn level and the mix by hand on a two-turn × two-token episode, PPO's
GAE at α = 0, invalid episodes, its options, and a quick agent run training its critic."""

from __future__ import annotations

import numpy as np
import pytest

from esroll.agents.multiturn import Turns
from esroll.config import ConfigError
from esroll.grpo.advantages import Group, estimate
from esroll.grpo.estimators.gae import GaeOptions
from esroll.grpo.estimators.hygae import HyGaeOptions


def _episode():
    """One episode: turn 1's action at tokens 0-1 (reward 0.2), the environment's answer at 2-3, turn 2's action at
    4-5 (reward 1); the critic's values 0.2, 0.3 and 0.5, 0.6 before the action tokens (9 where none is read)."""
    turns = Turns(np.array([[0, 4]]), np.array([[2, 6]]), np.array([[0.2, 1.0]]), np.array([2]), [["s0", "s1"]])
    return Group(
        np.array([[1.2]]),
        token_mask=np.array([[[1, 1, 0, 0, 1, 1]]], bool),
        values=np.array([[[0.2, 0.3, 9, 9, 0.5, 0.6]]]),
        turns=turns,
    )


def test_hygae_on_two_turns_of_two_tokens_by_hand():
    """γ = λ = 0.5. Turn level (e_1 = token 1, e_2 = token 5, L_2 = 2): A_2 = 1 − 0.6 = 0.4; A_1 = 0.2 + 0.5²·0.6 − 0.3
    + 0.5²·0.5·0.4 = 0.1; returns 1.0 at token 5 and 0.5·1.0 at 4, 0.1 + 0.3 = 0.4 at 1 and 0.2 at 0. Token level
    (GAE over tokens 0, 1, 4, 5): A = −0.01875, 0.125, −0.1, 0.4, returns 0.18125, 0.425, 0.4, 1.0. At α = 0.5 the
    means of the two."""
    g = _episode()
    turn = estimate("hygae", g, HyGaeOptions(gamma=0.5, lam=0.5, alpha=1.0, whiten=False))
    np.testing.assert_allclose(turn.advantage[0, 0], [0.1, 0.1, 0, 0, 0.4, 0.4], atol=1e-7)
    np.testing.assert_allclose(turn.returns[0, 0], [0.2, 0.4, 0, 0, 0.5, 1.0], atol=1e-12)
    hybrid = estimate("hygae", g, HyGaeOptions(gamma=0.5, lam=0.5, alpha=0.5, whiten=False))
    np.testing.assert_allclose(hybrid.advantage[0, 0], [0.040625, 0.1125, 0, 0, 0.15, 0.4], atol=1e-7)
    np.testing.assert_allclose(hybrid.returns[0, 0], [0.190625, 0.4125, 0, 0, 0.45, 1.0], atol=1e-12)
    assert hybrid.metrics["value_prompt"] == pytest.approx(0.2)
    # λ = 1, γ = 1: the turn level is the return to go minus V(e_i): 1.2 − 0.3 and 1 − 0.6
    plain = estimate("hygae", g, HyGaeOptions(gamma=1.0, lam=1.0, alpha=1.0, whiten=False))
    np.testing.assert_allclose(plain.advantage[0, 0], [0.9, 0.9, 0, 0, 0.4, 0.4], atol=1e-7)


def _random_episodes(rng, X=3, M=4, W=4, N=40):
    """Episodes of 1-W turns, each action 1-3 tokens followed by 2 environment tokens, random values and rewards."""
    B = X * M
    start, end = np.zeros((B, W), int), np.zeros((B, W), int)
    count = rng.integers(1, W + 1, B)
    mask = np.zeros((B, N), bool)
    for b in range(B):
        at = 0
        for w in range(count[b]):
            n = int(rng.integers(1, 4))
            start[b, w], end[b, w] = at, at + n
            mask[b, at : at + n] = True
            at += n + 2
    reward = np.where(np.arange(W)[None] < count[:, None], rng.normal(size=(B, W)), 0.0)
    turns = Turns(start, end, reward, count, [["s"] * int(c) for c in count])
    valid = rng.random((X, M)) > 0.2
    return Group(
        reward.sum(1).reshape(X, M),
        valid=valid,
        token_mask=mask.reshape(X, M, N),
        values=rng.normal(size=(X, M, N)),
        turns=turns,
    )


@pytest.mark.parametrize("whiten", [False, True])
def test_hygae_at_alpha_zero_is_ppos_gae(whiten):
    """At α = 0 the advantages and the critic's targets are those of `grpo.advantage = "gae"` at the same γ and λ, on
    random episodes with invalid rows (which get 0)."""
    rng = np.random.default_rng(0)
    g = _random_episodes(rng)
    hy = estimate("hygae", g, HyGaeOptions(gamma=0.9, lam=0.7, alpha=0.0, whiten=whiten))
    ppo = estimate("gae", g, GaeOptions(gamma=0.9, lam=0.7, whiten=whiten))
    np.testing.assert_allclose(hy.advantage, ppo.advantage, atol=1e-6)
    np.testing.assert_allclose(hy.returns, ppo.returns, atol=1e-12)
    assert not hy.advantage[~g.valid].any() and not hy.returns[~g.valid].any()
    mixed = estimate("hygae", g, HyGaeOptions(gamma=0.9, lam=0.7, alpha=0.5, whiten=False))
    assert not mixed.advantage[~g.valid].any() and np.abs(mixed.advantage[g.valid]).sum() > 0
    assert np.isfinite(mixed.metrics["turn_token_corr"])


def test_hygae_options_and_runs_are_checked():
    """alpha outside [0, 1] and a run without episodes are refused, each naming its key."""
    from esroll.config import from_config_dict
    from esroll.experiment import check_names
    from esroll.grpo.method import check_config

    with pytest.raises(ConfigError, match="alpha"):
        HyGaeOptions(alpha=1.5)
    with pytest.raises(ConfigError, match="critic_path"):
        HyGaeOptions(shared_trunk=True, critic_path="x")
    with pytest.raises(ConfigError, match=r"grpo\.advantage"):
        check_config(check_names(from_config_dict({"method": "grpo", "grpo": {"advantage": "hygae"}})))


@pytest.mark.e2e
def test_the_shipped_hygae_config_trains_a_critic(tmp_path):
    """configs/agents.py:quick,hygae: two steps on FrozenLake episodes; the critic's values move off their zero start
    and its loss and the two levels' correlation are logged."""
    from conftest import shipped_config
    from configs import agents
    from esroll.metrics import read_metrics
    from esroll.train import train_and_evaluate

    cfg = shipped_config(agents.get_config, "quick,hygae")
    assert cfg.method == "grpo" and cfg.grpo.advantage == "hygae" and cfg.env.name == "frozenlake"
    train_and_evaluate(cfg, tmp_path, progress=False)
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "value_loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and steps[0]["value_prompt"] == 0.0 and steps[1]["value_prompt"] != 0.0
    assert all(np.isfinite(r["value_loss"]) and r["value_loss"] >= 0 for r in steps)
