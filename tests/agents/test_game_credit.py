"""MemoPilot's per-round advantage and A2Agent's action-level credit on hand-built groups of episodes, each value
worked out by hand in the docstrings."""

from __future__ import annotations

import math

import numpy as np
import pytest

from esroll.agents import Turns
from esroll.grpo.advantages import Group
from esroll.grpo.estimators.a2agent import A2AgentOptions, a2agent
from esroll.grpo.estimators.memopilot import MemoPilotOptions, memopilot

N = 8  # tokens per row; turn t's action is token 2t


def _group(rewards, actions, valid=None):
    """One row per episode (prompt-major, rows of equal length per prompt given as a list of lists of lists)."""
    X, M = len(rewards), len(rewards[0])
    B, W = X * M, max(len(r) for g in rewards for r in g)
    start, end, reward = np.zeros((B, W), int), np.zeros((B, W), int), np.zeros((B, W))
    count = np.zeros(B, int)
    flat_actions = []
    for b, (rs, acts) in enumerate(zip((r for g in rewards for r in g), (a for g in actions for a in g))):
        count[b] = len(rs)
        for t, r in enumerate(rs):
            start[b, t], end[b, t], reward[b, t] = 2 * t, 2 * t + 1, r
        flat_actions.append(list(acts))
    turns = Turns(start, end, reward, count, [["s"] * W for _ in range(B)], flat_actions)
    mask = np.zeros((X, M, N), bool)
    for b in range(B):
        mask[b // M, b % M, : 2 * count[b]] = True
    outcome = np.array([[sum(r) for r in g] for g in rewards], np.float64)
    return Group(rewards=outcome, valid=valid, token_mask=mask, turns=turns)


def _at_turns(adv_XxMxN, b, M, count):
    return [float(adv_XxMxN[b // M, b % M, 2 * t]) for t in range(count)]


def test_memopilot_at_fixed_rounds():
    """Three episodes of one game, rounds rewarded (1, −1), (0, 1), (−1, 1). Round 0: rewards 1, 0, −1, mean 0,
    sample std 1: A = 1, 0, −1 (over 1 + 1e-4). Round 1: −1, 1, 1, mean 1/3: centred −4/3, 2/3, 2/3, sample std
    √(4/3). Only action tokens get it. A second game whose episodes played 2 and 1 rounds: its round 1 was played by
    one episode (0), and it is logged as ragged (1 group of 2)."""
    g = _group(
        [[[1, -1], [0, 1], [-1, 1]], [[1, 0], [0], [0]]],
        [[["rock"] * 2] * 3, [["rock"] * 2, ["rock"], ["rock"]]],
    )
    est = memopilot(g, MemoPilotOptions())
    d = 1 + 1e-4
    s = math.sqrt(4 / 3) + 1e-4
    want = [[1 / d, -4 / 3 / s], [0.0, 2 / 3 / s], [-1 / d, 2 / 3 / s]]
    for b in range(3):
        np.testing.assert_allclose(_at_turns(est.advantage, b, 3, 2), want[b], rtol=1e-6)
    assert not est.advantage[0, :, 1::2].any()  # observation tokens
    # game 2, round 0: 1, 0, 0 -> centred 2/3, -1/3, -1/3, sample std 1/sqrt(3); round 1: one episode -> 0
    s2 = 1 / math.sqrt(3) + 1e-4
    assert _at_turns(est.advantage, 3, 3, 2) == pytest.approx([2 / 3 / s2, 0.0])
    assert est.metrics["memopilot_ragged"] == 0.5
    plain = memopilot(g, MemoPilotOptions(std=False))
    assert _at_turns(plain.advantage, 0, 3, 2) == pytest.approx([1.0, -4 / 3])


def test_a2agent_with_overlapping_contexts_and_groups_of_one():
    """γ = 1, mean mode. Episodes: e0 look 1, look 2, answer 2 (rewards 0, 0.5, 1: returns 1.5, 1.5, 1); e1 look 1,
    answer 1 (0, 0: returns 0, 0); e2 look 2, answer 2 (0.5, 1: returns 1.5, 1). Episode comparison (k = 0): G_0 =
    1.5, 0, 1.5 less their mean 1: 0.5, −1, 0.5 on every turn of each. First turns share the empty context at k = 1
    and 2: the same 0.5, −1, 0.5. After "look 1": e0's turn 1 (1.5) and e1's (0), mean 0.75: ±0.75. After "look 2":
    e0's turn 2 and e2's turn 1, both return 1: comparisons of exactly 0, left out. k = 2 at e0's turn 2 (after look 1,
    look 2) is a group of one. Weighted by k + 1: e0 = 0.5, (1·0.5 + 2·0.75)/3 = 2/3, 0.5; e1 = −1,
    (1·(−1) + 2·(−0.75))/3 = −5/6; e2 = 0.5, 0.5. A second prompt with one valid episode has no comparison: 0."""
    g = _group(
        [[[0, 0.5, 1], [0, 0], [0.5, 1]], [[1], [0], [0]]],
        [[["look 1", "look 2", "answer 2"], ["Look 1", "answer 1"], ["look 2", "answer 2."]], [["answer 1"]] * 3],
        valid=np.array([[True, True, True], [True, False, False]]),
    )
    o = A2AgentOptions(gamma=1.0, objective="advantage")
    est = a2agent(g, o)
    assert _at_turns(est.advantage, 0, 3, 3) == pytest.approx([0.5, 2 / 3, 0.5])
    assert _at_turns(est.advantage, 1, 3, 2) == pytest.approx([-1.0, -5 / 6])
    assert _at_turns(est.advantage, 2, 3, 2) == pytest.approx([0.5, 0.5])
    assert not est.advantage[1].any() and est.token_weight is None
    assert est.metrics["a2agent_context_share"] == 1.0
    weighted = a2agent(g, A2AgentOptions(gamma=1.0))
    assert _at_turns(weighted.advantage, 1, 3, 2) == [1.0, 1.0]  # every action token reinforced...
    w = weighted.token_weight
    assert _at_turns(w, 0, 3, 3) == pytest.approx([math.exp(0.75), math.exp(1.0), math.exp(0.75)])  # ...weighted
    assert _at_turns(w, 1, 3, 2) == pytest.approx([math.exp(-1.5), math.exp(-1.25)])
    assert w[0, 0, 1] == 1.0 and _at_turns(w, 3, 3, 1) == [1.0]
    clipped = a2agent(g, A2AgentOptions(gamma=1.0, beta=10.0))
    assert _at_turns(clipped.token_weight, 0, 3, 1) == [3.0]
    assert _at_turns(clipped.token_weight, 1, 3, 1) == pytest.approx([0.1])
    assert not clipped.advantage[1, 1:].any()  # invalid episodes: no advantage


@pytest.mark.e2e
def test_the_games_train_by_name(tmp_path):
    """configs/agents.py:quick,rps,memopilot and quick,locate,a2agent take GRPO steps from the shipped games model
    (each estimator's figures logged), and rps,looroll,quick takes LOO-ROLL steps around the frozen player."""
    from configs import agents
    from conftest import shipped_config
    from esroll.metrics import read_metrics
    from esroll.train import train_and_evaluate

    for variant, key in (("quick,rps,memopilot", "memopilot_ragged"), ("quick,locate,a2agent", "a2agent_abs")):
        cfg = shipped_config(agents.get_config, variant)
        assert cfg.model.path.endswith("tiny-qwen3-games")
        train_and_evaluate(cfg, tmp_path / variant, progress=False)
        steps = [r for r in read_metrics(tmp_path / variant / "metrics.jsonl") if key in r]
        assert len(steps) == 2, variant
    assert all(r["memopilot_ragged"] == 0.0 for r in read_metrics(tmp_path / "quick,rps,memopilot" / "metrics.jsonl")
               if "memopilot_ragged" in r)  # fmt: skip
    es = shipped_config(agents.get_config, "rps,looroll,quick")
    train_and_evaluate(es, tmp_path / "es", progress=False)
    assert len([r for r in read_metrics(tmp_path / "es" / "metrics.jsonl") if "fitness_mean" in r]) == 2
