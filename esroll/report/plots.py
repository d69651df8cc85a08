"""The figures of a comparison's report (accuracy_vs_time.png and views.png, written by
`esroll.report.write.write_report`): held-out accuracy against each view's x (`esroll.report.runs.VIEWS`), each seed
thin and the mean over seeds thick; each method minus the reference on the same seed over time; final accuracy joined
by seed.

Each function draws on the matplotlib axes it is given and imports no matplotlib itself, so the caller chooses the
figure and the backend (`write_report` a `matplotlib.figure.Figure`, notebooks/compare.ipynb pyplot). Imports from
esroll only `esroll.report.runs`, and no JAX.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from esroll.report.runs import VIEW_LABELS, VIEWS, RunResult, view_x


def mean_curve(runs: Sequence[RunResult], grid: np.ndarray, view: str = "time") -> np.ndarray:
    """Accuracy averaged over runs on a grid of `view`'s x (default time), each run interpolated as in
    `area_under_curve`."""
    return np.mean([np.interp(grid, view_x(r, view), r.accuracies) for r in runs], axis=0)


def _finish(ax, ylabel: str) -> None:
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_curves(ax, runs: Sequence[RunResult], methods: Sequence[str], budget: float, view: str = "time") -> None:
    """Held-out accuracy against `view`'s x (default training wall time): each seed thin, the mean over seeds thick
    on a grid over [0, budget] (for a count view, its common range X). Runs without x in the view are left out."""
    counted = [r for r in runs if r.method in methods and np.isfinite(view_x(r, view)).all()]
    if view != "time" and not (counted and math.isfinite(budget) and budget > 0):
        ax.text(0.5, 0.5, f"no finished run counts {view}", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel(VIEW_LABELS[view])
        ax.set_ylabel("held-out accuracy")
        return
    grid = np.linspace(0.0, budget, 200)
    for i, name in enumerate(methods):
        mine = [r for r in counted if r.method == name]
        if not mine:
            continue
        for r in mine:
            ax.plot(view_x(r, view), r.accuracies, color=f"C{i}", alpha=0.35, lw=1, marker=".", ms=3)
        ax.plot(grid, mean_curve(mine, grid, view), color=f"C{i}", lw=2.5, label=f"{name} (mean of {len(mine)})")
    ax.axvline(budget, color="k", ls=":", lw=1)
    ax.set_xlabel(VIEW_LABELS[view])
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


def plot_views(axes, runs: Sequence[RunResult], methods: Sequence[str], ranges: dict[str, float]) -> None:
    """One panel per view (`VIEWS`, in order): `plot_curves` against that view's x over its range in `ranges`."""
    for ax, view in zip(axes, VIEWS):
        plot_curves(ax, runs, methods, ranges[view], view)
        what = "budget" if view == "time" else "common range"
        ax.set_title(f"against {VIEW_LABELS[view].split(' (')[0]}; {what} {ranges[view]:,.4g}", fontsize=9)
