"""Credit accuracy: how well each group-advantage estimator's per-step advantages agree with Monte Carlo step
advantages, on groups sampled from a fixed model.

For P held-out prompts, M completions each are sampled (at `grpo.temperature`) and cut into steps; each estimator
(`esroll.grpo.advantages`) gives per-token advantages, read per step as the mean over the step's tokens (constant
within a step for the step-level ones). The reference is the Monte Carlo step advantage V(after) − V(before)
(`esroll.grpo.estimators.mc_steps.step_values`): V(prompt) from K_ref fresh rollouts of the prompt, V(after step s)
from K_ref fresh continuations from the end of step s, and after the last step the completion's own reward. No
value shares a sample with the group, so the reference is unbiased at every step and its error is independent of
each method's estimate. Its standard error is sqrt(var_after / K_ref + var_before / K_ref) from the sample variances
(ddof 1), with var 0 for the completion's own reward. Scores, pooled over the steps of all prompts' valid
completions:
    spearman            rank correlation of the method's step advantages with the reference's;
    spearman_corrected  the same over the square root of the reference's split-half reliability (`reliability`):
                        an estimate of the correlation with the noise-free step advantages;
    sign_agreement      over the steps whose reference is non-zero at 95% (|A| > 1.96·SE), the fraction where the
                        method's advantage has the reference's sign (0 counts as a disagreement);
    equal_signal        the share of the groups whose rewards are all equal that the method gives a non-zero
                        advantage;
each with a percentile bootstrap interval over prompts. `exprl` reads its own judge's step scores (`JUDGED`) in
place of `steps.verifier`'s; `exprl_rise` is it with the first step credited its rise (`OPTION_ROWS`). `mc_steps`
itself is scored at a small count of continuations (`mc_ks`) sampled apart from the reference's (its V(prompt)
leave-one-out from the group); `appo` with its own branches at the token positions it picks (`BRANCHED`: against
the sampling model itself its Ω is 1, so they are the most uncertain tokens). A learned critic (PPO's,
`esroll.grpo.ppo`) is scored by the advantages PPO trains with: its values before each generated token, GAE at
`grpo.adv.gae`'s options (λ as set, row `ppo`; and λ = 1, row `ppo_lam1`: the return minus the value, no
bootstrapping), whitened as set; an SR-PPO success head by its pass@k credit at k = 1 and 4 (rows `srppo_k1`,
`srppo_k4`, `esroll.grpo.estimators.srppo`). `experiments.credit` runs it and writes the report (docs/step_level.md).

Shape letters (see `esroll`): X prompts, M completions per prompt, J steps, A samples (the fresh rollouts of a
prompt, the continuations from the end of a step), N tokens.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

import jax
import numpy as np
import scipy.stats

from esroll.grpo import advantages, ppo
from esroll.grpo.advantages import Group
from esroll.grpo.branching import token_branches
from esroll.grpo.estimators.mc_steps import step_values
from esroll.grpo.estimators.srppo import SrPpoOptions
from esroll.grpo.method import estimator_group
from esroll.report import paired_test
from esroll.rollout import Sampling, rollout
from esroll.steps import branch, with_steps
from esroll.steps.branch import branch_rewards, score_steps

SCORED = ("grpo", "sas", "verigate", "guae", "ibpo", "graft", "graft_gae", "progpo", "exprl")
JUDGED = {"exprl": "exprl"}  # estimator -> the step verifier whose scores it reads in place of `steps.verifier`'s
BRANCHED = ("appo",)  # scored with branches at the token positions it picks (`branch_at`)
OPTION_ROWS = {"exprl_rise": ("exprl", {"first_step": "rise"})}  # row -> (estimator, options other than its defaults)
Z95 = 1.959963984540054


def per_step(adv_XxMxN: np.ndarray, g: Group) -> np.ndarray:
    """[X, M, J]: a per-token (or per-completion [X, M]) advantage read per step as the mean over the step's tokens
    (`esroll.grpo.advantages.step_means`); NaN past a completion's steps. J = the most steps of any completion."""
    adv = np.asarray(adv_XxMxN, np.float64)
    if adv.ndim == 2:
        adv = np.broadcast_to(adv[..., None], g.token_mask.shape)
    return advantages.step_means(g, adv)


def _mean_and_variance_of_mean(rewards: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mean, variance of the mean) over the last axis, ignoring NaN: the sample variance with ddof 1 over the count
    (unbiased); the variance is NaN where fewer than two values are known."""
    k = np.sum(~np.isnan(rewards), axis=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # empty or one-value slices
        mean = np.nanmean(rewards, axis=-1)
        var = np.nanvar(rewards, axis=-1, ddof=1) / k
    return mean, np.where(k >= 2, var, np.nan)


def reference(g: Group, prompt_rewards_XxA: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(advantages [X, M, J], standard errors [X, M, J]) of the Monte Carlo step advantages (see the module
    docstring): V(prompt) from `prompt_rewards_XxA`, the rewards of A fresh rollouts of each prompt (NaN for one that
    is not valid), V(after step s) from `g.branch_rewards`. Neither shares a sample with the group's rewards, so the
    reference's error is independent of every method's estimate. NaN where undefined (past a completion's steps,
    invalid completions); the standard error is NaN where a value it needs has fewer than two samples."""
    v0, var0 = _mean_and_variance_of_mean(np.asarray(prompt_rewards_XxA, np.float64))
    values, adv = step_values(g, v0)
    _, var_k = _mean_and_variance_of_mean(np.asarray(g.branch_rewards, np.float64))  # [X, M, J]: of V(after s)
    X, M, J1 = values.shape
    J = J1 - 1
    counts = np.asarray(g.steps.count_B).reshape(X, M)
    var_after = np.full((X, M, J), np.nan)
    var_after[..., : var_k.shape[2]] = var_k[..., :J]
    last = np.arange(J)[None, None, :] == (counts - 1)[..., None]
    var_after = np.where(last, 0.0, var_after)  # after the last step: the completion's own reward
    var_before = np.concatenate([np.broadcast_to(var0[:, None, None], (X, M, 1)), var_after[..., :-1]], axis=2)
    se = np.sqrt(var_after + var_before)
    return adv, np.where(np.isnan(adv), np.nan, se)


def split_half(g: Group, prompt_rewards_XxA: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two independent references ([X, M, J] advantages each), from the first and the second half of the
    continuations at every boundary and of the prompt's fresh rollouts: their agreement measures the full
    reference's reliability (`scores`). Both counts must be even, so that the full reference is exactly the two
    halves' mean, the premise of the Spearman–Brown step-up."""
    br, pr = np.asarray(g.branch_rewards), np.asarray(prompt_rewards_XxA)
    if br.shape[-1] % 2 or pr.shape[-1] % 2 or not br.shape[-1] or not pr.shape[-1]:
        raise ValueError(f"split_half: an even number >= 2 of continuations and of prompt rollouts, got "
                         f"{br.shape[-1]} and {pr.shape[-1]}")  # fmt: skip
    k, k0 = br.shape[-1] // 2, pr.shape[-1] // 2
    first = reference(g._replace(branch_rewards=br[..., :k]), pr[:, :k0])[0]
    second = reference(g._replace(branch_rewards=br[..., k : 2 * k]), pr[:, k0 : 2 * k0])[0]
    return first, second


def prompt_value_gap(prompt_rewards_XxA: np.ndarray, rewards_XxM: np.ndarray) -> dict:
    """The per-prompt difference between the fresh rollouts' mean reward and the group's, its mean over prompts and
    its 95% t interval (`prompt_value_gap`, `_low`, `_high`; `esroll.report.paired_test`): both estimate V(prompt)
    from the same policy, so the interval should contain 0; a check that the fresh rollouts sample as the group
    does."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a prompt with no valid reward
        gap = np.nanmean(prompt_rewards_XxA, axis=1) - np.nanmean(rewards_XxM, axis=1)
    test = paired_test(gap[~np.isnan(gap)])
    return {
        "prompt_value_gap": test["mean"],
        "prompt_value_gap_low": test["ci_low"],
        "prompt_value_gap_high": test["ci_high"],
    }


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    if a.size > 2 and np.ptp(a) > 0 and np.ptp(b) > 0:
        return float(scipy.stats.spearmanr(a, b).statistic)
    return np.nan


def reliability(first: np.ndarray, second: np.ndarray) -> float:
    """The reliability of a reference that averages two independent half-references (its share of variance that
    is signal, on the rank scale): the Spearman–Brown step-up 2ρ / (1 + ρ) of their rank correlation ρ over the
    steps both define; NaN when ρ ≤ 0 or undefined."""
    both = ~np.isnan(first) & ~np.isnan(second)
    rho = _spearman(first[both], second[both])
    return 2 * rho / (1 + rho) if rho > 0 else np.nan


def scores(
    method_XxMxJ: np.ndarray,
    token_adv: np.ndarray,
    ref_XxMxJ: np.ndarray,
    se_XxMxJ: np.ndarray,
    equal_X: np.ndarray,
    *,
    halves: tuple[np.ndarray, np.ndarray] | None = None,
    boot: int = 1000,
    seed: int = 0,
) -> dict:
    """The scores of one method (module docstring) with 95% percentile bootstrap intervals over prompts
    (`boot` resamples of the X prompts, drawn from `seed`). With `halves` (`split_half`), also the reference's
    `reliability` and `spearman_corrected` = spearman / sqrt(reliability), the correlation the method would have
    with a noise-free reference (Spearman's correction for attenuation; valid because the reference's error is
    independent of the method's), each computed within every resample. The correction is an estimate: with a noisy
    reliability it can exceed 1."""
    X = method_XxMxJ.shape[0]
    J = min(method_XxMxJ.shape[2], ref_XxMxJ.shape[2])
    m, ref, se = method_XxMxJ[..., :J], ref_XxMxJ[..., :J], se_XxMxJ[..., :J]
    known = ~np.isnan(ref) & ~np.isnan(m)
    significant = known & (np.abs(ref) > Z95 * se)
    signal = np.abs(np.asarray(token_adv, np.float64)).reshape(X, -1).max(1) > 1e-9

    if halves is not None:
        first, second = (np.asarray(h, np.float64)[..., :J] for h in halves)
    names = ("spearman", "sign_agreement", "equal_signal") + (("reliability", "spearman_corrected") if halves else ())

    def one(prompts: np.ndarray) -> tuple[float, ...]:
        k, sig = known[prompts], significant[prompts]
        rho = _spearman(m[prompts][k], ref[prompts][k])
        agree = float(np.mean(np.sign(m[prompts][sig]) == np.sign(ref[prompts][sig]))) if sig.any() else np.nan
        eq = equal_X[prompts]
        share = float(signal[prompts][eq].mean()) if eq.any() else np.nan
        if halves is None:
            return rho, agree, share
        rel = reliability(first[prompts], second[prompts])
        return rho, agree, share, rel, float(rho / np.sqrt(rel))

    point = one(np.arange(X))
    rng = np.random.default_rng(seed)
    draws = np.array([one(rng.integers(0, X, X)) for _ in range(boot)]) if boot else np.empty((0, len(names)))
    out = {"steps": int(known.sum()), "significant_steps": int(significant.sum()), "equal_groups": int(equal_X.sum())}
    for i, name in enumerate(names):
        col = draws[:, i][~np.isnan(draws[:, i])] if boot else np.empty(0)
        low, high = np.percentile(col, [2.5, 97.5]) if col.size else (np.nan, np.nan)
        out[name], out[f"{name}_low"], out[f"{name}_high"] = point[i], float(low), float(high)
    return out


def measure(
    cfg,
    task,
    params,
    mesh,
    examples: Sequence,
    *,
    group_size: int = 8,
    k_ref: int = 16,
    mc_ks: Sequence[int] = (2, 4),
    seed: int = 0,
    boot: int = 1000,
    rows_per_call: int = 512,
    critic: dict | None = None,
    success_head: dict | None = None,
) -> dict:
    """Sample the groups, the reference and the small-count continuations, and score every method of `SCORED` and
    `mc_steps` at each of `mc_ks`. Returns {method: scores} and the sample's figures under "sample". The
    continuations are decoded `rows_per_call` rows at a time (a memory bound; the tokens do not depend on it). With
    `critic` (a value model's parameters, `esroll.critic`, trained beside this policy), the rows `ppo` and
    `ppo_lam1` score its GAE advantages; with `success_head` (an SR-PPO run's critic), `srppo_k1` and `srppo_k4` score
    its pass@k credit."""
    X, M = len(examples), group_size
    sampling = Sampling(cfg.train.max_new_tokens, cfg.grpo.temperature, rows_per_device=rows_per_call)
    steps_cfg = cfg.steps
    key = jax.random.key(seed)
    out = rollout(
        task, mesh, params, examples, np.repeat(np.arange(X), M), jax.random.fold_in(key, 0), sampling,
        completions=True,
    )  # fmt: skip
    out = with_steps(out, task, examples, steps_cfg, scored=True)
    rewards = np.asarray(out.reward_B, np.float64).reshape(X, M)
    mask = np.arange(out.tokens_BxN.shape[1])[None, :] < out.length_B[:, None]
    needs = ("logprobs", "steps", "step_scores", "states")
    g = estimator_group(out, rewards, mask, list(examples), 0, seed, needs)
    shape = (X, M, steps_cfg.max_steps)
    ref_branches, origin = branch(task, mesh, params, examples, out, jax.random.fold_in(key, 1), sampling, k_ref)
    fresh = rollout(task, mesh, params, examples, np.repeat(np.arange(X), k_ref), jax.random.fold_in(key, 3), sampling)
    prompt_rewards = np.asarray(fresh.reward_B, np.float64).reshape(X, k_ref)
    g_ref = g._replace(branch_rewards=branch_rewards(ref_branches, origin, shape, k_ref))
    ref, se = reference(g_ref, prompt_rewards)
    halves = split_half(g_ref, prompt_rewards)
    equal = advantages.all_equal(g)
    results = {}
    rows = {name: (name, None) for name in SCORED}
    for row, (name, changed) in OPTION_ROWS.items():
        rows[row] = (name, dataclasses.replace(advantages.ESTIMATORS.options_of({}, name), **changed))
    judged = {  # each judge's step scores, scored once for every row that reads them
        v: g._replace(
            step_scores=score_steps(out.example_B, out.steps, examples, v, steps_cfg.max_steps).reshape(X, M, -1)
        )
        for v in set(JUDGED.values())
    }
    for i, (row, (name, options)) in enumerate(rows.items()):
        g_name = judged[JUDGED[name]] if name in JUDGED else g
        est = advantages.estimate(name, g_name, options, advantages.init_estimator_state(name, options))
        results[row] = scores(
            per_step(est.advantage, g), est.advantage, ref, se, equal, halves=halves, boot=boot, seed=seed + i
        )
    if critic is not None:
        options = advantages.ESTIMATORS.options_of(cfg.grpo.adv, "gae")
        values = ppo.rollout_values(task.cfg, critic, out, mesh).reshape(g.token_mask.shape)
        for i, (name, lam) in enumerate((("ppo", options.lam), ("ppo_lam1", 1.0))):
            est = advantages.estimate("gae", g._replace(values=values), dataclasses.replace(options, lam=lam))
            results[name] = scores(
                per_step(est.advantage, g), est.advantage, ref, se, equal, halves=halves, boot=boot, seed=seed + i
            )
    if success_head is not None:
        logits = ppo.rollout_values(task.cfg, success_head, out, mesh).reshape(g.token_mask.shape)
        for k in (1, 4):
            est = advantages.estimate("srppo", g._replace(values=logits), SrPpoOptions(k=float(k)))
            results[f"srppo_k{k}"] = scores(
                per_step(est.advantage, g), est.advantage, ref, se, equal, halves=halves, boot=boot, seed=seed + k
            )
    k_max = max(mc_ks)
    small, origin_k = branch(task, mesh, params, examples, out, jax.random.fold_in(key, 2), sampling, k_max)
    small_rewards = branch_rewards(small, origin_k, shape, k_max)
    for k in mc_ks:
        est = advantages.estimate("mc_steps", g._replace(branch_rewards=small_rewards[..., :k]))
        results[f"mc_steps_k{k}"] = scores(
            per_step(est.advantage, g), est.advantage, ref, se, equal, halves=halves, boot=boot, seed=seed
        )
    # APPO at its defaults, its branches at the positions it picks: Ω against the sampling model itself is 1, so
    # they are the most uncertain tokens, and its scale a constant 1.5
    options = advantages.ESTIMATORS.options_of({}, "appo")
    g_appo = token_branches(
        task, mesh, params, None, examples, out, g, "appo", options, jax.random.fold_in(key, 4), sampling,
        cfg.grpo.logprob_chunk,
    )[0]  # fmt: skip
    est = advantages.estimate("appo", g_appo, options)
    results["appo"] = scores(
        per_step(est.advantage, g), est.advantage, ref, se, equal, halves=halves, boot=boot, seed=seed
    )
    results["sample"] = {
        "prompts": X,
        "group_size": M,
        "k_ref": k_ref,
        "mean_reward": float(np.nanmean(rewards)),
        "mean_steps": float(np.mean(out.steps.count_B)),
        "all_equal_groups": int(equal.sum()),
        "reference_rows": len(origin),
        "prompt_rollouts": X * k_ref,
        "prompt_value": float(np.nanmean(prompt_rewards)),
        **prompt_value_gap(prompt_rewards, rewards),
    }
    return results
