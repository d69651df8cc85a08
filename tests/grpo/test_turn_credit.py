"""Turn-level credit on hand-built groups of episodes (`esroll.grpo.estimators.turns`): discounted per-turn returns and
GiGPO's episode plus anchor-state advantages, every expected value worked out by hand below, with episodes of
different lengths, anchor groups of one, an invalid episode and a group with a single valid episode."""

from __future__ import annotations

import math

import numpy as np
import pytest

from esroll.config import ConfigError
from esroll.grpo.advantages import Group, estimate
from esroll.grpo.estimators.turns import DiscountedOptions, GigpoOptions, discounted_returns
from esroll.agents.multiturn import Turns

N = 12
EPS = 1e-4


def hand_group() -> Group:
    """Two groups of three episodes (rows prompt-major), W = 3 turn slots.

    Group 0: row 0 plays 3 turns from states A, B, C with rewards 0, 0, 1 (return 1), actions at tokens [0, 2),
    [5, 7), [10, 12); row 1 plays 2 turns from A, D with rewards 0, 0 (return 0), actions at [0, 2), [5, 6); row 2
    plays 2 turns from A, B with rewards 0, 1 (return 1), actions at [0, 1), [4, 6).
    Group 1: row 3 plays 1 turn from A with reward 1; rows 4 and 5 are invalid (non-finite rewards)."""
    start = np.array([[0, 5, 10], [0, 5, 0], [0, 4, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]])
    end = np.array([[2, 7, 12], [2, 6, 0], [1, 6, 0], [3, 0, 0], [2, 0, 0], [2, 0, 0]])
    reward = np.array([[0, 0, 1], [0, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0]], np.float32)
    count = np.array([3, 2, 2, 1, 1, 1])
    states = [["A", "B", "C"], ["A", "D"], ["A", "B"], ["A"], ["A"], ["A"]]
    rewards = np.array([[1.0, 0.0, 1.0], [1.0, np.nan, np.nan]])
    mask = np.zeros((6, N), bool)
    for b in range(6):
        mask[b, : end[b].max()] = True
    return Group(rewards, token_mask=mask.reshape(2, 3, N), turns=Turns(start, end, reward, count, states))


def spans(values: dict[tuple[int, int], float]) -> np.ndarray:
    """[2, 3, N]: the action tokens of (row, turn) get values[(row, turn)], with the hand-built spans."""
    g = hand_group()
    out = np.zeros((6, N))
    for (b, t), v in values.items():
        out[b, g.turns.start_BxW[b, t] : g.turns.end_BxW[b, t]] = v
    return out.reshape(2, 3, N)


def gigpo_spans(a_e: np.ndarray, a_A: np.ndarray, a_B: np.ndarray) -> np.ndarray:
    """[2, 3, N]: group 0's action tokens under GiGPO, each turn its episode's advantage a_e[row] plus its anchor
    group's (A: the first turns of rows 0, 1, 2; B: the second turns of rows 0 and 2; C and D alone: 0); group 1: 0."""
    return spans(
        {
            (0, 0): a_e[0] + a_A[0],
            (0, 1): a_e[0] + a_B[0],
            (0, 2): a_e[0],
            (1, 0): a_e[1] + a_A[1],
            (1, 1): a_e[1],
            (2, 0): a_e[2] + a_A[2],
            (2, 1): a_e[2] + a_B[1],
        }
    )


def test_discounted_returns_by_hand():
    """γ = 0.5: G_t = r_t + γ·G_{t+1}, 0 past an episode's turns."""
    g = hand_group()
    G = discounted_returns(g.turns.reward_BxW, g.turns.count_B, 0.5)
    np.testing.assert_allclose(G[:3], [[0.25, 0.5, 1.0], [0.0, 0.0, 0.0], [0.5, 1.0, 0.0]])
    np.testing.assert_allclose(G[3], [1.0, 0.0, 0.0])


@pytest.mark.parametrize("std", [True, False])
def test_gigpo_by_hand(std):
    """γ = 0.5, ω = 1. Episode advantages of group 0: returns 1, 0, 1, mean 2/3, sample std √(1/3). Anchor A holds
    the first turns of rows 0, 1, 2 (returns 0.25, 0, 0.5: mean 0.25, sample std 0.25); anchor B the second turns
    of rows 0 and 2 (0.5 and 1: mean 0.75, sample std √0.125); C and D hold one turn each: 0. Group 1 has one valid
    episode: its advantage and its turn's are 0, and the invalid rows get nothing."""
    g = hand_group()
    div = (lambda s: s + EPS) if std else (lambda s: 1.0)
    a_e = np.array([1 / 3, -2 / 3, 1 / 3]) / div(math.sqrt(1 / 3))
    a_A = np.array([0.0, -0.25, 0.25]) / div(0.25)
    a_B = np.array([-0.25, 0.25]) / div(math.sqrt(0.125))
    expected = gigpo_spans(a_e, a_A, a_B)
    out = estimate("gigpo", g, GigpoOptions(gamma=0.5, omega=1.0, std=std))
    np.testing.assert_allclose(out.advantage, expected, rtol=1e-5, atol=1e-6)
    # 8 valid turns (7 in group 0, 1 in group 1); A and B hold 5 of them, in groups of 3 and 2.
    assert out.metrics["gigpo_anchor_share"] == pytest.approx(5 / 8)
    assert out.metrics["gigpo_anchor_size"] == pytest.approx(2.5)


def test_gigpo_episode_stats_over_turns_by_hand():
    """`episode_stats = "turns"`, eps 1e-6 (verl-agent's defaults), γ = 0.5, ω = 1. Group 0's episodes (returns 1,
    0, 1) played 3, 2 and 2 turns, so the episode statistics are over the 7 values 1, 1, 1, 0, 0, 1, 1: mean 5/7,
    deviations 2/7 (five times) and −5/7 (twice), sample variance (5·4/49 + 2·25/49) / 6 = 5/21. The turn advantages
    are the anchor groups' as in `test_gigpo_by_hand`, with eps 1e-6. Group 1's single valid episode (one turn): 0.
    Counted once per episode (the default) the episode advantages would be (1/3, −2/3, 1/3) / √(1/3)."""
    g = hand_group()
    eps = 1e-6
    a_e = np.array([2 / 7, -5 / 7, 2 / 7]) / (math.sqrt(5 / 21) + eps)
    a_A = np.array([0.0, -0.25, 0.25]) / (0.25 + eps)
    a_B = np.array([-0.25, 0.25]) / (math.sqrt(0.125) + eps)
    expected = gigpo_spans(a_e, a_A, a_B)
    out = estimate("gigpo", g, GigpoOptions(gamma=0.5, omega=1.0, episode_stats="turns", eps=eps))
    np.testing.assert_allclose(out.advantage, expected, rtol=1e-6, atol=1e-7)
    episodes = estimate("gigpo", g, GigpoOptions(gamma=0.5, omega=0.0, eps=eps)).advantage
    np.testing.assert_allclose(episodes[0, 1, 0], -2 / 3 / (math.sqrt(1 / 3) + eps), rtol=1e-6)
    with pytest.raises(ConfigError, match="episode_stats"):
        GigpoOptions(episode_stats="steps")


def test_gigpo_omega_weights_the_turn_advantage():
    """ω = 0 leaves the episode advantage on every action token of the episode (GRPO's, per turn)."""
    g = hand_group()
    a_e = np.array([1 / 3, -2 / 3, 1 / 3]) / (math.sqrt(1 / 3) + EPS)
    expected = spans({(0, 0): a_e[0], (0, 1): a_e[0], (0, 2): a_e[0], (1, 0): a_e[1], (1, 1): a_e[1]})
    expected += spans({(2, 0): a_e[2], (2, 1): a_e[2]})
    out = estimate("gigpo", g, GigpoOptions(gamma=0.5, omega=0.0))
    np.testing.assert_allclose(out.advantage, expected, rtol=1e-5, atol=1e-6)


def test_discounted_by_hand():
    """γ = 0.5: group 0's seven turn returns 0.25, 0.5, 1 | 0, 0 | 0.5, 1 normalised together (mean 3.25/7); group 1
    has one valid turn: 0."""
    g = hand_group()
    G = {(0, 0): 0.25, (0, 1): 0.5, (0, 2): 1.0, (1, 0): 0.0, (1, 1): 0.0, (2, 0): 0.5, (2, 1): 1.0}
    values = np.array(list(G.values()))
    mean = 3.25 / 7
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / 6)
    expected = spans({k: (v - mean) / (std + EPS) for k, v in G.items()})
    out = estimate("discounted", g, DiscountedOptions(gamma=0.5))
    np.testing.assert_allclose(out.advantage, expected, rtol=1e-5, atol=1e-6)
    plain = estimate("discounted", g, DiscountedOptions(gamma=0.5, std=False))
    np.testing.assert_allclose(plain.advantage, spans({k: v - mean for k, v in G.items()}), rtol=1e-5, atol=1e-6)


def alike_group() -> Group:
    """One group of two alike episodes (every turn invalid, reward −0.1 each, the state repeated: "S"), and one of two
    that differ (rewards 0, 1 and 0, 0), W = 2 turn slots, each action one token at 0 and 1."""
    start = np.array([[0, 1]] * 4)
    end = start + 1
    reward = np.array([[-0.1, -0.1], [-0.1, -0.1], [0, 1], [0, 0]], np.float32)
    count = np.array([2, 2, 2, 2])
    states = [["S", "S"], ["S", "S"], ["A", "B"], ["A", "C"]]
    rewards = np.array([[-0.2, -0.2], [1.0, 0.0]])
    mask = np.zeros((4, 2), bool)
    mask[:, :2] = True
    return Group(rewards, token_mask=mask.reshape(2, 2, 2), turns=Turns(start, end, reward, count, states))


def test_zero_alike_silences_a_group_of_identical_episodes_and_only_that_group():
    g = alike_group()
    # Without it, `discounted` (γ 1, std off) credits the alike group by position: returns −0.2, −0.1 for both
    # episodes, mean −0.15, so the first turns get −0.05 and the second +0.05.
    plain = estimate("discounted", g, DiscountedOptions(gamma=1.0, std=False)).advantage
    np.testing.assert_allclose(plain[0], [[-0.05, 0.05], [-0.05, 0.05]], atol=1e-6)
    zeroed = estimate("discounted", g, DiscountedOptions(gamma=1.0, std=False, zero_alike=True)).advantage
    np.testing.assert_array_equal(zeroed[0], 0.0)
    # The other group, by hand: returns (1, 1) and (0, 0), mean 0.5: ±0.5 on every turn; the option leaves it alone.
    np.testing.assert_allclose(zeroed[1], [[0.5, 0.5], [-0.5, -0.5]], atol=1e-6)
    np.testing.assert_allclose(plain[1], zeroed[1])
    # GiGPO (std off): the repeated state S is one anchor group of four turns with returns −0.2, −0.1, −0.2, −0.1:
    # ±0.05 by position; with the option, 0.
    g_plain = estimate("gigpo", g, GigpoOptions(gamma=1.0, std=False)).advantage
    np.testing.assert_allclose(g_plain[0], [[-0.05, 0.05], [-0.05, 0.05]], atol=1e-6)
    g_zero = estimate("gigpo", g, GigpoOptions(gamma=1.0, std=False, zero_alike=True)).advantage
    np.testing.assert_array_equal(g_zero[0], 0.0)
    np.testing.assert_allclose(g_zero[1], g_plain[1])
