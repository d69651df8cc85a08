"""ExpRL's DeltaNorm: each reasoning step credited with how much a judge holding the reference solution says it moved
the completion toward it, used directly as the advantage (no outcome term, no group baseline). The judge's scores
are the step scores of `steps.verifier` (the rule-based `exprl`, `esroll.steps.judge`). What it computes and
what is chosen where the source leaves it open: docs/step_level.md."""

from __future__ import annotations

import dataclasses

import numpy as np

from esroll.config import check_fields
from esroll.grpo.advantages import Estimate, Group, per_token, register_advantage, valid_rewards

FIRST_STEP = ("source", "rise")


@dataclasses.dataclass(frozen=True)
class ExprlOptions:
    """`grpo.adv.exprl.*`. first_step: the first step's credit, "source" (s_1 − s_K, as ExpRL's code: a
    completion's credits sum to 0) or "rise" (s_1, its rise from s_0 = 0: the credits telescope to s_K, each step
    credited with what it added)."""

    first_step: str = "source"

    def __post_init__(self):
        check_fields(self, [("first_step", self.first_step in FIRST_STEP, " or ".join(FIRST_STEP))], "ExprlOptions")


def delta_norm(scores_J: np.ndarray, first_step: str = "source") -> np.ndarray:
    """[K] DeltaNorm of one completion's step scores s_1..s_K: step k ≥ 2 gets s_k − s_{k−1}; the first step
    s_1 − s_K when K ≥ 2 (`first_step` "source"), so that the credits sum to 0 (s_1 − s_K + Σ_{k≥2} (s_k − s_{k−1})
    = 0), and s_1 for a one-step completion (its rise from s_0 = 0: ExpRL's code does the same); or s_1 always
    ("rise"), so that they sum to s_K."""
    s = np.asarray(scores_J, np.float64)
    if s.size < 2 or first_step == "rise":
        return np.concatenate([s[:1], np.diff(s)])
    return np.concatenate([[s[0] - s[-1]], np.diff(s)])


def exprl(g: Group, o: ExprlOptions, state=None) -> Estimate:
    """Per-token advantages: each token gets its step's DeltaNorm credit (`delta_norm` of `Group.step_scores` over the
    completion's steps, the first step's as `first_step` says). A valid row with any step's judgement unreadable (a
    NaN score) is dropped from the loss (token weight 0), as ExpRL drops a row whose judgement it cannot parse. A row
    gets 0 everywhere, and stays in the loss as ExpRL keeps it, when it is invalid, empty or length-clipped: its last
    generated token sits at the new-token budget, EOS or not (it may have been cut, and the judge would credit an
    unfinished solution; one that ended exactly there counts too, as in the source). Logs
    `exprl_dropped` (the share of rows dropped for unreadable judgements), `exprl_clipped` (length-clipped),
    `exprl_final_score` (mean s_K over the rows credited) and `exprl_credit_abs` (mean |credit| over their steps)."""
    _, valid = valid_rewards(g)
    X, M, N = g.token_mask.shape
    counts = np.asarray(g.steps.count_B).reshape(X, M)
    scores = np.asarray(g.step_scores, np.float64)
    clipped = np.asarray(g.token_mask, bool)[..., N - 1]
    credit = np.zeros(scores.shape[:2] + (max(scores.shape[2], 1),))
    keep = np.zeros((X, M), bool)
    unread = np.zeros((X, M), bool)
    finals, credits = [], []
    for x in range(X):
        for j in range(M):
            c = int(counts[x, j])
            s = scores[x, j, :c]
            if not valid[x, j] or c == 0:
                continue
            if not np.isfinite(s).all():
                unread[x, j] = True
                continue
            if clipped[x, j]:
                continue
            credit[x, j, :c] = delta_norm(s, o.first_step)
            keep[x, j] = True
            finals.append(s[-1])
            credits.extend(np.abs(credit[x, j, :c]))
    metrics = {
        "exprl_dropped": float(unread.mean()),
        "exprl_clipped": float((clipped & valid).mean()),
        "exprl_final_score": float(np.mean(finals)) if finals else 0.0,
        "exprl_credit_abs": float(np.mean(credits)) if credits else 0.0,
    }
    weight = np.broadcast_to(~unread[..., None], (X, M, N)).astype(np.float32)
    return Estimate(per_token(g, np.where(keep[..., None], credit, 0.0)), token_weight=weight, metrics=metrics)


register_advantage("exprl", exprl, options=ExprlOptions, needs=("steps", "step_scores"))
