"""The report of a matched wall-time comparison (`esroll.compare`): curves, AUC, paired statistics, tables, figures.

Reads only the workdir (comparison.json and each run's config.json and metrics.jsonl), so it redraws the report of a
finished or partly finished comparison; notebooks/compare.ipynb calls the same functions. Statistics, tables and
figures cover finished runs; runs.csv lists every run that has an evaluation, finished or not.

The workdir's layout and the rule for a finished run are defined here and used by `esroll.compare` too. This module
imports neither JAX nor `esroll.compare` (which imports the training configs): reading a comparison needs neither.
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
    steps: int
    wall_time: float
    evaluations_per_step: int  # ES: population members; GRPO: sampled completions
    completions_per_step: int  # sequences generated per step
    complete: bool

    @property
    def final_accuracy(self) -> float:
        return float(self.accuracies[-1])


def evaluation_counts(cfg: dict) -> tuple[int, int]:
    """(evaluations, completions) per step of a run config (as in its config.json). An ES member's evaluation is
    its mean reward on the step's shared prompts; a GRPO evaluation is one sampled completion."""
    prompts = cfg["train"]["prompts_per_step"]
    if cfg["method"] == "grpo":
        completions = prompts * cfg["grpo"]["group_size"]
        return completions, completions
    return cfg["es"]["population"], cfg["es"]["population"] * prompts


def load_run(directory: Path, method: str, seed: int) -> RunResult | None:
    """The run in `directory`, or None when it has no evaluation yet."""
    records = read_metrics(directory / "metrics.jsonl")
    evals = [r for r in records if "eval_accuracy" in r]
    if not evals:
        return None
    cfg = json.loads((directory / "config.json").read_text())
    per_eval, per_completion = evaluation_counts(cfg)
    return RunResult(
        method=method,
        seed=seed,
        times=np.array([r["wall_time"] for r in evals], float),
        accuracies=np.array([r["eval_accuracy"] for r in evals], float),
        steps=int(records[-1]["step"]),
        wall_time=float(records[-1]["wall_time"]),
        evaluations_per_step=per_eval,
        completions_per_step=per_completion,
        complete=run_ended(records, cfg["train"]),
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

    With n pairs the smallest two-sided p the Wilcoxon and sign tests can give is 2·0.5^n (0.25 for n = 3). When all
    differences are equal the t statistic, its p and the interval are undefined (NaN).
    """
    d = np.asarray(differences, float)
    n = len(d)
    out = dict.fromkeys(("ci_low", "ci_high", "t", "p_t", "p_wilcoxon", "p_sign"), math.nan)
    out = {"n": n, **_mean_sd(d), **out}
    if n < 2:
        return out
    if out["sd"] > 0:
        half = stats.t.ppf(0.975, n - 1) * out["sd"] / math.sqrt(n)
        out["t"] = out["mean"] / (out["sd"] / math.sqrt(n))
        p_t = float(2 * stats.t.sf(abs(out["t"]), n - 1))
        out.update(ci_low=out["mean"] - half, ci_high=out["mean"] + half, p_t=p_t)
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


def per_run_rows(runs: Sequence[RunResult], budget: float) -> list[dict[str, Any]]:
    """One row per run: its status, steps, first and last evaluation, AUC over `budget`, and what it generated."""
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
            "evaluations": r.evaluations_per_step * r.steps,
            "completions": r.completions_per_step * r.steps,
        }
        for r in runs
    ]


def summarize(runs: Sequence[RunResult], methods: Sequence[str], reference: str, budget: float) -> list[dict[str, Any]]:
    """One row per method over its finished runs: final accuracy and AUC (mean, sd over seeds), steps and evaluation
    counts, and paired differences against `reference` on the seeds both finished."""
    rows = {(r["method"], r["seed"]): r for r in per_run_rows([r for r in runs if r.complete], budget)}
    out = []
    for name in methods:
        mine = {seed: row for (m, seed), row in rows.items() if m == name}
        row: dict[str, Any] = {"method": name, "n_seeds": len(mine)}
        for key in ("final_accuracy", "auc", "steps", "evaluations", "completions"):
            row.update({f"{key}_{k}": v for k, v in _mean_sd([r[key] for r in mine.values()]).items()})
        if name != reference:
            seeds = sorted(s for s in mine if (reference, s) in rows)
            row["n_pairs"] = len(seeds)
            for key in ("final_accuracy", "auc"):
                test = paired_test([mine[s][key] - rows[(reference, s)][key] for s in seeds])
                row.update({f"{key}_diff_{k}": v for k, v in test.items() if k != "n"})
        out.append(row)
    return out


# ---- tables


def write_csv(rows: Sequence[dict], path: Path) -> None:
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def _fmt(x: float, scale: float = 1.0, spec: str = ".1f") -> str:
    return "—" if math.isnan(x) else f"{scale * x:{spec}}"


def _pct(x: float) -> str:
    return _fmt(x, 100.0)


def _p(x: float) -> str:
    return _fmt(x, spec=".3f")


def markdown_table(summary: Sequence[dict], spec: dict) -> str:
    """The results as Markdown: a per-method table, the paired differences against the reference, and notes."""
    ref, budget, n = spec["reference"], spec["time_budget_s"], len(spec["seeds"])
    lines = [
        (
            f"Budget {budget:g} s of training wall time per run (evaluation excluded); seeds {spec['seeds']}; "
            "accuracy in %; mean ± sd over seeds."
        ),
        "",
        "| method | seeds | final accuracy | AUC (mean accuracy over the budget) | steps | evaluations | completions |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        lines.append(
            f"| {r['method']} | {r['n_seeds']} | {_pct(r['final_accuracy_mean'])} ± {_pct(r['final_accuracy_sd'])} "
            f"| {_pct(r['auc_mean'])} ± {_pct(r['auc_sd'])} | {_fmt(r['steps_mean'], spec='.0f')} "
            f"| {_fmt(r['evaluations_mean'], spec='.0f')} | {_fmt(r['completions_mean'], spec='.0f')} |"
        )
    lines += [
        "",
        f"Paired differences against {ref} (method − {ref}, points of accuracy):",
        "",
        "| method | metric | pairs | mean diff | 95% CI (t) | paired t p | Wilcoxon p | sign test p |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        if r["method"] == ref:
            continue
        for key, label in (("final_accuracy", "final accuracy"), ("auc", "AUC")):
            lines.append(
                f"| {r['method']} | {label} | {r['n_pairs']} | {_pct(r[f'{key}_diff_mean'])} "
                f"| [{_pct(r[f'{key}_diff_ci_low'])}, {_pct(r[f'{key}_diff_ci_high'])}] | {_p(r[f'{key}_diff_p_t'])} "
                f"| {_p(r[f'{key}_diff_p_wilcoxon'])} | {_p(r[f'{key}_diff_p_sign'])} |"
            )
    lines += [
        "",
        (
            f"Notes. With n = {n} seeds the Wilcoxon signed-rank and sign tests cannot give a two-sided p below "
            f"2·0.5^n = {2 * 0.5**n:.3g}, however large the effect; the t-test assumes normal differences, which "
            f"n = {n} cannot check; — marks an undefined value (e.g. all differences equal). Final accuracy: the "
            "evaluation after the step that used up the budget. AUC: trapezoids between evaluations over [0, budget], "
            "held at the last value, divided by the budget. Evaluations: ES population members × steps (each member "
            "scores all of a step's prompts); GRPO sampled completions. Completions: sequences generated for training."
        ),
    ]
    return "\n".join(lines) + "\n"


# ---- figures


def mean_curve(runs: Sequence[RunResult], grid: np.ndarray) -> np.ndarray:
    """Accuracy averaged over runs on a time grid, each run interpolated as in `area_under_curve`."""
    return np.mean([np.interp(grid, r.times, r.accuracies) for r in runs], axis=0)


def _finish(ax, ylabel: str) -> None:
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_curves(ax, runs: Sequence[RunResult], methods: Sequence[str], budget: float) -> None:
    """Held-out accuracy against training wall time: each seed thin, the mean over seeds thick."""
    grid = np.linspace(0.0, budget, 200)
    for i, name in enumerate(methods):
        mine = [r for r in runs if r.method == name]
        if not mine:
            continue
        for r in mine:
            ax.plot(r.times, r.accuracies, color=f"C{i}", alpha=0.35, lw=1, marker=".", ms=3)
        ax.plot(grid, mean_curve(mine, grid), color=f"C{i}", lw=2.5, label=f"{name} (mean of {len(mine)})")
    ax.axvline(budget, color="k", ls=":", lw=1)
    ax.set_xlabel("training wall time (s)")
    _finish(ax, "held-out accuracy")


def plot_differences(ax, runs: Sequence[RunResult], methods: Sequence[str], reference: str, budget: float) -> None:
    """Accuracy of each method minus the reference's on the same seed, over time: the paired comparison as curves."""
    grid = np.linspace(0.0, budget, 200)
    ref = {r.seed: r for r in runs if r.method == reference}
    for i, name in enumerate(methods):
        pairs = [(r, ref[r.seed]) for r in runs if r.method == name and name != reference and r.seed in ref]
        if not pairs:
            continue
        diffs = [np.interp(grid, r.times, r.accuracies) - np.interp(grid, q.times, q.accuracies) for r, q in pairs]
        for d in diffs:
            ax.plot(grid, d, color=f"C{i}", alpha=0.35, lw=1)
        ax.plot(grid, np.mean(diffs, axis=0), color=f"C{i}", lw=2.5, label=f"{name} − {reference}")
    ax.axhline(0.0, color="k", lw=1)
    ax.set_xlabel("training wall time (s)")
    _finish(ax, f"accuracy − {reference} (same seed)")


def plot_paired(ax, runs: Sequence[RunResult], methods: Sequence[str]) -> None:
    """Final accuracy of each method, one line per seed joining its runs (the pairs the statistics use)."""
    for k, seed in enumerate(sorted({r.seed for r in runs})):  # grey, not the methods' colours
        by_method = {r.method: r.final_accuracy for r in runs if r.seed == seed}
        xs = [i for i, m in enumerate(methods) if m in by_method]
        ys = [by_method[methods[i]] for i in xs]
        ax.plot(xs, ys, color="0.35", marker="osD^v<>"[k % 7], alpha=0.7, label=f"seed {seed}")
    ax.set_xticks(range(len(methods)), methods)
    _finish(ax, "final held-out accuracy")


# ---- the report


def write_report(workdir: str | Path) -> dict[str, Path]:
    """Tables (runs.csv, results.csv, results.md) and the figure (accuracy_vs_time.png) of the runs in `workdir`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workdir = Path(workdir)
    spec, runs = load_comparison(workdir)
    budget, methods, reference = spec["time_budget_s"], spec["methods"], spec["reference"]
    finished = [r for r in runs if r.complete]
    summary = summarize(finished, methods, reference, budget)
    paths = {
        "runs_csv": workdir / "runs.csv",
        "results_csv": workdir / "results.csv",
        "results_md": workdir / "results.md",
        "figure": workdir / "accuracy_vs_time.png",
    }
    write_csv(per_run_rows(runs, budget), paths["runs_csv"])
    write_csv(summary, paths["results_csv"])
    paths["results_md"].write_text(markdown_table(summary, spec))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), dpi=120, gridspec_kw={"width_ratios": [3, 3, 2]})
    plot_curves(axes[0], finished, methods, budget)
    plot_differences(axes[1], finished, methods, reference, budget)
    plot_paired(axes[2], finished, methods)
    axes[0].set_title(f"matched wall time: {budget:g} s per run, {len(spec['seeds'])} seeds")
    fig.tight_layout()
    fig.savefig(paths["figure"])
    plt.close(fig)
    return paths
