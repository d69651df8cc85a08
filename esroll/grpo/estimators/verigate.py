"""VeriGate (verifier-gated step-level GRPO): the outcome verifier's GRPO advantage wherever the group's rewards
differ, and the step verifier's scores, turned into future-cumulated returns and normalised over the group's steps,
where they are all equal and the outcome says nothing. What it computes, and what its source leaves open:
docs/step_level.md."""

from __future__ import annotations

import dataclasses

import numpy as np

from esroll.baselines import grpo
from esroll.config import check_fields
from esroll.grpo.advantages import Estimate, Group, all_equal, per_token, register_advantage, valid_rewards

EPS = 1e-4  # as GRPO's group std (TRL)


@dataclasses.dataclass(frozen=True)
class VerigateOptions:
    """VeriGate's options (`grpo.adv.verigate.*`). gamma: the discount of the future-cumulated step returns
    (G_s = Σ_{t ≥ s} γ^(t−s) score_t over the completion's steps; 1: the plain sum of the scores still to come)."""

    gamma: float = 1.0

    def __post_init__(self):
        check_fields(self, [("gamma", 0 <= self.gamma <= 1, "in [0, 1]")], "VerigateOptions")


def step_returns(scores_XxMxJ: np.ndarray, count_XxM: np.ndarray, gamma: float) -> np.ndarray:
    """[X, M, J]: each step's future-cumulated verifier score, G_s = score_s + γ·G_{s+1} over the completion's
    `count` steps (a non-finite score counts as 0); NaN past them."""
    X, M, J = scores_XxMxJ.shape
    inside = np.arange(J) < count_XxM[..., None]
    scores = np.where(inside, np.nan_to_num(np.asarray(scores_XxMxJ, np.float64), nan=0.0, posinf=0.0, neginf=0.0), 0)
    returns = np.zeros((X, M, J))
    later = np.zeros((X, M))
    for s in range(J - 1, -1, -1):
        later = scores[..., s] + gamma * later
        returns[..., s] = later
    return np.where(inside, returns, np.nan)


def verigate(g: Group, o: VerigateOptions, state=None) -> Estimate:
    """Per-token advantages. A group whose valid completions' rewards are not all equal gets GRPO's advantage on
    every token (the outcome verifier keeps charge). A group where they are all equal (the gate) gets, on each token,
    its step's return G_s (`step_returns` of `Group.step_scores`) normalised over all steps of the group's valid
    completions: (G − mean) / (sample std + 1e-4), 0 where the group has fewer than 2 steps. Invalid completions and
    tokens past a completion's end get 0. Logs `verigate_gated` (the fraction of groups gated to step scores) and
    `verigate_gated_signal` (of those, the fraction whose step returns differ)."""
    r, valid = valid_rewards(g)
    X, M = r.shape
    base = np.asarray(grpo(r, valid), np.float64)  # 0 on invalid entries
    count = np.asarray(g.steps.count_B).reshape(X, M)
    scores = np.asarray(g.step_scores, np.float64)
    returns = step_returns(scores, count, o.gamma)
    gated = all_equal(g)
    process = np.zeros(returns.shape)
    signal = 0
    for x in np.flatnonzero(gated):
        steps = valid[x][:, None] & ~np.isnan(returns[x])
        values = returns[x][steps]
        if values.size >= 2:
            process[x][steps] = (values - values.mean()) / (values.std(ddof=1) + EPS)
            signal += bool(np.ptp(values) > 0)
    metrics = {
        "verigate_gated": float(gated.mean()),
        "verigate_gated_signal": signal / max(int(gated.sum()), 1),
    }
    # invalid completions: 0 in both (GRPO's is 0 there, and their steps get no process value)
    return Estimate(per_token(g, np.where(gated[:, None, None], process, base[..., None])), metrics=metrics)


register_advantage("verigate", verigate, options=VerigateOptions, needs=("steps", "step_scores"))
