"""The group-advantage estimators of recent papers, registered through `esroll.grpo.advantages.register_advantage`
as a user's own would be. What each computes, and what its source leaves open, is in docs/advantages.md:

    agrae     A-GRAE: GRPO advantages, positive ones scaled by a scheduled factor, groups weighted by a difficulty
              focus that moves from easy to hard over `horizon` steps
    bv_blend  BV-Blend: each group standardised by a blend of its own mean / variance and its cluster's EMA history,
              blended by a confidence weight from the history's standard error
    gmae      GMAE: a response's centred advantage averaged over the group contexts (subsets of the others) it could
              have been sampled into; closed form k/(k+1)·RLOO when rewards do not depend on the context
    maxpo     MaxPO: the unbiased max@K (pass@K on 0/1 rewards) policy-gradient weights with the leave-two-out
              baseline, exactly centred in each group
    lampo     LamPO: pairwise reward gaps weighted by a confidence from the pair's log-probability difference
    ntf       negative token filtering: a batch-level baseline (one rollout per prompt is enough) and no penalty on
              the tokens of a negative sample that the policy already found likely
    ddrl      DDRL (label-free only): fixed ±a advantages from the group's answer consistency, ambiguous groups
              excluded, positives and negatives balanced over the batch

Each is fn(group, options, state) -> Estimate, in numpy on the host (`esroll.grpo.advantages`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np

from esroll.baselines import grpo, rloo
from esroll.config import AdvantageConfig
from esroll.data import cluster_key
from esroll.grpo.advantages import Estimate, Group, register_advantage, valid_rewards
from esroll.rewards import answer_id, majority_rewards


def _progress(step: int, horizon: int) -> float:
    """t in [0, 1]: how far the schedules over `horizon` steps have gone (0 when there is no horizon)."""
    return min(step / horizon, 1.0) if horizon > 0 else 0.0


def agrae(g: Group, o: AdvantageConfig, state=None) -> Estimate:
    """A-GRAE: GRPO's advantage with positive entries scaled by β_t and each group weighted by its difficulty focus.

    β_t runs linearly from `agrae_positive` to `agrae_positive_final` over `horizon` steps; a group of success rate p
    (its mean reward, clipped to [0, 1]) is weighted 1 + κ·(1 − 2t)·(2p − 1): at t = 0 easy groups weigh up to 1 + κ
    and hard ones down to 1 − κ, at t = 1/2 all weigh 1, at t = 1 the other way round. With β = 1 and κ = 0 it is
    `grpo` exactly."""
    r, valid = valid_rewards(g)
    t = _progress(g.step, o.horizon)
    beta = o.agrae_positive + (o.agrae_positive_final - o.agrae_positive) * t
    base = np.asarray(grpo(r, valid), np.float64)
    n = np.maximum(valid.sum(1), 1)
    p = np.clip(r.sum(1) / n, 0.0, 1.0)
    weight = 1.0 + o.agrae_focus * (1.0 - 2.0 * t) * (2.0 * p - 1.0)
    adv = np.where(base > 0, beta * base, base) * weight[:, None]
    return Estimate(np.where(valid, adv, 0.0).astype(np.float32), metrics={"agrae_positive": beta, "agrae_t": t})


def bv_blend_init(o: AdvantageConfig) -> dict:
    """BV-Blend's history: per cluster, the EMA weight (effective count) and the EMA first and second moments."""
    return {k: np.zeros(o.bv_clusters, np.float32) for k in ("weight", "mean", "sq")}


def bv_blend(g: Group, o: AdvantageConfig, state: dict) -> Estimate:
    """BV-Blend: standardise each group by a blend of its own statistics and its cluster's history (before this step).

    History of cluster c: EMA weight W, mean μ_h, variance v_h. Its standard error is √((v_h + prior)/W) (infinite
    without history); the confidence λ = bv_blend_max / (1 + (SEM / bv_sem)²). The group's baseline and variance are
    those of the mixture (1 − λ)·group + λ·history: μ = (1 − λ)μ_g + λμ_h,
    σ² = (1 − λ)σ_g² + λv_h + λ(1 − λ)(μ_g − μ_h)², and A = (r − μ) / (σ + 1e-4). An all-equal group gets λ(μ_g − μ_h) / σ, at most √(λ/(1 − λ)) in size: non-zero
    exactly when history says the group is unusual. Then the history takes in this step's rewards."""
    if g.cluster is None and g.examples is None:
        raise ValueError("bv_blend needs a cluster id per prompt (Group.cluster) or the prompts (Group.examples)")
    r, valid = valid_rewards(g)
    if g.cluster is None:  # the prompts' cluster keys (options.cluster_key) hashed into the table
        c = np.array([cluster_id(cluster_key(e, o.cluster_key), o.bv_clusters) for e in g.examples])
    else:
        c = np.asarray(g.cluster, int)
    W, mu_h, sq_h = (np.asarray(state[k], np.float64)[c] for k in ("weight", "mean", "sq"))
    var_h = np.maximum(sq_h - mu_h**2, 0.0)
    n = np.maximum(valid.sum(1), 1)
    mu_g = r.sum(1) / n
    var_g = np.where(valid, (r - mu_g[:, None]) ** 2, 0.0).sum(1) / n
    with np.errstate(divide="ignore"):
        sem = np.where(W > 0, np.sqrt((var_h + o.bv_prior_var) / np.maximum(W, 1e-30)), np.inf)
    lam = np.where(W > 0, o.bv_blend_max / (1.0 + (sem / o.bv_sem) ** 2), 0.0)
    mu = (1 - lam) * mu_g + lam * mu_h
    var = (1 - lam) * var_g + lam * var_h + lam * (1 - lam) * (mu_g - mu_h) ** 2
    adv = (r - mu[:, None]) / (np.sqrt(var)[:, None] + 1e-4)
    # The history takes in this step: W' = d·W + n, m' = (d·W·m + Σr) / W' for both moments, per cluster.
    new = {k: np.asarray(v, np.float64).copy() for k, v in state.items()}
    d = o.bv_decay
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


def gmae_contexts(M: int, k: int, i: int, max_contexts: int, rng: np.random.Generator) -> list[tuple[int, ...]]:
    """The groups T = {i} ∪ S, S a k-subset of the other M − 1 responses: all of them, or a uniform sample of
    `max_contexts` of them when there are more."""
    others = [j for j in range(M) if j != i]
    if math.comb(M - 1, k) <= max_contexts:
        subsets = list(itertools.combinations(others, k))
    else:
        subsets = [tuple(sorted(rng.choice(others, k, replace=False))) for _ in range(max_contexts)]
    return [tuple(sorted((i, *s))) for s in subsets]


def gmae_enumerate(
    M: int,
    k: int,
    context_reward: Callable[[tuple[int, ...]], np.ndarray],
    max_contexts: int = 256,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """GMAE of one group by enumeration: for each response i, the mean over its contexts T of
    r_i(T) − mean_{j∈T} r_j(T), with `context_reward(T)` the rewards of T's members when T is the group."""
    rng = rng or np.random.default_rng(0)
    out = np.zeros(M)
    for i in range(M):
        total = 0.0
        contexts = gmae_contexts(M, k, i, max_contexts, rng)
        for T in contexts:
            rT = np.asarray(context_reward(T), np.float64)
            total += rT[T.index(i)] - rT.mean()
        out[i] = total / len(contexts)
    return out


def gmae(g: Group, o: AdvantageConfig, state=None) -> Estimate:
    """GMAE: a response's advantage in expectation over the group contexts it could have been sampled into.

    A context is {i} ∪ S, S a uniform k-subset of the other responses (k = gmae_context, default M // 2); the
    advantage in a context is Dr. GRPO's r_i(T) − mean_T r(T). When rewards do not depend on the context (gold
    labels) this is k/(k + 1)·RLOO in closed form. With label-free rewards (`Group.answers`), r_i(T) is the majority
    vote of T (`majority_rewards`), enumerated over every context (or a seeded sample of gmae_max_contexts)."""
    r, valid = valid_rewards(g)
    X, M = r.shape
    if g.answers is None:  # context-free rewards: the closed form
        k = o.gmae_context or M // 2
        adv = np.asarray(rloo(r, valid), np.float64)
        n = valid.sum(1, keepdims=True)
        k_eff = np.minimum(k, np.maximum(n - 1, 0))
        return Estimate(np.where(valid, k_eff / (k_eff + 1) * adv, 0.0).astype(np.float32))
    answers = np.asarray(g.answers)
    rng = np.random.default_rng([g.seed, g.step, 19])
    adv = np.zeros((X, M))
    for x in range(X):
        idx = np.flatnonzero(valid[x])
        n = len(idx)
        if n < 2:
            continue
        k = min(o.gmae_context or M // 2, n - 1)
        a = answers[x, idx]
        adv[x, idx] = gmae_enumerate(
            n, k, lambda T, a=a: majority_rewards(a[list(T)][None])[0], o.gmae_max_contexts, rng
        )
    return Estimate(adv.astype(np.float32))


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


def maxpo(g: Group, o: AdvantageConfig, state=None) -> Estimate:
    """MaxPO (max@K, pass@K on 0/1 rewards) with the leave-two-out baseline, group by group (`maxpo_group`);
    a group with no more valid responses than K gets 0."""
    r, valid = valid_rewards(g)
    adv = np.zeros(r.shape)
    for x in range(r.shape[0]):
        idx = np.flatnonzero(valid[x])
        if len(idx) > o.maxpo_k:
            adv[x, idx] = maxpo_group(r[x, idx], o.maxpo_k)
    return Estimate(adv.astype(np.float32))


def lampo(g: Group, o: AdvantageConfig, state=None) -> Estimate:
    """LamPO: A_i = (1/(n−1)) Σ_{j≠i} w_ij (r_i − r_j), w_ij = 2σ(−τ·sign(r_i − r_j)·(ℓ_i − ℓ_j)), ℓ the mean token
    log-probability of a completion. A pair the policy already orders right (the better response is the likelier)
    weighs less than 1, one it orders wrong more (up to 2); w is symmetric, so each group sums to 0; τ = 0 is RLOO."""
    if g.seq_logp is None:
        raise ValueError("lampo needs the completions' mean log-probabilities (Group.seq_logp)")
    r, valid = valid_rewards(g)
    ell = np.where(valid, np.asarray(g.seq_logp, np.float64), 0.0)
    gap = r[:, :, None] - r[:, None, :]
    z = -o.lampo_temperature * np.sign(gap) * (ell[:, :, None] - ell[:, None, :])
    w = 2.0 / (1.0 + np.exp(-z))
    pair = valid[:, :, None] & valid[:, None, :]
    n = valid.sum(1, keepdims=True)
    adv = np.where(pair, w * gap, 0.0).sum(-1) / np.maximum(n - 1, 1)
    return Estimate(np.where(valid, adv, 0.0).astype(np.float32))


def ntf_init(o: AdvantageConfig) -> dict:
    """The EMA of earlier batches' mean reward and its weight."""
    return {"mean": np.zeros((), np.float32), "weight": np.zeros((), np.float32)}


def ntf(g: Group, o: AdvantageConfig, state: dict) -> Estimate:
    """Negative token filtering for single-rollout training (any group size, 1 included).

    Baseline b: the batch's mean reward (ntf_baseline = batch) or the EMA of earlier batches' means (ema; the batch
    mean while there is no history); A = (r − b), divided by the batch's reward std (+1e-4) with ntf_normalize. The
    tokens of a negative sample (A < 0) that the policy gave probability ≥ ntf_filter_prob get token weight 0: in a
    group they would be shared with its positive samples and cancel; alone they would be penalised for being right.
    (The probabilities are the policy's at temperature 1, as `generate` scores them; a filtered token keeps its place
    in its sequence's length under seq_mean_token_mean, so the other tokens are not reweighted. With the EMA
    baseline, the normalisation is still the batch's own std.)"""
    r, valid = valid_rewards(g)
    n = max(int(valid.sum()), 1)
    batch_mean = r.sum() / n
    W, m = float(state["weight"]), float(state["mean"])
    b = m if (o.ntf_baseline == "ema" and W > 0) else batch_mean
    adv = r - b
    if o.ntf_normalize:
        adv = adv / (np.sqrt(np.where(valid, (r - batch_mean) ** 2, 0.0).sum() / n) + 1e-4)
    adv = np.where(valid, adv, 0.0)
    weight, metrics = None, {"ntf_baseline": b}
    if g.token_logp is not None:
        mask = np.ones(np.shape(g.token_logp), bool) if g.token_mask is None else np.asarray(g.token_mask, bool)
        likely = np.asarray(g.token_logp, np.float64) >= np.log(o.ntf_filter_prob)
        drop = (adv < 0)[:, :, None] & likely & mask
        weight = np.where(drop, 0.0, 1.0).astype(np.float32)
        negative_tokens = ((adv < 0)[:, :, None] & mask).sum()
        metrics["ntf_filtered_fraction"] = float(drop.sum() / max(negative_tokens, 1))
    d = o.ntf_decay
    W_new = d * W + 1.0
    state = {"mean": np.float32((d * W * m + batch_mean) / W_new), "weight": np.float32(W_new)}
    return Estimate(adv.astype(np.float32), weight, state, metrics)


def ddrl(g: Group, o: AdvantageConfig, state=None) -> Estimate:
    """DDRL (label-free): fixed advantages from answer consistency, ambiguous groups left out, classes balanced.

    A group's consistency c is the fraction of it holding its modal answer. c ≥ ddrl_high: the modal answers are
    positive (+a), the others negative (−a); c ≤ ddrl_low: all negative (no consensus); in between, and a group of
    fewer than 2 valid responses (a lone answer is no consensus, nor its absence a disagreement): left out (0).
    Then the larger class is subsampled to the size of the smaller over the whole batch (a seeded draw from
    (seed, step)), so positives and negatives carry equal weight; a batch with no positives (or no negatives) keeps
    nothing, and its update is zero."""
    if g.answers is None:
        raise ValueError("ddrl needs the parsed answers (label-free mode: data.reward = 'majority')")
    _, valid = valid_rewards(g)
    a = np.where(valid, np.asarray(g.answers), -1)
    X, M = a.shape
    same = (a[:, :, None] == a[:, None, :]) & (a[:, None, :] >= 0)
    counts = np.where(a >= 0, same.sum(-1), 0)
    c = counts.max(1) / np.maximum(valid.sum(1), 1)
    modal = (counts == counts.max(1, keepdims=True)) & (counts > 0)
    label = np.zeros((X, M))
    enough = valid.sum(1) >= 2
    high, low = enough & (c >= o.ddrl_high), enough & (c <= o.ddrl_low)
    label[high] = np.where(modal[high], 1.0, -1.0)
    label[low] = -1.0
    label = np.where(valid, label, 0.0)
    rng = np.random.default_rng([g.seed, g.step, 23])
    pos, neg = np.flatnonzero(label.ravel() > 0), np.flatnonzero(label.ravel() < 0)
    keep = min(len(pos), len(neg))
    flat = np.zeros(X * M)
    flat[rng.permutation(pos)[:keep]] = o.ddrl_value
    flat[rng.permutation(neg)[:keep]] = -o.ddrl_value
    metrics = {
        "ddrl_excluded_groups": float(np.mean(~high & ~low)),
        "ddrl_kept_fraction": float(2 * keep / max(int(valid.sum()), 1)),
    }
    return Estimate(flat.reshape(X, M).astype(np.float32), metrics=metrics)


register_advantage("agrae", agrae, options=("horizon", "agrae_positive", "agrae_positive_final", "agrae_focus"))
register_advantage(
    "bv_blend",
    bv_blend,
    bv_blend_init,
    options=("cluster_key", "bv_clusters", "bv_decay", "bv_blend_max", "bv_sem", "bv_prior_var"),
)
register_advantage("gmae", gmae, options=("gmae_context", "gmae_max_contexts"))
register_advantage("maxpo", maxpo, options=("maxpo_k",))
register_advantage("lampo", lampo, options=("lampo_temperature",))
register_advantage(
    "ntf", ntf, ntf_init, single_rollout=True, options=("ntf_baseline", "ntf_decay", "ntf_normalize", "ntf_filter_prob")
)
register_advantage("ddrl", ddrl, label_free_only=True, options=("ddrl_low", "ddrl_high", "ddrl_value"))


def cluster_id(key: str, clusters: int) -> int:
    """A cluster key (any string) hashed into [0, clusters)."""
    return answer_id(key) % clusters
