"""The report of a matched wall-time comparison (`esroll.compare`): curves, AUC, paired statistics, tables, figures.

Each run is seen four ways (`VIEWS`): held-out accuracy against training wall time, against completions generated
for training, against tokens generated for training, and against training FLOPs (rollout + update, as counted by
`esroll.ledger`). The time view's AUC is the mean accuracy over [0, budget]; a count view's AUC is the mean accuracy
over [0, X], X the view's common range: the smallest final count among the finished runs of all methods, so that
every method is compared over the same range (`view_ranges`). Runs logged before a counter existed ("tokens",
"flops" in metrics.jsonl) have NaN there and are left out of that view (its AUCs, range, pairs and panel), with the
runs and pairs each view covers reported (n_seeds_tokens, n_pairs_tokens, n_seeds_flops, n_pairs_flops).

Reads only the workdir (comparison.json and each run's config.json and metrics.jsonl), so it redraws the report of a
finished or partly finished comparison; notebooks/compare.ipynb calls the same functions. Statistics, tables and
figures cover finished runs; runs.csv lists every run that has an evaluation, finished or not. `write_report` writes
the CSV tables itself, results.md from `esroll.report_tables` and the figures from `esroll.report_plots`, which draw
on the runs and summaries read here.

The workdir's layout and the rule for a finished run are defined here and used by `esroll.compare` too. This module,
like `esroll.report_tables` and `esroll.report_plots`, imports neither JAX nor `esroll.compare` (which imports the
training configs): reading a comparison needs neither.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from esroll.metrics import read_metrics

SPEC_FILE = "comparison.json"  # written by `esroll.compare.run_comparison`: methods, seeds, budget, reference


# ---- the workdir


def run_dir(workdir: str | Path, method: str, seed: int) -> Path:
    return Path(workdir) / method / f"seed{seed}"


def run_ended(records: list[dict], train: dict) -> bool:
    """Whether metrics records end as `train_and_evaluate` ends a run: with an evaluation made after the budget was
    spent or the step limit reached. `train` is the "train" section of the run's config.json."""
    if not records or "eval_accuracy" not in records[-1]:
        return False
    return records[-1]["wall_time"] >= train["time_budget_s"] or records[-1]["step"] >= train["steps"]


# ---- what the runs measured


@dataclasses.dataclass(frozen=True)
class RunResult:
    method: str
    seed: int
    times: np.ndarray  # training wall time of each evaluation (s)
    accuracies: np.ndarray  # held-out accuracy at those times
    completions: np.ndarray  # sequences generated for training before each evaluation (cumulative)
    tokens: np.ndarray  # tokens generated for training before each evaluation (cumulative; NaN: not logged)
    flops: np.ndarray  # training FLOPs (rollout + update) before each evaluation (cumulative; NaN: not logged)
    steps: int
    wall_time: float
    evaluations_per_step: int  # ES: population members; GRPO: sampled completions
    completions_per_step: int  # sequences generated per step
    complete: bool
    probe_s: float = math.nan  # the evaluation before training: greedy decoding of the held-out set (NaN: not timed)
    # Mean over steps of the fraction of groups whose rewards are all equal (GRPO: a prompt's completions; ES: a
    # prompt's rows over the members), and of those the fraction that still carry a learning signal (steps with any).
    all_equal_groups: float = math.nan
    all_equal_signal: float = math.nan

    @property
    def final_accuracy(self) -> float:
        return float(self.accuracies[-1])

    @property
    def has_tokens(self) -> bool:
        """Whether its metrics counted tokens (runs logged before the counters existed did not)."""
        return bool(np.isfinite(self.tokens).all())

    @property
    def has_flops(self) -> bool:
        """Whether its metrics counted training FLOPs throughout (runs logged before the counter existed did not)."""
        return bool(np.isfinite(self.flops).all())


def evaluation_counts(cfg: dict) -> tuple[int, int]:
    """(evaluations, completions) per step of a run config (as in its config.json). An ES member's evaluation is
    its mean reward on the step's shared prompts; a GRPO evaluation is one sampled completion."""
    prompts = cfg["train"]["prompts_per_step"]
    if cfg["method"] == "grpo":
        completions = prompts * cfg["grpo"]["group_size"]
        return completions, completions
    return cfg["es"]["population"], cfg["es"]["population"] * prompts * cfg["es"].get("samples", 1)


_COUNTERS = ("completions", "tokens", "flops")  # the cumulative counters of a step record, as train.py logs them


def generated_counts(records: list[dict], completions_per_step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(completions, tokens, flops) generated for training before each evaluation record in `records`; flops: the
    training FLOPs, rollout + update.

    Step records carry the cumulative counters "completions", "tokens" and "flops"; an evaluation record without
    them (the one before training, or a final evaluation written apart from its step's record) has the counts of the
    latest record before it (0 before any). A counter is read only when every record that carries a counter carries
    it: a run logged before "flops" existed (or resumed from a checkpoint that predates it, whose later records count
    FLOPs from 0) has NaN FLOPs. A run whose records hold no counter at all (logged before they existed) falls back to
    step × `completions_per_step` completions and NaN tokens and FLOPs.
    """
    counting = [r for r in records if any(key in r for key in _COUNTERS)]
    counted = {key: bool(counting) and all(key in r for r in counting) for key in _COUNTERS}
    current = dict.fromkeys(_COUNTERS, 0.0)
    out: dict[str, list[float]] = {key: [] for key in _COUNTERS}
    for r in records:
        for key in current:
            current[key] = float(r.get(key, current[key]))
        if "eval_accuracy" not in r:
            continue
        fallback = {"completions": float(r["step"] * completions_per_step), "tokens": math.nan, "flops": math.nan}
        for key in current:
            out[key].append(current[key] if counted[key] else fallback[key])
    return tuple(np.array(out[key], float) for key in _COUNTERS)


def load_run(directory: Path, method: str, seed: int) -> RunResult | None:
    """The run in `directory`, or None when it has no evaluation yet."""
    records = read_metrics(directory / "metrics.jsonl")
    evals = [r for r in records if "eval_accuracy" in r]
    if not evals:
        return None
    cfg = json.loads((directory / "config.json").read_text())
    per_eval, per_completion = evaluation_counts(cfg)
    completions, tokens, flops = generated_counts(records, per_completion)
    equal = [r["frac_groups_all_equal"] for r in records if "frac_groups_all_equal" in r]
    signal = [r["frac_all_equal_signal"] for r in records if "frac_all_equal_signal" in r]
    return RunResult(
        method=method,
        seed=seed,
        times=np.array([r["wall_time"] for r in evals], float),
        accuracies=np.array([r["eval_accuracy"] for r in evals], float),
        completions=completions,
        tokens=tokens,
        flops=flops,
        steps=int(records[-1]["step"]),
        wall_time=float(records[-1]["wall_time"]),
        evaluations_per_step=per_eval,
        completions_per_step=per_completion,
        complete=run_ended(records, cfg["train"]),
        probe_s=float(evals[0].get("eval_s", math.nan)) if evals[0]["step"] == 0 else math.nan,
        all_equal_groups=float(np.mean(equal)) if equal else math.nan,
        all_equal_signal=float(np.mean(signal)) if signal else math.nan,
    )


def load_comparison(workdir: str | Path) -> tuple[dict, list[RunResult]]:
    """The spec written by `run_comparison` and every run in `workdir` that has evaluations (finished or not)."""
    workdir = Path(workdir)
    spec = json.loads((workdir / SPEC_FILE).read_text())
    runs = []
    for name in spec["methods"]:
        for seed in spec["seeds"]:
            run = load_run(run_dir(workdir, name, seed), name, seed)
            if run is not None:
                runs.append(run)
    return spec, runs


# ---- views: what accuracy is plotted against

VIEWS = ("time", "completions", "tokens", "flops")
VIEW_LABELS = {
    "time": "training wall time (s)",
    "completions": "completions generated for training",
    "tokens": "tokens generated for training",
    "flops": "training FLOPs (rollout + update)",
}


def view_x(run: RunResult, view: str) -> np.ndarray:
    """The run's x at each evaluation in `view`: training wall time, completions or tokens generated so far, or the
    training FLOPs (rollout + update) spent so far."""
    if view not in VIEWS:
        raise ValueError(f"unknown view {view!r}; expected one of {VIEWS}")
    return {"time": run.times, "completions": run.completions, "tokens": run.tokens, "flops": run.flops}[view]


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


# ---- statistics


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


# ---- the report


def write_csv(rows: Sequence[dict], path: Path) -> None:
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def write_report(workdir: str | Path) -> dict[str, Path]:
    """Tables (runs.csv, results.csv, results.md) and figures (accuracy_vs_time.png; views.png: accuracy against
    wall time, completions and tokens generated, and training FLOPs) of the runs in `workdir`."""
    from matplotlib.figure import Figure  # not pyplot: the process's backend is left as it is

    from esroll.report_plots import plot_curves, plot_differences, plot_paired, plot_views  # both import this module
    from esroll.report_tables import markdown_table, protocol_notes

    workdir = Path(workdir)
    spec, runs = load_comparison(workdir)
    budget, methods, reference = spec["time_budget_s"], spec["methods"], spec["reference"]
    finished = [r for r in runs if r.complete]
    ranges = view_ranges(finished, budget)
    summary = summarize(finished, methods, reference, budget, ranges)
    paths = {
        "runs_csv": workdir / "runs.csv",
        "results_csv": workdir / "results.csv",
        "results_md": workdir / "results.md",
        "figure": workdir / "accuracy_vs_time.png",
        "views": workdir / "views.png",
    }
    write_csv(per_run_rows(runs, budget, ranges), paths["runs_csv"])
    write_csv(summary, paths["results_csv"])
    paths["results_md"].write_text(markdown_table(summary, spec) + protocol_notes(workdir, runs))
    fig = Figure(figsize=(15, 4), dpi=120)
    axes = fig.subplots(1, 3, gridspec_kw={"width_ratios": [3, 3, 2]})
    plot_curves(axes[0], finished, methods, budget)
    plot_differences(axes[1], finished, methods, reference, budget)
    plot_paired(axes[2], finished, methods)
    axes[0].set_title(f"matched wall time: {budget:g} s per run, {len(spec['seeds'])} seeds")
    fig.tight_layout()
    fig.savefig(paths["figure"])
    fig = Figure(figsize=(5 * len(VIEWS), 4), dpi=120)
    axes = fig.subplots(1, len(VIEWS))
    plot_views(axes, finished, methods, ranges)
    fig.suptitle(f"held-out accuracy: {budget:g} s of training per run, {len(spec['seeds'])} seeds", fontsize=10)
    fig.tight_layout()
    fig.savefig(paths["views"])
    return paths
