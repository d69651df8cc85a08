"""RePro's retrospective credit (forward-then-reflect): after each episode the agent rates the progress of each of its
moves, given the finished episode and its outcome (`esroll.agents.reflect`, `env.reflect_tokens`); the ratings
become the moves' credit beside the episode's group advantage, and the reflection itself is trained toward ratings
that agree with the outcome. The source's abstract fixes the pattern, not the formulas; ours, and what each term is
for: docs/agents.md."""

from __future__ import annotations

import dataclasses

import numpy as np

from esroll.agents.reflect import parse_ratings
from esroll.config import check_fields
from esroll.grpo.advantages import Estimate, Group, register_advantage, valid_rewards
from esroll.grpo.estimators.turns import EPS, normalise, turn_tokens


@dataclasses.dataclass(frozen=True)
class ReproOptions:
    """`grpo.adv.repro.*`. omega: the weight of the ratings' credit beside the episode advantage; reflect_weight: the
    weight of the reflection's own advantage; std: divide by the sample std (+ eps) at every level, as GRPO's group
    std; eps."""

    omega: float = 1.0
    reflect_weight: float = 1.0
    std: bool = True
    eps: float = EPS

    def __post_init__(self):
        checks = [
            ("omega", self.omega >= 0, ">= 0"),
            ("reflect_weight", self.reflect_weight >= 0, ">= 0"),
            ("eps", self.eps > 0, "> 0"),
        ]
        check_fields(self, checks, "ReproOptions")


def reflection_reward(ratings: list[int] | None, solved: bool) -> float:
    """The reflection's reward: −1 when its ratings do not parse; else 1 when their sum agrees with the outcome
    (positive for a solved episode, not positive for a failed one), 0 when it does not."""
    if ratings is None:
        return -1.0
    return 1.0 if (sum(ratings) > 0) == bool(solved) else 0.0


def repro(g: Group, o: ReproOptions, state=None) -> Estimate:
    """Per-token advantages. Each action token of turn t of episode i gets A_E(i) + ω·S(i, t): A_E the return
    normalised over the group's valid episodes (GRPO's), S the turn's rating normalised over every rated turn of the
    group's valid episodes whose reflection parsed (0 for an episode whose reflection did not, and for all when
    fewer than two turns are rated). Each reflection token of episode i gets reflect_weight · the reflection's
    reward (`reflection_reward`) normalised over the group's valid episodes. An invalid episode gets 0."""
    r, valid = valid_rewards(g)
    X, M = r.shape
    turns = g.turns
    if turns.reflections is None:
        raise ValueError("grpo.advantage 'repro': the rollout has no reflections (set env.reflect_tokens > 0)")
    count, solved = np.asarray(turns.count_B), np.asarray(turns.solved_B, bool)
    W = np.asarray(turns.reward_BxW).shape[1]
    ratings = [parse_ratings(turns.reflections[b], int(count[b])) for b in range(X * M)]
    episode, step = np.zeros((X, M)), np.zeros((X * M, W))
    reflect = np.zeros((X, M))
    for x in range(X):
        rows = np.flatnonzero(valid[x])
        episode[x, rows] = normalise(r[x, rows], o.std, o.eps)
        rated = [(x * M + j, t) for j in rows if ratings[x * M + j] is not None for t in range(int(count[x * M + j]))]
        values = normalise(np.array([ratings[b][t] for b, t in rated], np.float64), o.std, o.eps)
        for (b, t), v in zip(rated, values):
            step[b, t] = v
        rewards = np.array([reflection_reward(ratings[x * M + j], solved[x * M + j]) for j in rows])
        reflect[x, rows] = normalise(rewards, o.std, o.eps)
    out = turn_tokens(g, o.omega * step, np.where(valid, episode, 0.0).reshape(-1)).reshape(X * M, -1)
    for b in range(X * M):
        out[b, turns.reflection_start_B[b] : turns.reflection_end_B[b]] = o.reflect_weight * reflect.reshape(-1)[b]
    real = valid.reshape(-1)
    parsed = [ratings[b] is not None for b in range(X * M) if real[b]]
    agreeing = [
        reflection_reward(ratings[b], solved[b]) > 0 for b in range(X * M) if real[b] and ratings[b] is not None
    ]
    metrics = {
        "repro_parsed": float(np.mean(parsed)) if parsed else 0.0,
        "repro_consistent": float(np.mean(agreeing)) if agreeing else 0.0,
    }
    return Estimate(out.reshape(X, M, -1).astype(np.float32), metrics=metrics)


register_advantage("repro", repro, options=ReproOptions, needs=("turns", "reflection"))
