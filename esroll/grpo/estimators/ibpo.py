"""IBPO (implicit behaviour policy): each step compared only with its counterfactual siblings, the group's
completions that stood in the same state and took a different step, weighted by how likely the sampling policy made
each of those steps. What it computes, and what its source leaves open: docs/step_level.md."""

from __future__ import annotations

import dataclasses

import numpy as np
import scipy.special

from esroll.baselines import grpo
from esroll.config import check_fields
from esroll.grpo.advantages import Estimate, Group, per_token, register_advantage, step_sums, valid_rewards
from esroll.grpo.estimators.step_graph import transitions


@dataclasses.dataclass(frozen=True)
class IbpoOptions:
    """IBPO's options (`grpo.adv.ibpo.*`). group_weight: the fraction of GRPO's group advantage added to every
    token's step advantage (0: the sibling comparison alone)."""

    group_weight: float = 0.5

    def __post_init__(self):
        check_fields(self, [("group_weight", self.group_weight >= 0, ">= 0")], "IbpoOptions")


def sibling_advantages(g: Group) -> tuple[np.ndarray, np.ndarray]:
    """(step advantages [X, M, J], has_sibling [X, M, J]). For step s of valid completion j, its siblings are the
    steps of the group's other valid completions that start from the same state and reach a different one. They are
    grouped by the state they reach, a: Q(a) is the mean reward of the completions that took it from there, and π(a)
    the mean of the sampling policy's probabilities of those steps. The step's advantage is r_j − Σ π(a)Q(a) / Σ π(a);
    0 where there is no sibling, NaN past a completion's steps and on invalid completions."""
    r, valid = valid_rewards(g)
    before, after = transitions(g)
    X, M, J = after.shape
    lp = step_sums(g, g.token_logp)[0]  # each step's log-probability: its tokens' sum
    adv = np.full((X, M, J), np.nan)
    has = np.zeros((X, M, J), bool)
    for x in range(X):
        j_E, s_E = np.nonzero((after[x] >= 0) & valid[x][:, None])
        b_E, a_E, lp_E, r_E = before[x, j_E, s_E], after[x, j_E, s_E], lp[x, j_E, s_E], r[x, j_E]
        for j, s, b, a in zip(j_E, s_E, b_E, a_E):
            sib = (b_E == b) & (a_E != a)
            adv[x, j, s] = 0.0
            if not sib.any():
                continue
            taking = [sib & (a_E == t) for t in np.unique(a_E[sib])]  # the siblings, by the state they reach
            q = np.array([r_E[t].mean() for t in taking])
            # log of the mean probability of each target's steps, then weights relative to the largest
            log_pi = np.array([scipy.special.logsumexp(lp_E[t]) - np.log(t.sum()) for t in taking])
            w = np.exp(log_pi - log_pi.max())
            adv[x, j, s] = r[x, j] - (w * q).sum() / w.sum()
            has[x, j, s] = True
    return adv, has


def ibpo(g: Group, o: IbpoOptions, state=None) -> Estimate:
    """Per-token advantages: the token's step's sibling advantage (`sibling_advantages`) plus `group_weight` × GRPO's
    group advantage of its completion. Logs `ibpo_steps_with_siblings`, the fraction of steps that had any."""
    r, valid = valid_rewards(g)
    adv, has = sibling_advantages(g)
    base = np.asarray(grpo(r, valid), np.float64)  # 0 on invalid entries
    known = ~np.isnan(adv)
    metrics = {"ibpo_steps_with_siblings": float(has[known].mean()) if known.any() else 0.0}
    return Estimate(per_token(g, adv, o.group_weight * base), metrics=metrics)


register_advantage("ibpo", ibpo, options=IbpoOptions, needs=("logprobs", "steps", "states"))
