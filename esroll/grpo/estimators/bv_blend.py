"""BV-Blend: each group standardised by a blend of its own mean / variance and its cluster's EMA history, blended by
a confidence weight from the history's standard error. What it computes, and what its source leaves open:
docs/advantages.md."""

from __future__ import annotations

import dataclasses

import numpy as np

from esroll.config import check_fields
from esroll.data import cluster_key
from esroll.grpo.advantages import Estimate, Group, register_advantage, valid_rewards
from esroll.rewards import answer_id


@dataclasses.dataclass(frozen=True)
class BVBlendOptions:
    """BV-Blend's options (`grpo.adv.bv_blend.*`). cluster_key: what groups prompts into clusters
    (`esroll.data.cluster_key`): difficulty (the example's difficulty bucket: carries of a sum, else the worked
    solution's steps), task, or a field of the example's meta. clusters: the size of the cluster table (cluster keys
    are hashed into it); decay: its EMA decay per update of a cluster (a cluster absent from a step keeps its history
    as it is); blend_max: the largest weight history gets; sem: the standard error at which history gets half of
    blend_max; prior_var: the variance assumed of a cluster before it has history (the SEM proxy's prior)."""

    cluster_key: str = "difficulty"
    clusters: int = 64
    decay: float = 0.9
    blend_max: float = 0.5
    sem: float = 0.1
    prior_var: float = 0.25

    def __post_init__(self):
        checks = [
            ("clusters", self.clusters >= 1, ">= 1"),
            ("decay", 0 <= self.decay < 1, "in [0, 1)"),
            ("blend_max", 0 <= self.blend_max < 1, "in [0, 1)"),
            ("sem", self.sem > 0, "> 0"),
            ("prior_var", self.prior_var > 0, "> 0"),
        ]
        check_fields(self, checks, "BVBlendOptions")


def bv_blend_init(o: BVBlendOptions) -> dict:
    """BV-Blend's history: per cluster, the EMA weight (effective count) and the EMA first and second moments."""
    return {k: np.zeros(o.clusters, np.float32) for k in ("weight", "mean", "sq")}


def bv_blend(g: Group, o: BVBlendOptions, state: dict) -> Estimate:
    """BV-Blend: standardise each group by a blend of its own statistics and its cluster's history (before this step).

    History of cluster c: EMA weight W, mean μ_h, variance v_h. Its standard error is √((v_h + prior)/W) (infinite
    without history); the confidence λ = `blend_max` / (1 + (SEM / `sem`)²). The group's baseline and variance are
    those of the mixture (1 − λ)·group + λ·history: μ = (1 − λ)μ_g + λμ_h,
    σ² = (1 − λ)σ_g² + λv_h + λ(1 − λ)(μ_g − μ_h)², and A = (r − μ) / (σ + 1e-4). An all-equal group gets λ(μ_g − μ_h) / σ, at most √(λ/(1 − λ)) in size: non-zero
    exactly when history says the group is unusual. Then the history takes in this step's rewards."""
    if g.cluster is None and g.examples is None:
        raise ValueError("bv_blend needs a cluster id per prompt (Group.cluster) or the prompts (Group.examples)")
    r, valid = valid_rewards(g)
    if g.cluster is None:  # the prompts' cluster keys (`cluster_key`) hashed into the table
        c = np.array([cluster_id(cluster_key(e, o.cluster_key), o.clusters) for e in g.examples])
    else:
        c = np.asarray(g.cluster, int)
    W, mu_h, sq_h = (np.asarray(state[k], np.float64)[c] for k in ("weight", "mean", "sq"))
    var_h = np.maximum(sq_h - mu_h**2, 0.0)
    n = np.maximum(valid.sum(1), 1)
    mu_g = r.sum(1) / n
    var_g = np.where(valid, (r - mu_g[:, None]) ** 2, 0.0).sum(1) / n
    with np.errstate(divide="ignore"):
        sem = np.where(W > 0, np.sqrt((var_h + o.prior_var) / np.maximum(W, 1e-30)), np.inf)
    lam = np.where(W > 0, o.blend_max / (1.0 + (sem / o.sem) ** 2), 0.0)
    mu = (1 - lam) * mu_g + lam * mu_h
    var = (1 - lam) * var_g + lam * var_h + lam * (1 - lam) * (mu_g - mu_h) ** 2
    adv = (r - mu[:, None]) / (np.sqrt(var)[:, None] + 1e-4)
    # The history takes in this step: W' = d·W + n, m' = (d·W·m + Σr) / W' for both moments, per cluster.
    new = {k: np.asarray(v, np.float64).copy() for k, v in state.items()}
    d = o.decay
    counts = np.zeros_like(new["weight"])
    sums, sqs = np.zeros_like(counts), np.zeros_like(counts)
    np.add.at(counts, c, valid.sum(1))
    np.add.at(sums, c, r.sum(1))
    np.add.at(sqs, c, (r**2).sum(1))
    seen = counts > 0
    w_new = np.where(seen, d * new["weight"] + counts, new["weight"])
    for k, total in (("mean", sums), ("sq", sqs)):
        new[k] = np.where(seen, (d * new["weight"] * new[k] + total) / np.maximum(w_new, 1e-30), new[k])
    new["weight"] = w_new
    high, low = np.where(valid, r, -np.inf).max(1), np.where(valid, r, np.inf).min(1)
    equal = high <= low
    metrics = {
        "bv_blend_weight": float(lam.mean()),
        "bv_equal_groups_with_signal": float(np.mean(equal & np.any(np.abs(adv) > 1e-6, axis=1))),
    }
    state = {k: v.astype(np.float32) for k, v in new.items()}
    return Estimate(np.where(valid, adv, 0.0).astype(np.float32), None, state, metrics)


def cluster_id(key: str, clusters: int) -> int:
    """A cluster key (any string) hashed into [0, clusters)."""
    return answer_id(key) % clusters


register_advantage("bv_blend", bv_blend, bv_blend_init, options=BVBlendOptions, needs=("examples",))
