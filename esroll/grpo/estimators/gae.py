"""PPO's advantages: GAE over each completion's generated tokens from a learned critic's values (`esroll.critic`).

The reward sits on a completion's last generated token (an episode: each turn's reward on the turn's last action
token); `esroll.grpo.gae.gae` runs over the tokens that get loss and skips the environment's, so a turn bootstraps
from the next. The advantages are whitened over every valid token of the step (`whiten`); the returns A + V, before
whitening, are the critic's targets (`Estimate.returns`), which the GRPO step trains its critic on with PPO's
clipped value loss. Selecting this estimator is what makes a GRPO run PPO: the method keeps a critic exactly when its
estimator reads "values". Formulas, a worked example and options: docs/critics.md.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from esroll.config import check_fields
from esroll.grpo.advantages import Estimate, Group, register_advantage, valid_rewards
from esroll.grpo.gae import explained_variance, gae, whiten


@dataclasses.dataclass(frozen=True)
class GaeOptions:
    """`grpo.adv.gae.*`. gamma, lam: GAE's γ and λ (TRL and Tunix: 1, 0.95); whiten: whiten the advantages over the
    step's valid tokens; critic_lr: the critic's Adam learning rate (its own optimizer, clipped at norm 1);
    value_clip: ε of the clipped value loss (TRL 0.2); critic_path: a checkpoint to start the critic from (a value
    model of the policy's architecture, or a causal LM of it whose trunk is taken with a zero value head; empty: the
    policy's own trunk); shared_trunk: no trunk of the critic's own: a value head on the policy's trunk, trained on
    the policy's hidden states by its own optimizer, the trunk trained by the policy's loss alone (docs/critics.md)."""

    gamma: float = 1.0
    lam: float = 0.95
    whiten: bool = True
    critic_lr: float = 1e-4
    value_clip: float = 0.2
    critic_path: str = ""
    shared_trunk: bool = False

    def __post_init__(self):
        checks = [
            ("gamma", 0 <= self.gamma <= 1, "in [0, 1]"),
            ("lam", 0 <= self.lam <= 1, "in [0, 1]"),
            ("critic_lr", self.critic_lr > 0, "> 0"),
            ("value_clip", self.value_clip > 0, "> 0"),
            (
                "critic_path",
                not (self.shared_trunk and self.critic_path),
                "empty with shared_trunk (the trunk is the policy's)",
            ),
        ]
        check_fields(self, checks, "GaeOptions")


def token_rewards(g: Group, rewards_XxM: np.ndarray, mask_XxMxN: np.ndarray) -> np.ndarray:
    """[X, M, N]: a completion's reward on its last masked token; an episode's turn rewards each on its turn's last
    action token (`Group.turns`)."""
    X, M, N = mask_XxMxN.shape
    out = np.zeros((X * M, N))
    mask = mask_XxMxN.reshape(X * M, N)
    if g.turns is None:
        last = N - 1 - np.argmax(mask[:, ::-1], axis=1)
        has = mask.any(1)
        out[np.flatnonzero(has), last[has]] = rewards_XxM.reshape(-1)[has]
        return out.reshape(X, M, N)
    t = g.turns
    for b in range(X * M):
        for w in range(int(t.count_B[b])):
            out[b, int(t.end_BxW[b, w]) - 1] += float(t.reward_BxW[b, w])
    return out.reshape(X, M, N)


def gae_advantage(g: Group, o: GaeOptions, state=None) -> Estimate:
    """Per-token GAE advantages (whitened with `whiten`) and the critic's targets; an invalid completion gets 0
    and no target. Logs `critic_metrics`."""
    r, valid = valid_rewards(g)
    mask = np.asarray(g.token_mask, bool) & valid[..., None]
    X, M, N = mask.shape
    values = np.where(mask, np.asarray(g.values, np.float64), 0.0)
    rewards = token_rewards(g, r, mask)
    adv, ret = gae(rewards.reshape(X * M, N), values.reshape(X * M, N), mask.reshape(X * M, N), o.gamma, o.lam)
    adv = whiten(adv, mask.reshape(X * M, N)) if o.whiten else adv
    metrics = critic_metrics(values.reshape(X * M, N), ret, mask.reshape(X * M, N))
    return Estimate(adv.reshape(X, M, N).astype(np.float32), metrics=metrics, returns=ret.reshape(X, M, N))


def critic_metrics(value_BxN: np.ndarray, return_BxN: np.ndarray, mask_BxN: np.ndarray) -> dict:
    """What a critic's estimator logs: `explained_variance` of the values the rollout saw against the targets, and
    `value_prompt`, the mean value before each row's first generated token (beside the step's mean reward, what it
    should track; 0 without a generated token)."""
    first = np.argmax(mask_BxN, axis=1)
    rows = mask_BxN.any(1)
    return {
        "explained_variance": explained_variance(value_BxN, return_BxN, mask_BxN),
        "value_prompt": float(value_BxN[np.flatnonzero(rows), first[rows]].mean()) if rows.any() else 0.0,
    }


register_advantage("gae", gae_advantage, options=GaeOptions, needs=("values",), single_rollout=True)
