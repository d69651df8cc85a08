"""Success Visitation Matching (`svm`): each turn's reward densified by a discriminator of the state–actions that
successful episodes visit against those failed ones visit (`esroll.agents.visitation`), then credited as the
`discounted` estimator credits per-turn rewards. What it computes and what is chosen where the source leaves it
open: docs/agents.md."""

from __future__ import annotations

import dataclasses

import numpy as np

from esroll.agents.visitation import CLIP, shaped_rewards
from esroll.config import check_fields
from esroll.grpo.advantages import Estimate, Group, register_advantage, valid_rewards
from esroll.grpo.estimators.turns import DiscountedOptions, discounted


@dataclasses.dataclass(frozen=True)
class SvmOptions:
    """`grpo.adv.svm.*`. lam: λ, the weight of the discriminator's logit in each turn's reward; beta: β, its clip;
    gamma and std: the per-turn returns' discount and whether they are divided by the group's std, as `discounted`."""

    lam: float = 0.1
    beta: float = CLIP
    gamma: float = 0.95
    std: bool = True

    def __post_init__(self):
        checks = [
            ("lam", self.lam >= 0, ">= 0"),
            ("beta", self.beta > 0, "> 0"),
            ("gamma", 0 <= self.gamma <= 1, "in [0, 1]"),
        ]
        check_fields(self, checks, "SvmOptions")


def svm(g: Group, o: SvmOptions, state=None) -> Estimate:
    """Per-token advantages: the discriminator fitted on each group's valid episodes (by their `Turns.solved_B`; a
    group plays one level), each turn's reward r_t + λ·clip_β(f̂(s_t, a_t)), then `discounted`'s normalised
    per-turn returns on the turn's action tokens. Logs `svm_logit_abs` (mean |clipped logit| over the valid episodes' turns), `svm_clipped` (the share
    of those at ±β: state–actions that one class alone visited) and `svm_success` (the share of valid episodes
    solved)."""
    _, valid = valid_rewards(g)
    turns = g.turns
    valid_B = valid.reshape(-1)
    X, M = valid.shape
    rewards, logits = shaped_rewards(turns, valid_B, o.lam, o.beta, level_B=np.repeat(np.arange(X), M))
    played = (np.arange(logits.shape[1])[None, :] < np.asarray(turns.count_B)[:, None]) & valid_B[:, None]
    est = discounted(g._replace(turns=turns._replace(reward_BxW=rewards)), DiscountedOptions(o.gamma, o.std))
    on = logits[played]
    metrics = {
        "svm_logit_abs": float(np.abs(on).mean()) if on.size else 0.0,
        "svm_clipped": float((np.abs(on) >= o.beta).mean()) if on.size else 0.0,
        "svm_success": float(np.asarray(turns.solved_B)[valid_B].mean()) if valid_B.any() else 0.0,
    }
    return est._replace(metrics=metrics)


register_advantage("svm", svm, options=SvmOptions, needs=("turns",))
