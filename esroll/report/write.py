"""The report of a comparison's workdir: runs.csv (every run that has an evaluation, finished or not), results.csv
and results.md (`esroll.report.stats.summarize` of the finished runs, in Markdown by `esroll.report.tables`), and the
figures accuracy_vs_time.png and views.png (`esroll.report.plots`), all written into the workdir.

Reads only the workdir (`esroll.report.runs.load_comparison`), so it redraws the report of a finished or partly
finished comparison. matplotlib is imported when a report is written, not with this module; the figures are
`matplotlib.figure.Figure`s, so the process's backend is left as it is. Imports no JAX.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

from esroll.report.plots import plot_curves, plot_differences, plot_paired, plot_views
from esroll.report.runs import VIEWS, load_comparison
from esroll.report.stats import per_run_rows, summarize, view_ranges
from esroll.report.tables import markdown_table, protocol_notes


def write_csv(rows: Sequence[dict], path: Path) -> None:
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def write_report(workdir: str | Path) -> dict[str, Path]:
    """Tables (runs.csv, results.csv, results.md) and figures (accuracy_vs_time.png; views.png: accuracy against
    wall time, completions and tokens generated, and training FLOPs) of the runs in `workdir`."""
    from matplotlib.figure import Figure  # here, not at the top: reading a comparison needs no matplotlib

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
