"""LamPO: pairwise reward gaps weighted by a confidence from the pair's log-probability difference. What it computes, and what its source leaves open:
docs/advantages.md."""

from __future__ import annotations

import dataclasses

import numpy as np

from esroll.config import check_fields
from esroll.grpo.advantages import Estimate, Group, register_advantage, valid_rewards


@dataclasses.dataclass(frozen=True)
class LamPOOptions:
    """LamPO's options (`grpo.adv.lampo.*`). temperature: τ of the pair confidence 2σ(−τ·sign(r_i − r_j)·(ℓ_i − ℓ_j)),
    ℓ the mean token log-probability (0: every pair weighs 1, which is RLOO)."""

    temperature: float = 1.0

    def __post_init__(self):
        check_fields(self, [("temperature", self.temperature >= 0, ">= 0")], "LamPOOptions")


def lampo(g: Group, o: LamPOOptions, state=None) -> Estimate:
    """LamPO: A_i = (1/(n−1)) Σ_{j≠i} w_ij (r_i − r_j), w_ij = 2σ(−τ·sign(r_i − r_j)·(ℓ_i − ℓ_j)), ℓ the mean token
    log-probability of a completion. A pair the policy already orders right (the better response is the likelier)
    weighs less than 1, one it orders wrong more (up to 2); w is symmetric, so each group sums to 0; τ = 0 is RLOO."""
    if g.seq_logp is None:
        raise ValueError("lampo needs the completions' mean log-probabilities (Group.seq_logp)")
    r, valid = valid_rewards(g)
    ell = np.where(valid, np.asarray(g.seq_logp, np.float64), 0.0)
    gap = r[:, :, None] - r[:, None, :]
    z = -o.temperature * np.sign(gap) * (ell[:, :, None] - ell[:, None, :])
    w = 2.0 / (1.0 + np.exp(-z))
    pair = valid[:, :, None] & valid[:, None, :]
    n = valid.sum(1, keepdims=True)
    adv = np.where(pair, w * gap, 0.0).sum(-1) / np.maximum(n - 1, 1)
    return Estimate(np.where(valid, adv, 0.0).astype(np.float32))


register_advantage("lampo", lampo, options=LamPOOptions, needs=("logprobs",))
