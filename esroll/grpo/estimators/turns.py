"""Turn-level credit for multi-turn episodes (`esroll.agents`): discounted per-turn returns normalised over the
group (`discounted`), and GiGPO's two-level groups (`gigpo`): the episode's group advantage plus, for each turn, the
turn's discounted return against the turns of the group's episodes that acted from the same state.

Both read `Group.turns` (`esroll.agents.Turns`: each episode's per-turn rewards, action spans and the observation
each action answered) and give each action token its turn's advantage; the environment's tokens get none (the
rollout's loss mask). Turns are grouped by their state, never by turn index alone: when the policy decides how long
an episode runs, the t-th turns of different episodes are not comparable (docs/agents.md). What each computes, and
what its source leaves open: docs/agents.md.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from esroll.config import check_fields
from esroll.grpo.advantages import Estimate, Group, register_advantage, valid_rewards

EPS = 1e-4  # as GRPO's group std (TRL)


def discounted_returns(reward_BxW: np.ndarray, count_B: np.ndarray, gamma: float) -> np.ndarray:
    """[B, W] each turn's discounted return, G_t = r_t + γ·G_{t+1} over the episode's `count` turns; 0 past them."""
    B, W = reward_BxW.shape
    inside = np.arange(W)[None, :] < np.asarray(count_B)[:, None]
    rewards = np.where(inside, np.asarray(reward_BxW, np.float64), 0.0)
    returns, later = np.zeros((B, W)), np.zeros(B)
    for t in range(W - 1, -1, -1):
        later = rewards[:, t] + gamma * later
        returns[:, t] = later
    return np.where(inside, returns, 0.0)


def normalise(values: np.ndarray, std: bool, eps: float = EPS, counts: np.ndarray | None = None) -> np.ndarray:
    """values − their mean, divided by (their sample std + eps) when `std`; 0 when fewer than 2 values are counted.
    With `counts`, value i is counted counts[i] times in the mean and the std (ddof 1 over the counted values)."""
    values = np.asarray(values, np.float64)
    weights = np.ones_like(values) if counts is None else np.asarray(counts, np.float64)
    n = weights.sum()
    if n < 2:
        return np.zeros_like(values)
    centred = values - np.sum(weights * values) / n
    return centred / (np.sqrt(np.sum(weights * centred**2) / (n - 1)) + eps) if std else centred


def alike_groups(g: Group, valid_XxM: np.ndarray) -> np.ndarray:
    """[X] bool: the groups whose valid episodes (two or more) all played the same number of turns with the same
    reward at every turn, so that no episode did better than another."""
    X, M = valid_XxM.shape
    turns = g.turns
    out = np.zeros(X, bool)
    for x in range(X):
        rows = [x * M + j for j in np.flatnonzero(valid_XxM[x])]
        seqs = {tuple(np.asarray(turns.reward_BxW[b, : int(turns.count_B[b])], np.float64).tolist()) for b in rows}
        out[x] = len(rows) >= 2 and len(seqs) == 1
    return out


def turn_tokens(g: Group, value_BxW: np.ndarray, plus_B: np.ndarray | float = 0.0) -> np.ndarray:
    """[X, M, N] float32: the action tokens of turn t of row b get value[b, t] + plus[b]; every other token 0."""
    X, M = g.rewards.shape
    N = g.token_mask.shape[2]
    turns = g.turns
    out = np.zeros((X * M, N))
    plus = np.broadcast_to(np.asarray(plus_B, np.float64), (X * M,))
    for b in range(X * M):
        for t in range(int(turns.count_B[b])):
            out[b, turns.start_BxW[b, t] : turns.end_BxW[b, t]] = value_BxW[b, t] + plus[b]
    return out.reshape(X, M, N).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class DiscountedOptions:
    """`grpo.adv.discounted.*`. gamma: the discount of the per-turn returns; std: divide by the group's std;
    zero_alike: give 0 to a group whose episodes all got the same reward at every turn (`alike_groups`), where the
    normalised returns would differ only by each turn's position (docs/agents.md)."""

    gamma: float = 0.95
    std: bool = True
    zero_alike: bool = False

    def __post_init__(self):
        check_fields(self, [("gamma", 0 <= self.gamma <= 1, "in [0, 1]")], "DiscountedOptions")


def discounted(g: Group, o: DiscountedOptions, state=None) -> Estimate:
    """Per-token advantages: each turn's discounted return (`discounted_returns`), normalised over every turn of the
    group's valid episodes ((G − mean) / (sample std + 1e-4), or G − mean without `std`), on the turn's action
    tokens. An invalid episode gets 0; with `zero_alike`, so does every episode of an alike group."""
    _, valid = valid_rewards(g)
    X, M = valid.shape
    turns = g.turns
    returns = discounted_returns(turns.reward_BxW, turns.count_B, o.gamma)
    counted = valid & ~alike_groups(g, valid)[:, None] if o.zero_alike else valid
    played = (np.arange(returns.shape[1])[None, :] < np.asarray(turns.count_B)[:, None]) & counted.reshape(-1, 1)
    value = np.zeros_like(returns)
    for x in range(X):
        rows = slice(x * M, (x + 1) * M)
        value[rows][played[rows]] = normalise(returns[rows][played[rows]], o.std)
    return Estimate(turn_tokens(g, value))


EPISODE_STATS = ("episodes", "turns")


@dataclasses.dataclass(frozen=True)
class GigpoOptions:
    """`grpo.adv.gigpo.*`. gamma: the discount of the per-turn returns; omega: the weight of the turn advantage
    beside the episode's; std: divide by the group's std at both levels (GiGPO's mean-std mode; False: mean only);
    episode_stats: what the episode advantage's mean and std are taken over, "episodes" (each episode once, the
    paper's Eq. 3) or "turns" (each episode once per turn it played, as verl-agent's `core_gigpo.py` with its
    default `compute_mean_std_cross_steps=True`); eps: added to the std (verl-agent: 1e-6); zero_alike: give 0 to a
    group whose episodes all got the same reward at every turn (`alike_groups`): its anchor groups would otherwise
    compare the returns of one repeated state at different turn positions (docs/agents.md)."""

    gamma: float = 0.95
    omega: float = 1.0
    std: bool = True
    episode_stats: str = "episodes"
    eps: float = EPS
    zero_alike: bool = False

    def __post_init__(self):
        checks = [
            ("gamma", 0 <= self.gamma <= 1, "in [0, 1]"),
            ("omega", self.omega >= 0, ">= 0"),
            ("episode_stats", self.episode_stats in EPISODE_STATS, f"one of {', '.join(EPISODE_STATS)}"),
            ("eps", self.eps > 0, "> 0"),
        ]
        check_fields(self, checks, "GigpoOptions")


def gigpo(g: Group, o: GigpoOptions, state=None) -> Estimate:
    """Per-token advantages A_E + ω·A_S. A_E, the episode advantage: the return normalised over the group's valid
    episodes, each counted once or once per turn (`episode_stats`). A_S, the turn advantage: the group's turns (over
    its valid episodes) are grouped by their anchor state,
    the exact observation text each action answered; a turn's discounted return (`discounted_returns`) is
    normalised over its anchor group, and a turn whose state no other turn of the group shares gets 0. Logs
    `gigpo_anchor_share` (the share of turns in an anchor group of two or more) and `gigpo_anchor_size` (their mean
    group size). With `zero_alike`, an alike group's episodes get 0."""
    r, valid = valid_rewards(g)
    X, M = r.shape
    if o.zero_alike:
        valid = valid & ~alike_groups(g, valid)[:, None]
    turns = g.turns
    returns = discounted_returns(turns.reward_BxW, turns.count_B, o.gamma)
    episode = np.zeros((X, M))
    step = np.zeros_like(returns)
    shared, sizes, total = 0, [], 0
    for x in range(X):
        rows = np.flatnonzero(valid[x])
        counts = np.asarray(turns.count_B)[x * M + rows] if o.episode_stats == "turns" else None
        episode[x, rows] = normalise(r[x, rows], o.std, o.eps, counts)
        anchors: dict[str, list[tuple[int, int]]] = {}
        for j in rows:
            b = x * M + j
            for t in range(int(turns.count_B[b])):
                anchors.setdefault(turns.states[b][t], []).append((b, t))
        for members in anchors.values():
            total += len(members)
            if len(members) >= 2:
                shared += len(members)
                sizes.append(len(members))
                values = normalise(np.array([returns[b, t] for b, t in members]), o.std, o.eps)
                for (b, t), v in zip(members, values):
                    step[b, t] = v
    metrics = {"gigpo_anchor_share": shared / max(total, 1), "gigpo_anchor_size": float(np.mean(sizes or [0]))}
    episode_B = np.where(valid, episode, 0.0).reshape(-1)
    return Estimate(turn_tokens(g, o.omega * step, episode_B), metrics=metrics)


register_advantage("discounted", discounted, options=DiscountedOptions, needs=("turns",))
register_advantage("gigpo", gigpo, options=GigpoOptions, needs=("turns",))
