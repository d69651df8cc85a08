"""A2Agent's action-level credit (its authors' code, donian00/A2Agent `toolplan/training/advantage.py`): each turn's
discounted return is compared within every group of turns that acted after the same recent actions (the last k,
k = 1 .. `history`), and with an episode-level group, and the comparisons are averaged with weights ∝ k + 1. The
source trains by advantage-weighted fine-tuning on its own samples; `objective` chooses that or a policy gradient
with the averaged advantage. What it computes and what is chosen where the source leaves it open: docs/agents.md."""

from __future__ import annotations

import dataclasses

import numpy as np

from esroll.agents.base import action_word
from esroll.config import check_fields
from esroll.grpo.advantages import Estimate, Group, register_advantage, valid_rewards
from esroll.grpo.estimators.turns import discounted_returns, turn_tokens

OBJECTIVES = ("weighted", "advantage")
MODES = ("mean", "std")


@dataclasses.dataclass(frozen=True)
class A2AgentOptions:
    """`grpo.adv.a2agent.*`. gamma: the per-turn returns' discount (0.95); history: the longest action context k (2);
    mode: "mean" (a return less its group's mean, the source's default) or "std" (also divided by the group's
    population std + eps); eps; objective: "weighted" (the source's: every action token reinforced with advantage 1
    and weighted by clip(exp(beta·A), weight_min, weight_max)) or "advantage" (A itself as the advantage, no weight);
    beta (1.5), weight_min (0.1), weight_max (3)."""

    gamma: float = 0.95
    history: int = 2
    mode: str = "mean"
    eps: float = 1e-6
    objective: str = "weighted"
    beta: float = 1.5
    weight_min: float = 0.1
    weight_max: float = 3.0

    def __post_init__(self):
        checks = [
            ("gamma", 0 <= self.gamma <= 1, "in [0, 1]"),
            ("history", self.history >= 1, ">= 1"),
            ("mode", self.mode in MODES, " or ".join(MODES)),
            ("eps", self.eps > 0, "> 0"),
            ("objective", self.objective in OBJECTIVES, " or ".join(OBJECTIVES)),
            ("weight_min", 0 <= self.weight_min <= self.weight_max, f"in [0, weight_max = {self.weight_max}]"),
        ]
        check_fields(self, checks, "A2AgentOptions")


def _compare(values: np.ndarray, mode: str, eps: float) -> np.ndarray:
    centred = values - values.mean()
    return centred / (values.std() + eps) if mode == "std" else centred


def action_advantages(returns_BxW, count_B, actions, rows, o: A2AgentOptions) -> np.ndarray:
    """[B, W] A of each turn of the episodes `rows` (one group): the weighted mean, weights ∝ k + 1, of its non-zero
    comparisons: the episode's (k = 0: its return G_0 against the rows' G_0, each episode once) and, for each
    k = 1 .. `history`, its G_t against the turns whose k previous action words equal its own (turn t ≥ k; every
    first turn shares the empty context at every k, as in the source). A group of one gives no comparison; a
    comparison of exactly 0 is left out, as the source leaves it."""
    items: dict[tuple[int, int], list[tuple[int, float]]] = {}
    first = np.array([returns_BxW[b, 0] for b in rows], np.float64)
    if len(rows) > 1:
        for b, a in zip(rows, _compare(first, o.mode, o.eps)):
            for t in range(int(count_B[b])):
                items.setdefault((b, t), []).append((0, a))
    for k in range(1, o.history + 1):
        groups: dict[tuple, list[tuple[int, int]]] = {}
        for b in rows:
            words = [action_word(a) for a in actions[b]]
            for t in range(int(count_B[b])):
                if 0 < t < k:
                    continue
                groups.setdefault(tuple(words[t - k : t]) if t else (), []).append((b, t))
        for members in groups.values():
            if len(members) > 1:
                values = _compare(np.array([returns_BxW[b, t] for b, t in members]), o.mode, o.eps)
                for (b, t), a in zip(members, values):
                    items.setdefault((b, t), []).append((k, a))
    out = np.zeros(returns_BxW.shape)
    for (b, t), found in items.items():
        kept = [(k, a) for k, a in found if a != 0]
        if kept:
            w = np.array([k + 1.0 for k, _ in kept])
            out[b, t] = float(np.dot(w / w.sum(), [a for _, a in kept]))
    return out


def a2agent(g: Group, o: A2AgentOptions, state=None) -> Estimate:
    """Per-token advantages on each turn's action tokens from `action_advantages`, group by group over the valid
    episodes. objective "weighted": advantage 1 with token weight clip(exp(beta·A), weight_min, weight_max) (the
    source's weighted fine-tuning); "advantage": A, token weights 1. Invalid episodes get 0. Logs
    `a2agent_context_share` (the share of turns after the first compared within some context of k ≥ 1) and
    `a2agent_abs` (mean |A| over turns)."""
    _, valid = valid_rewards(g)
    X, M = valid.shape
    turns = g.turns
    returns = discounted_returns(turns.reward_BxW, turns.count_B, o.gamma)
    A = np.zeros_like(returns)
    for x in range(X):
        rows = [x * M + j for j in np.flatnonzero(valid[x])]
        A += action_advantages(returns, turns.count_B, turns.actions, rows, o)
    played = (np.arange(A.shape[1])[None, :] < np.asarray(turns.count_B)[:, None]) & valid.reshape(-1, 1)
    later = played & (np.arange(A.shape[1])[None, :] > 0)
    shared = np.zeros_like(played)
    for x in range(X):  # the turns after the first whose k = 1 context another turn of the group shares
        rows = [x * M + j for j in np.flatnonzero(valid[x])]
        seen: dict[str, int] = {}
        for b in rows:
            for t in range(1, int(turns.count_B[b])):
                key = action_word(turns.actions[b][t - 1])
                seen[key] = seen.get(key, 0) + 1
        for b in rows:
            for t in range(1, int(turns.count_B[b])):
                shared[b, t] = seen[action_word(turns.actions[b][t - 1])] > 1
    metrics = {
        "a2agent_context_share": float(shared[later].mean()) if later.any() else 0.0,
        "a2agent_abs": float(np.abs(A[played]).mean()) if played.any() else 0.0,
    }
    if o.objective == "advantage":
        return Estimate(turn_tokens(g, np.where(played, A, 0.0)), metrics=metrics)
    weight = np.clip(np.exp(o.beta * A), o.weight_min, o.weight_max)
    token_weight = turn_tokens(g, np.where(played, weight - 1.0, 0.0)) + 1.0  # 1 off the actions
    return Estimate(turn_tokens(g, played.astype(np.float64)), token_weight=token_weight, metrics=metrics)


register_advantage("a2agent", a2agent, options=A2AgentOptions, needs=("turns",))
