"""The statistics of a comparison's runs (`esroll.report.runs.RunResult`): AUC, paired tests, per-run and per-method
rows.

A run's AUC against time is its mean accuracy over [0, budget] (`area_under_curve`); in a count view (completions,
tokens, training FLOPs) it is the mean accuracy over [0, X], X the view's common range: the smallest final count among
the finished runs of all methods, so that every method is compared over the same range (`view_ranges`, `view_auc`).
Runs without a view's counter are left out of that view (its AUCs, range and pairs), with the runs and pairs each view
covers reported (n_seeds_tokens, n_pairs_tokens, n_seeds_flops, n_pairs_flops).

`per_run_rows` gives one row per run, `summarize` one row per method over its finished runs with paired differences
against the reference on the seeds both finished (`paired_test`), each metric's paired t p-values Holm-adjusted over
the methods (`holm`). Imports no JAX.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import stats

from esroll.report.runs import VIEWS, RunResult, view_x


# ---- AUC, in each view


def area_under_curve(times: Sequence[float], accuracies: Sequence[float], budget: float) -> float:
    """Mean accuracy over [0, budget]: trapezoids between evaluations, the curve held at its last value up to the
    budget (or interpolated at the budget when an evaluation lies beyond it), divided by the budget."""
    t, a = np.asarray(times, float), np.asarray(accuracies, float)
    inside = t < budget
    t_in = np.r_[t[inside], budget]
    a_in = np.r_[a[inside], np.interp(budget, t, a)]
    if t_in[0] > 0:  # before the first evaluation, its value
        t_in, a_in = np.r_[0.0, t_in], np.r_[a_in[0], a_in]
    return float(np.trapezoid(a_in, t_in) / budget)


def view_ranges(runs: Sequence[RunResult], budget: float) -> dict[str, float]:
    """The range [0, X] each view's AUC covers: the time budget, and for completions, tokens and FLOPs the smallest
    final count among the finished runs in `runs` (all methods), runs without the view's counter (tokens, FLOPs) left
    out (NaN: no such run)."""
    out = {"time": float(budget)}
    for view in VIEWS[1:]:
        finals = [float(view_x(r, view)[-1]) for r in runs if r.complete]
        finals = [x for x in finals if math.isfinite(x)]
        out[view] = min(finals) if finals else math.nan
    return out


def view_auc(run: RunResult, view: str, upper: float) -> float:
    """`area_under_curve` of the run in `view` over [0, upper]; NaN when the run has no x there or upper is not > 0."""
    x = view_x(run, view)
    if not (math.isfinite(upper) and upper > 0) or not np.isfinite(x).all():
        return math.nan
    return area_under_curve(x, run.accuracies, upper)


# ---- paired tests and rows


def paired_test(differences: Sequence[float]) -> dict[str, float]:
    """Mean and sd of paired differences (method − reference), the t-based 95% confidence interval of the mean, the
    paired t-test p-value, and two exact small-sample tests: Wilcoxon signed-rank and the sign test (zeros dropped).
    `mde80`: the smallest true mean difference the two-sided paired t-test at 0.05 detects with 80% power at this n
    and this sd, (t_0.975 + t_0.8)·sd/√n with n − 1 degrees of freedom (the usual approximation): an effect smaller
    than it can go unseen at this sample size.

    With n pairs the smallest two-sided p the Wilcoxon and sign tests can give is 2·0.5^n (0.25 for n = 3). When all
    differences are equal the t statistic, its p and the interval are undefined (NaN).
    """
    d = np.asarray(differences, float)
    n = len(d)
    out = dict.fromkeys(("ci_low", "ci_high", "t", "p_t", "p_wilcoxon", "p_sign", "mde80"), math.nan)
    out = {"n": n, **_mean_sd(d), **out}
    if n < 2:
        return out
    if out["sd"] > 0:
        half = stats.t.ppf(0.975, n - 1) * out["sd"] / math.sqrt(n)
        out["t"] = out["mean"] / (out["sd"] / math.sqrt(n))
        p_t = float(2 * stats.t.sf(abs(out["t"]), n - 1))
        out.update(ci_low=out["mean"] - half, ci_high=out["mean"] + half, p_t=p_t)
    out["mde80"] = float((stats.t.ppf(0.975, n - 1) + stats.t.ppf(0.8, n - 1)) * out["sd"] / math.sqrt(n))
    nonzero = d[d != 0]
    if len(nonzero) == 0:
        out.update(p_wilcoxon=1.0, p_sign=1.0)
    else:
        out["p_wilcoxon"] = float(stats.wilcoxon(nonzero).pvalue)
        out["p_sign"] = float(stats.binomtest(int((nonzero > 0).sum()), len(nonzero), 0.5).pvalue)
    return out


def _mean_sd(values: Sequence[float]) -> dict[str, float]:
    v = np.asarray(values, float)
    return {"mean": float(v.mean()) if len(v) else math.nan, "sd": float(v.std(ddof=1)) if len(v) > 1 else math.nan}


def per_run_rows(
    runs: Sequence[RunResult], budget: float, ranges: dict[str, float] | None = None
) -> list[dict[str, Any]]:
    """One row per run: its status, steps, first and last evaluation, AUC over `budget`, AUC against completions,
    tokens and training FLOPs over their common ranges (`view_ranges`; by default those of the finished runs in
    `runs`), and what it generated. final_completions, final_tokens and final_flops are the counts at the last
    evaluation (NaN: not logged)."""
    ranges = view_ranges(runs, budget) if ranges is None else ranges
    return [
        {
            "method": r.method,
            "seed": r.seed,
            "complete": r.complete,
            "steps": r.steps,
            "wall_time": r.wall_time,
            "initial_accuracy": float(r.accuracies[0]),
            "final_accuracy": r.final_accuracy,
            "auc": area_under_curve(r.times, r.accuracies, budget),
            "auc_completions": view_auc(r, "completions", ranges["completions"]),
            "auc_tokens": view_auc(r, "tokens", ranges["tokens"]),
            "auc_flops": view_auc(r, "flops", ranges["flops"]),
            "evaluations": r.evaluations_per_step * r.steps,
            "completions": r.completions_per_step * r.steps,
            "final_completions": float(r.completions[-1]),
            "final_tokens": float(r.tokens[-1]),
            "final_flops": float(r.flops[-1]),
            "all_equal_groups": r.all_equal_groups,
            "all_equal_signal": r.all_equal_signal,
        }
        for r in runs
    ]


_PAIRED = ("final_accuracy", "auc", "auc_completions", "auc_tokens", "auc_flops")  # summarize's paired differences


def summarize(
    runs: Sequence[RunResult],
    methods: Sequence[str],
    reference: str,
    budget: float,
    ranges: dict[str, float] | None = None,
) -> list[dict[str, Any]]:
    """One row per method over its finished runs: final accuracy, AUC against time, completions, tokens and training
    FLOPs (mean, sd over seeds), steps and generation counts, and paired differences against `reference` on the seeds
    both finished.

    The count views' AUCs cover `ranges` (by default `view_ranges` of the finished runs in `runs`), written as
    range_completions, range_tokens and range_flops. Runs without token counts are left out of the tokens view
    (n_seeds_tokens, n_pairs_tokens: the runs and pairs it covers), runs without the FLOPs counter out of the FLOPs
    view (n_seeds_flops, n_pairs_flops).
    """
    finished = [r for r in runs if r.complete]
    ranges = view_ranges(finished, budget) if ranges is None else ranges
    rows = {(r["method"], r["seed"]): r for r in per_run_rows(finished, budget, ranges)}
    out = []
    for name in methods:
        mine = {seed: row for (m, seed), row in rows.items() if m == name}
        row: dict[str, Any] = {"method": name, "n_seeds": len(mine)}
        row["n_seeds_tokens"] = sum(math.isfinite(r["final_tokens"]) for r in mine.values())
        row["n_seeds_flops"] = sum(math.isfinite(r["final_flops"]) for r in mine.values())
        row["range_completions"], row["range_tokens"] = ranges["completions"], ranges["tokens"]
        row["range_flops"] = ranges["flops"]
        keys = ("final_accuracy", "auc", "auc_completions", "auc_tokens", "auc_flops")
        keys += ("steps", "evaluations", "completions", "final_completions", "final_tokens", "final_flops")
        for key in (*keys, "all_equal_groups", "all_equal_signal"):
            values = [v for v in (r[key] for r in mine.values()) if not math.isnan(v)]
            row.update({f"{key}_{k}": v for k, v in _mean_sd(values).items()})
        if name != reference:
            seeds = sorted(s for s in mine if (reference, s) in rows)
            row["n_pairs"] = len(seeds)
            for key in _PAIRED:
                diffs = [mine[s][key] - rows[(reference, s)][key] for s in seeds]
                test = paired_test([d for d in diffs if not math.isnan(d)])
                if key in ("auc_tokens", "auc_flops"):
                    row[f"n_pairs_{key.removeprefix('auc_')}"] = test["n"]
                row.update({f"{key}_diff_{k}": v for k, v in test.items() if k != "n"})
        out.append(row)
    others = [row for row in out if row["method"] != reference]
    for key in _PAIRED:  # each metric's paired t tests against the reference, Holm-adjusted over the methods
        for row, p in zip(others, holm([row[f"{key}_diff_p_t"] for row in others])):
            row[f"{key}_diff_p_holm"] = p
    return out


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment for m tests: the i-th smallest p (i from 0) times m − i, never below an earlier
    adjusted one, at most 1; m counts the finite p-values, and a NaN stays NaN. It holds the family-wise error rate
    at the level for any dependence between the tests."""
    finite = sorted((p, i) for i, p in enumerate(pvalues) if not math.isnan(p))
    out = [math.nan] * len(pvalues)
    adjusted = 0.0
    for rank, (p, i) in enumerate(finite):
        adjusted = max(adjusted, min(1.0, p * (len(finite) - rank)))
        out[i] = adjusted
    return out
