"""The report's views of a comparison: accuracy against wall time, completions and tokens generated for training.

A small workdir is written by hand (2 methods × 3 finished seeds, plus one unfinished run), the report is drawn, and
its tables are checked against values recomputed here from the metrics.jsonl files alone.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from esroll.metrics import read_metrics
from esroll.report import VIEWS, load_comparison, load_run, view_x, write_report

BUDGET = 10.0
PROMPTS, POPULATION, GROUP = 2, 4, 3
PER_STEP = {"eggroll": PROMPTS * POPULATION, "grpo": PROMPTS * GROUP}  # completions per step
REFERENCE = "eggroll"
FALLBACK = ("grpo", 2)  # logged before the counters existed: no "completions" or "tokens" in its records
APART = ("eggroll", 1)  # its final evaluation is a record of its own, without counters (as train.py writes it)
UNFINISHED = ("grpo", 3)  # stops before the budget: listed in runs.csv, left out of statistics and ranges


def _config(method: str) -> dict:
    train = {"prompts_per_step": PROMPTS, "time_budget_s": BUDGET, "steps": 100}
    return {"method": method, "train": train, "es": {"population": POPULATION}, "grpo": {"group_size": GROUP}}


def _records(method: str, seed: int) -> list[dict]:
    """The records `train_and_evaluate` writes: an evaluation at step 0, then one record per step with cumulative
    counters, an evaluation in the step's record every 3 steps, and a last evaluation once the budget is spent."""
    rng = np.random.default_rng(100 * seed + len(method))
    dt = {"eggroll": 1.3, "grpo": 0.9}[method] + 0.2 * seed
    tokens_per_step = {"eggroll": 40, "grpo": 25}[method] + 7 * seed
    records = [{"step": 0, "wall_time": 0.0, "eval_accuracy": 0.30 + 0.01 * seed}]
    step, wall, completions, tokens, acc = 0, 0.0, 0, 0, records[0]["eval_accuracy"]
    stop = BUDGET / 2 if (method, seed) == UNFINISHED else BUDGET
    while wall < stop:
        step += 1
        wall += dt * (1.0 + 0.1 * rng.random())
        completions += PER_STEP[method]
        tokens += tokens_per_step + int(rng.integers(0, 10))
        record = {"step": step, "wall_time": wall, "completions": completions, "tokens": tokens, "lr": 1e-3}
        if (method, seed) == FALLBACK:
            del record["completions"], record["tokens"]
        acc = min(1.0, acc + float(rng.uniform(0.0, 0.05)))
        if step % 3 == 0:
            record["eval_accuracy"] = acc
        records.append(record)
    if (method, seed) != UNFINISHED and "eval_accuracy" not in records[-1]:
        if (method, seed) == APART:
            records.append({"step": step, "wall_time": wall, "eval_accuracy": acc})
        else:
            records[-1]["eval_accuracy"] = acc
    return records


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("views")
    spec = {"methods": ["eggroll", "grpo"], "seeds": [0, 1, 2, 3], "time_budget_s": BUDGET, "reference": REFERENCE}
    (root / "comparison.json").write_text(json.dumps(spec))
    runs = [(m, s) for m in spec["methods"] for s in (0, 1, 2)] + [UNFINISHED]
    for method, seed in runs:
        directory = root / method / f"seed{seed}"
        directory.mkdir(parents=True)
        (directory / "config.json").write_text(json.dumps(_config(method)))
        lines = "".join(json.dumps(r) + "\n" for r in _records(method, seed))
        (directory / "metrics.jsonl").write_text(lines)
    assert APART != UNFINISHED and "completions" not in read_metrics(root / "eggroll/seed1/metrics.jsonl")[-1]
    return root


# ---- independent of esroll.report


def _rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def _mean_over(xs, accs, upper: float) -> float:
    """Mean accuracy over [0, upper]: trapezoids between evaluations, the last cut at `upper` (interpolated), the
    curve held at its last value when it ends before `upper`. The first evaluation is at x = 0 here."""
    assert xs[0] == 0
    area = 0.0
    for x0, x1, a0, a1 in zip(xs[:-1], xs[1:], accs[:-1], accs[1:]):
        if x0 >= upper:
            break
        end = min(x1, upper)
        a_end = a0 + (a1 - a0) * (end - x0) / (x1 - x0)
        area += (end - x0) * (a0 + a_end) / 2
    if xs[-1] < upper:
        area += (upper - xs[-1]) * accs[-1]
    return area / upper


def _measured(root: Path, method: str, seed: int) -> dict:
    """Times, accuracies and counts at each evaluation, read from metrics.jsonl: an evaluation's counters are those of
    its step's record (0 at step 0); a run without counters: step × completions per step, tokens unknown (NaN)."""
    records = read_metrics(root / method / f"seed{seed}" / "metrics.jsonl")
    evals = [r for r in records if "eval_accuracy" in r]
    by_step = {r["step"]: r for r in records if "completions" in r}
    counted = bool(by_step)
    if counted:
        completions = [by_step[r["step"]]["completions"] if r["step"] else 0 for r in evals]
        tokens = [by_step[r["step"]]["tokens"] if r["step"] else 0 for r in evals]
    else:
        completions = [r["step"] * PER_STEP[method] for r in evals]
        tokens = [math.nan] * len(evals)
    finished = records[-1]["wall_time"] >= BUDGET and "eval_accuracy" in records[-1]
    return {
        "time": [r["wall_time"] for r in evals],
        "accuracy": [r["eval_accuracy"] for r in evals],
        "completions": completions,
        "tokens": tokens,
        "counted": counted,
        "finished": finished,
    }


def _num(x: str) -> float:
    return math.nan if x in ("", "nan") else float(x)


# ---- the tests


def test_counters_are_read_and_old_runs_fall_back(workdir):
    run = load_run(workdir / "grpo" / "seed2", "grpo", 2)
    steps = np.array([r["step"] for r in read_metrics(workdir / "grpo/seed2/metrics.jsonl") if "eval_accuracy" in r])
    np.testing.assert_array_equal(run.completions, steps * PROMPTS * GROUP)
    assert np.isnan(run.tokens).all() and not run.has_tokens

    apart = load_run(workdir / "eggroll" / "seed1", "eggroll", 1)
    records = read_metrics(workdir / "eggroll/seed1/metrics.jsonl")
    assert apart.completions[0] == 0 and apart.tokens[0] == 0
    assert apart.completions[-1] == records[-2]["completions"] and apart.tokens[-1] == records[-2]["tokens"]
    assert len(apart.completions) == len(apart.tokens) == len(apart.times) == len(apart.accuracies)

    assert VIEWS == ("time", "completions", "tokens")
    for view, attr in zip(VIEWS, ("times", "completions", "tokens")):
        np.testing.assert_array_equal(view_x(apart, view), getattr(apart, attr))
    with pytest.raises(ValueError, match="view"):
        view_x(apart, "steps")


def test_view_aucs_ranges_and_pairs_match_the_metrics(workdir):
    paths = write_report(workdir)
    for key in ("figure", "views"):
        assert paths[key].is_file() and paths[key].stat().st_size > 0
    assert paths["views"].name == "views.png" and paths["figure"].name == "accuracy_vs_time.png"

    spec, runs = load_comparison(workdir)
    measured = {(r.method, r.seed): _measured(workdir, r.method, r.seed) for r in runs}
    assert {k for k, m in measured.items() if not m["finished"]} == {UNFINISHED}
    assert {k for k, m in measured.items() if not m["counted"]} == {FALLBACK}

    # The common ranges: the smallest final count over the finished runs of all methods (tokens: those counted).
    finished = {k: m for k, m in measured.items() if m["finished"]}
    x_c = min(m["completions"][-1] for m in finished.values())
    x_t = min(m["tokens"][-1] for m in finished.values() if m["counted"])
    assert measured[UNFINISHED]["completions"][-1] < x_c  # it would have set the range
    finals_c = {m["completions"][-1] for m in finished.values()}
    assert len(finals_c) > 1  # the range is a real choice

    expected = {}
    for key, m in measured.items():
        expected[key] = {
            "auc": _mean_over(m["time"], m["accuracy"], BUDGET),
            "auc_completions": _mean_over(m["completions"], m["accuracy"], x_c),
            "auc_tokens": _mean_over(m["tokens"], m["accuracy"], x_t) if m["counted"] else math.nan,
            "final_completions": m["completions"][-1],
            "final_tokens": m["tokens"][-1],
        }

    rows = {(r["method"], int(r["seed"])): r for r in _rows(paths["runs_csv"])}
    assert set(rows) == set(measured)
    for key, row in rows.items():
        for column, value in expected[key].items():
            if math.isnan(value):
                assert math.isnan(_num(row[column])), (key, column)
            else:
                assert _num(row[column]) == pytest.approx(value, rel=1e-12, abs=1e-12), (key, column)

    results = {r["method"]: r for r in _rows(paths["results_csv"])}
    for r in results.values():
        assert _num(r["range_completions"]) == x_c and _num(r["range_tokens"]) == x_t
    seeds = (0, 1, 2)
    for method in spec["methods"]:
        row = results[method]
        assert int(row["n_seeds"]) == 3
        for column in ("auc", "auc_completions", "auc_tokens", "final_completions", "final_tokens"):
            values = [expected[method, s][column] for s in seeds]
            values = [v for v in values if not math.isnan(v)]
            assert _num(row[f"{column}_mean"]) == pytest.approx(np.mean(values), rel=1e-12), (method, column)
            assert _num(row[f"{column}_sd"]) == pytest.approx(np.std(values, ddof=1), rel=1e-9), (method, column)
    assert int(results["grpo"]["n_seeds_tokens"]) == 2 and int(results["eggroll"]["n_seeds_tokens"]) == 3

    # Paired differences, grpo − eggroll on the same seed; the tokens view drops the run without token counts.
    grpo = results["grpo"]
    assert int(grpo["n_pairs"]) == 3 and int(grpo["n_pairs_tokens"]) == 2
    for column, pair_seeds in (("auc", seeds), ("auc_completions", seeds), ("auc_tokens", (0, 1))):
        d = np.array([expected["grpo", s][column] - expected[REFERENCE, s][column] for s in pair_seeds])
        n, mean, sd = len(d), d.sum() / len(d), math.sqrt(((d - d.sum() / len(d)) ** 2).sum() / (len(d) - 1))
        half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
        assert _num(grpo[f"{column}_diff_mean"]) == pytest.approx(mean, rel=1e-9, abs=1e-15)
        assert _num(grpo[f"{column}_diff_sd"]) == pytest.approx(sd, rel=1e-9)
        assert _num(grpo[f"{column}_diff_ci_low"]) == pytest.approx(mean - half, rel=1e-9)
        assert _num(grpo[f"{column}_diff_ci_high"]) == pytest.approx(mean + half, rel=1e-9)
        positive = int((d > 0).sum())
        sign_p = min(1.0, 2 * sum(math.comb(n, i) for i in range(min(positive, n - positive) + 1)) / 2**n)
        assert _num(grpo[f"{column}_diff_p_sign"]) == pytest.approx(sign_p)
    assert (
        "auc_completions_diff_mean" not in results[REFERENCE] or results[REFERENCE]["auc_completions_diff_mean"] == ""
    )

    text = paths["results_md"].read_text()
    assert "Sample efficiency" in text and "AUC vs completions" in text and "AUC vs tokens" in text
    assert f"X = {x_c:,.0f}" in text and f"X = {x_t:,.0f}" in text
    assert "common range" in text and "grpo (1)" in text  # the ranges and the run left out of the tokens view
