"""Does APPO's Branching Score find the decisions that matter? At every token position t ≥ 1 of completions sampled
from a fixed model, the Monte Carlo value change of the token there,

    ΔV_t = V(first t + 1 tokens) − V(first t tokens),

V(first t tokens) the mean reward of K continuations sampled from the completion's first t tokens (`branch_at`) and
V of the whole completion its own reward, set against the score APPO would give the token (`branching_scores`:
entropy, future likelihood gain Ω against a reference policy, and their product BS). Scores, each with a percentile
bootstrap interval over prompts:
    spearman         rank correlation of the signal with |ΔV_t|, pooled over every position of every completion;
    spearman_within  the mean over completions of the rank correlation within the completion (APPO ranks positions
                     within a completion);
    lift             mean |ΔV| at the positions APPO would branch at (`choose_positions`; for entropy and Ω alone,
                     their top positions; Ω picks none in a completion where it is the same everywhere) over what
                     as many positions drawn at random from each of the same completions would carry on average (the
                     completion's mean |ΔV|, once per pick): 1, no better than random;
    lift_over_entropy  BS's and Ω's lift less the entropy's, paired on the same completions.
|ΔV| from K continuations is noisy; `reliability` is the split-half rank correlation of |ΔV| from two halves of the
continuations, stepped up to K (Spearman–Brown): the ceiling a noise-free signal's correlation would be seen under.
`experiments.branching` runs it and writes the report (docs/step_level.md).

Shape letters (see `esroll`): B completions, N tokens, K continuations per position."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import jax
import numpy as np
import scipy.stats

from esroll.grpo.estimators.appo import AppoOptions, branching_scores, choose_positions, future_gain
from esroll.rollout import Sampling, rollout
from esroll.scoring import rollout_logprobs
from esroll.steps import branch_at

SIGNALS = ("bs", "entropy", "omega")


def value_changes(continuation_BxTxK: np.ndarray, reward_B: np.ndarray, length_B: np.ndarray) -> np.ndarray:
    """[B, T] ΔV_t at t = 1..T (column t − 1): V(first t tokens) is the mean of the continuations'
    rewards `continuation_BxTxK[:, t − 1]`, and V(first L tokens) the completion's own reward (L its length); NaN at
    t ≥ L, where no token is left to choose."""
    B, T, _ = continuation_BxTxK.shape
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN: positions past the end
        v = np.nanmean(continuation_BxTxK, axis=-1)  # [B, T]: V(first t tokens), t = 1..T
    after = np.concatenate([v[:, 1:], np.full((B, 1), np.nan)], 1)  # V(first t + 1 tokens)
    t = np.arange(1, T + 1)[None, :]
    L = np.asarray(length_B)[:, None]
    after = np.where(t + 1 == L, np.asarray(reward_B, np.float64)[:, None], after)
    return np.where(t < L, after - v, np.nan)


def _spearman(a, b) -> float:
    if len(a) < 3 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return np.nan
    return float(scipy.stats.spearmanr(a, b)[0])


def _scores(signal_BxT, dv_BxT, chosen_BxC, rows) -> dict:
    """The three scores of one signal over completions `rows`."""
    rows = np.asarray(rows)
    ok = np.isfinite(dv_BxT[rows])
    pooled = _spearman(signal_BxT[rows][ok], np.abs(dv_BxT[rows][ok]))
    within, at, every = [], [], []
    for b in rows:
        keep = np.isfinite(dv_BxT[b])
        within.append(_spearman(signal_BxT[b, keep], np.abs(dv_BxT[b, keep])))
        picked = [t - 1 for t in chosen_BxC[b] if t >= 1]
        if picked:  # the completions the signal chose in, each counted once per pick in the baseline
            at.extend(np.abs(dv_BxT[b, picked]))
            every.extend([np.abs(dv_BxT[b, keep]).mean()] * len(picked))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean_within = float(np.nanmean(within)) if within else np.nan
    lift = float(np.mean(at) / np.mean(every)) if at and np.mean(every) > 0 else np.nan
    return {"spearman": pooled, "spearman_within": mean_within, "lift": lift}


def score_signals(signals: dict, dv_BxT, chosen: dict, prompt_B, boot: int = 1000, seed: int = 0) -> dict:
    """{signal: {score: value, score_low/high: 95% percentile bootstrap over prompts}} (`_scores`), and for each
    signal but the entropy `lift_over_entropy`, its lift less the entropy's on the same completions (paired)."""
    prompts = np.unique(prompt_B)
    by_prompt = [np.flatnonzero(prompt_B == p) for p in prompts]
    rng = np.random.default_rng(seed)
    draws = [np.concatenate([by_prompt[i] for i in rng.integers(0, len(prompts), len(prompts))]) for _ in range(boot)]
    every = np.arange(len(prompt_B))

    def paired(name, rows):
        got = _scores(signals[name], dv_BxT, chosen[name], rows)
        if name != "entropy":
            got["lift_over_entropy"] = (
                got["lift"] - _scores(signals["entropy"], dv_BxT, chosen["entropy"], rows)["lift"]
            )
        return got

    out = {}
    for name in signals:
        point = paired(name, every)
        samples = [paired(name, rows) for rows in draws]
        res = dict(point)
        for key in point:
            vals = np.array([d[key] for d in samples], np.float64)
            vals = vals[np.isfinite(vals)]
            res[key + "_low"], res[key + "_high"] = (
                (float(np.percentile(vals, 2.5)), float(np.percentile(vals, 97.5))) if len(vals) else (np.nan, np.nan)
            )
        out[name] = res
    return out


def _top(signal_BxT, length_B, count):
    """[B, count] the positions t ≥ 1 of the highest signal (ties: the earlier), -1 where a row has fewer."""
    out = np.full((len(length_B), count), -1, np.int64)
    for b, L in enumerate(length_B):
        t = np.arange(1, int(L))
        order = np.lexsort((t, -signal_BxT[b, t - 1]))[:count]
        out[b, : len(order)] = t[order]
    return out


def measure(
    cfg,
    task,
    params,
    ref_params,
    mesh,
    examples: Sequence,
    *,
    group_size: int = 2,
    k: int = 16,
    options: AppoOptions = AppoOptions(),
    seed: int = 0,
    boot: int = 1000,
    rows_per_call: int = 512,
) -> dict:
    """Sample `group_size` completions per example, continue each `k` times from every position t ≥ 1, and score
    BS, entropy and Ω (against `ref_params`) on |ΔV| (`score_signals`). Returns the scores per signal, the
    reliability and the sample's figures under "sample"."""
    X, M = len(examples), group_size
    sampling = Sampling(cfg.train.max_new_tokens, cfg.grpo.temperature, rows_per_device=rows_per_call)
    key = jax.random.key(seed)
    out = rollout(
        task, mesh, params, examples, np.repeat(np.arange(X), M), jax.random.fold_in(key, 0), sampling,
        completions=True,
    )  # fmt: skip
    N = out.tokens_BxN.shape[1]
    mask = np.arange(N)[None, :] < out.length_B[:, None]
    chunk = cfg.grpo.logprob_chunk
    logp, entropy = rollout_logprobs(task.cfg, params, out, True, chunk)
    logratio = logp - rollout_logprobs(task.cfg, ref_params, out, False, chunk)
    bs, z_h, z_o = branching_scores(entropy, logratio, mask, options)
    omega = np.clip(future_gain(logratio, mask, options.gamma), options.omega_low, options.omega_high)
    T = N - 1
    at = np.where(np.arange(1, N)[None, :] < out.length_B[:, None], np.arange(1, N)[None, :], -1)
    branched, origin = branch_at(task, mesh, params, examples, out, at, jax.random.fold_in(key, 1), sampling, k)
    cont = np.full((X * M, T, k), np.nan)
    rewards = np.asarray(branched.reward_B, np.float64)
    for r, (b, t) in enumerate(origin):
        cont[b, t, r % k] = rewards[r]
    reward_B = np.asarray(out.reward_B, np.float64)
    dv = value_changes(cont, reward_B, out.length_B)
    halves = [value_changes(cont[..., h::2], reward_B, out.length_B) for h in (0, 1)]
    ok = np.isfinite(dv)
    r_half = _spearman(np.abs(halves[0][ok]), np.abs(halves[1][ok]))
    signals = {"bs": bs[:, 1:], "entropy": entropy[:, 1:], "omega": omega[:, 1:]}
    chosen = {
        "bs": choose_positions(bs, z_h, z_o, out.length_B, options.positions),
        "entropy": _top(signals["entropy"], out.length_B, options.positions),
        "omega": _top(signals["omega"], out.length_B, options.positions),
    }
    flat = [np.ptp(omega[b, : out.length_B[b]]) == 0 for b in range(X * M)]
    chosen["omega"][flat] = -1  # Ω the same at every token: it picks nothing (its ties would pick the first tokens)
    results = score_signals(signals, dv, chosen, np.repeat(np.arange(X), M), boot, seed)
    results["reliability"] = 2 * r_half / (1 + r_half) if np.isfinite(r_half) else np.nan
    results["sample"] = {
        "prompts": X,
        "completions": X * M,
        "positions": int(ok.sum()),
        "continuations": len(origin),
        "k": k,
        "mean_reward": float(reward_B.mean()),
        "abs_dv_mean": float(np.abs(dv[ok]).mean()),
        "omega_varies": float(np.mean([np.ptp(omega[b, : out.length_B[b]]) > 0 for b in range(X * M)])),
        "positions_per_branch": options.positions,
    }
    return results
