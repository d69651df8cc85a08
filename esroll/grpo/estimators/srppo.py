"""SR-PPO (single-rollout PPO): token credit from a learned success head, one completion per prompt
(`grpo.advantage = "srppo"`).

The critic (`esroll.critic`, trained as PPO's) is a success head: its value before generated token t is the logit of
p̂(s_t) ≈ P(success | the prefix s_t), fitted by binary cross-entropy to the rollout's outcome (the reward clipped to
[0, 1]) at every prefix. The estimator turns p̂ into the pass@k success probability of the prefix and credits each
token with the change it made:

    q_k(s) = 1 − (1 − p̂(s))^k,    A_t = q_k(s_{t+1}) − q_k(s_t),    q(s_{T}) = the outcome after the last token

so Σ_t A_t = outcome − q_k(s_0) on every completion. k = ∞ is reachability, whether any continuation succeeds:
q_∞(s) = 1[p̂(s) > reach_threshold] (a learned p̂ is never exactly 0, so the threshold stands in for "no continuation
succeeds"; our reading). A larger k discounts prefixes that are already likely to succeed and credits the tokens that
make a hard prefix reachable. Formulas, a worked example and what is our reading: docs/critics.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import numpy as np
import scipy.special

from esroll.config import check_fields
from esroll.grpo.advantages import Estimate, Group, register_advantage, valid_rewards
from esroll.grpo.estimators.gae import critic_metrics
from esroll.grpo.gae import whiten


@dataclasses.dataclass(frozen=True)
class SrPpoOptions:
    """`grpo.adv.srppo.*`. k: the pass@k of the credit (1: the success probability itself; inf: reachability);
    reach_threshold: at k = inf, the p̂ above which a prefix counts as reachable; whiten: whiten the advantages over
    the step's valid tokens; warmup_steps: steps at the start that train the success head alone (advantages 0: a head
    that does not yet tell prefixes apart would put every completion's credit on its last token); critic_lr,
    critic_path, shared_trunk: the success head's critic, as PPO's (`grpo.adv.gae`)."""

    k: float = 4.0
    reach_threshold: float = 0.05
    whiten: bool = False
    warmup_steps: int = 0
    critic_lr: float = 1e-4
    critic_path: str = ""
    shared_trunk: bool = False
    critic_loss: ClassVar[str] = "logistic"  # the critic fits logits of success by cross-entropy, not values

    def __post_init__(self):
        checks = [
            ("k", self.k >= 1, ">= 1 (inf: reachability)"),
            ("reach_threshold", 0 <= self.reach_threshold < 1, "in [0, 1)"),
            ("warmup_steps", self.warmup_steps >= 0, ">= 0"),
            ("critic_lr", self.critic_lr > 0, "> 0"),
            (
                "critic_path",
                not (self.shared_trunk and self.critic_path),
                "empty with shared_trunk (the trunk is the policy's)",
            ),
        ]
        check_fields(self, checks, "SrPpoOptions")


def pass_at_k(p: np.ndarray, k: float, reach_threshold: float = 0.0) -> np.ndarray:
    """q_k = 1 − (1 − p)^k of success probabilities `p`; at k = inf, 1 where p > `reach_threshold`, else 0."""
    p = np.clip(np.asarray(p, np.float64), 0.0, 1.0)
    if math.isinf(k):
        return (p > reach_threshold).astype(np.float64)
    return 1.0 - (1.0 - p) ** k


def srppo_advantage(g: Group, o: SrPpoOptions, state=None) -> Estimate:
    """Per-token A_t = q_k(s_{t+1}) − q_k(s_t) over each valid row's generated tokens (`Group.token_mask`; in an
    episode the environment's tokens are skipped, as in GAE), the outcome after the last; the success head's target
    is the outcome at every generated token (`Estimate.returns`). An invalid row gets 0 and no target. Logs PPO's
    `critic_metrics` of p̂ against the outcome (`value_prompt`: the mean p̂ before the first token),
    `success_head_brier`, the mean squared error of p̂ over the step's tokens, and `last_token_credit`, the share of
    the step's |A| on the completions' last tokens (1 while the head tells no prefixes apart)."""
    r, valid = valid_rewards(g)
    mask = np.asarray(g.token_mask, bool) & valid[..., None]
    X, M, N = mask.shape
    flat = mask.reshape(X * M, N)
    logits = np.where(flat, np.asarray(g.values, np.float64).reshape(X * M, N), 0.0)
    p = scipy.special.expit(logits)
    q = pass_at_k(p, o.k, o.reach_threshold)
    outcome = np.clip(r.reshape(-1), 0.0, 1.0)
    advantage = np.zeros((X * M, N))
    after = outcome.copy()  # q after the current token: the outcome after the last one
    for t in range(N - 1, -1, -1):
        m = flat[:, t]
        advantage[:, t] = np.where(m, after - q[:, t], 0.0)
        after = np.where(m, q[:, t], after)
    target = np.where(flat, outcome[:, None], 0.0)
    metrics = critic_metrics(np.where(flat, p, 0.0), target, flat)
    if flat.any():
        metrics["success_head_brier"] = float(((p - target)[flat] ** 2).mean())
        last = N - 1 - np.argmax(flat[:, ::-1], axis=1)
        rows = np.flatnonzero(flat.any(1))
        total = np.abs(advantage).sum()
        metrics["last_token_credit"] = float(np.abs(advantage[rows, last[rows]]).sum() / total) if total else 0.0
    advantage = whiten(advantage, flat) if o.whiten else advantage
    if g.step < o.warmup_steps:  # the success head alone learns; the policy's update sees no advantage
        advantage = np.zeros_like(advantage)
        metrics["success_head_warmup"] = 1.0
    return Estimate(advantage.reshape(X, M, N).astype(np.float32), metrics=metrics, returns=target.reshape(X, M, N))


register_advantage("srppo", srppo_advantage, options=SrPpoOptions, needs=("values",), single_rollout=True)
