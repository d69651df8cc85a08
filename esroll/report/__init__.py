"""The report of a matched wall-time comparison (`esroll.compare`): curves, AUC, paired statistics, tables, figures.

Reads only the workdir (comparison.json and each run's config.json and metrics.jsonl), so it redraws the report of a
finished or partly finished comparison; notebooks/compare.ipynb calls the same functions. Its modules, each importing
only those before it:

- `esroll.report.runs`: the workdir's layout, the rule for a finished run, and what each run measured (`RunResult`),
  seen four ways (`VIEWS`): held-out accuracy against training wall time, completions, tokens and training FLOPs;
- `esroll.report.stats`: AUC in each view, paired tests with Holm's adjustment, per-run and per-method rows;
- `esroll.report.tables`: results.md's Markdown; `esroll.report.plots`: the figures, drawn on given matplotlib axes;
- `esroll.report.write`: `write_report`, the CSV tables, results.md and the figures of a workdir.

This package re-exports the names of `runs`, `stats` and `write`. It imports neither JAX nor `esroll.compare` (which
imports the training configs), nor matplotlib until a report's figures are drawn.
"""

from __future__ import annotations

from esroll.report.runs import (
    SPEC_FILE,
    VIEW_LABELS,
    VIEWS,
    RunResult,
    evaluation_counts,
    generated_counts,
    load_comparison,
    load_run,
    run_dir,
    run_ended,
    view_x,
)
from esroll.report.stats import (
    area_under_curve,
    holm,
    paired_test,
    per_run_rows,
    summarize,
    view_auc,
    view_ranges,
)
from esroll.report.write import write_csv, write_report

__all__ = [
    "SPEC_FILE",
    "VIEW_LABELS",
    "VIEWS",
    "RunResult",
    "area_under_curve",
    "evaluation_counts",
    "generated_counts",
    "holm",
    "load_comparison",
    "load_run",
    "paired_test",
    "per_run_rows",
    "run_dir",
    "run_ended",
    "summarize",
    "view_auc",
    "view_ranges",
    "view_x",
    "write_csv",
    "write_report",
]
