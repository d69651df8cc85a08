"""MaxPO: the unbiased max@K (pass@K on 0/1 rewards) policy-gradient weights with the leave-two-out baseline, exactly
centred in each group. What it computes, and what its source leaves open:
docs/advantages.md."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from esroll.config import ConfigError, check_fields
from esroll.grpo.advantages import Estimate, Group, register_advantage, valid_rewards


@dataclasses.dataclass(frozen=True)
class MaxPOOptions:
    """MaxPO's options (`grpo.adv.maxpo.*`). k: K of max@K (pass@K on 0/1 rewards); needs group_size > K."""

    k: int = 2

    def __post_init__(self):
        check_fields(self, [("k", self.k >= 1, ">= 1")], "MaxPOOptions")

    def check(self, grpo) -> None:
        if grpo.group_size <= self.k:
            raise ConfigError(
                "group_size", grpo.group_size, f"> adv.maxpo.k = {self.k} (MaxPO's leave-two-out baseline)"
            )


def _max_at_k(values: np.ndarray, K: int) -> float:
    """The unbiased estimate of E[max of K draws] from n ≥ K i.i.d. values: the mean of max over all K-subsets,
    Σ_m C(m, K−1) / C(n, K) · v_(m) over the sorted values (0-based m)."""
    v = np.sort(values)
    n = len(v)
    return float(sum(math.comb(m, K - 1) * v[m] for m in range(K - 1, n)) / math.comb(n, K))


def maxpo_group(r: np.ndarray, K: int) -> np.ndarray:
    """MaxPO's advantage in one group of G > K rewards (quadratic time):

        A_i = (G/K)·s_i − ρ̂_K(r_{−i}),  s_i = (1 / C(G, K)) Σ_{|S|=K, S∋i} max_{j∈S} r_j,

    s_i being the weight on ∇log π(y_i) in the unbiased policy gradient of max@K (each K-subset's max times the
    score of its members, averaged over subsets), and ρ̂_K(r_{−i}) the unbiased max@K estimate of the other G − 1
    (the leave-two-out baseline: each subset term's baseline replaces y_i by another response j, so the pair (i, j)
    is left out; it never reads y_i, so the gradient stays unbiased). Σ_i A_i = 0 exactly; K = 1 gives RLOO."""
    r = np.asarray(r, np.float64)
    G = len(r)
    if G <= K:
        raise ValueError(f"maxpo needs more responses than K: group of {G}, K = {K}")
    order = np.argsort(r, kind="stable")
    pos = np.empty(G, int)
    pos[order] = np.arange(G)  # a strict order; ties do not change any maximum
    total = math.comb(G, K)
    adv = np.empty(G)
    for i in range(G):
        own = r[i] * math.comb(pos[i], K - 1)  # subsets whose maximum is i: the other K−1 from below i
        above = sum(r[q] * math.comb(pos[q] - 1, K - 2) for q in range(G) if pos[q] > pos[i]) if K >= 2 else 0.0
        s_i = (own + above) / total
        adv[i] = G / K * s_i - _max_at_k(np.delete(r, i), K)
    return adv


def maxpo(g: Group, o: MaxPOOptions, state=None) -> Estimate:
    """MaxPO (max@K, pass@K on 0/1 rewards) with the leave-two-out baseline, group by group (`maxpo_group`);
    a group with no more valid responses than K gets 0."""
    r, valid = valid_rewards(g)
    adv = np.zeros(r.shape)
    for x in range(r.shape[0]):
        idx = np.flatnonzero(valid[x])
        if len(idx) > o.k:
            adv[x, idx] = maxpo_group(r[x, idx], o.k)
    return Estimate(adv.astype(np.float32))


register_advantage("maxpo", maxpo, options=MaxPOOptions)
