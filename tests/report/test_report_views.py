"""The report's views of a comparison: accuracy against wall time, completions and tokens generated for training,
and training FLOPs (rollout + update).

A small workdir is written by hand (2 methods × 3 finished seeds, plus one unfinished run), the report is drawn, and
its tables are checked against values recomputed here from the metrics.jsonl files alone. A second, tinier workdir
has AUCs against FLOPs worked out by hand.
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
from esroll.report import VIEWS, generated_counts, load_comparison, load_run, view_auc, view_x, write_report

BUDGET = 10.0
PROMPTS, POPULATION, GROUP = 2, 4, 3
PER_STEP = {"eggroll": PROMPTS * POPULATION, "grpo": PROMPTS * GROUP}  # completions per step
REFERENCE = "eggroll"
FALLBACK = ("grpo", 2)  # logged before the counters existed: no "completions" or "tokens" in its records
APART = ("eggroll", 1)  # its final evaluation is a record of its own, without counters (as train.py writes it)
UNFINISHED = ("grpo", 3)  # stops before the budget: listed in runs.csv, left out of statistics and ranges
NO_FLOPS = ("eggroll", 2)  # logged after "completions" and "tokens" existed, before "flops": out of the FLOPs view
FLOPS_PER_STEP = {"eggroll": 5e12, "grpo": 9e12}  # plus 3e9 per token generated: FLOPs not proportional to tokens


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
    step, wall, completions, tokens, flops, acc = 0, 0.0, 0, 0, 0.0, records[0]["eval_accuracy"]
    stop = BUDGET / 2 if (method, seed) == UNFINISHED else BUDGET
    while wall < stop:
        step += 1
        wall += dt * (1.0 + 0.1 * rng.random())
        completions += PER_STEP[method]
        step_tokens = tokens_per_step + int(rng.integers(0, 10))
        tokens += step_tokens
        flops += FLOPS_PER_STEP[method] + 3e9 * step_tokens
        record = {"step": step, "wall_time": wall, "completions": completions, "tokens": tokens, "flops": flops}
        record["lr"] = 1e-3
        if (method, seed) == FALLBACK:
            del record["completions"], record["tokens"], record["flops"]
        if (method, seed) == NO_FLOPS:
            del record["flops"]
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
    its step's record (0 at step 0); a run without counters: step × completions per step, tokens and FLOPs unknown
    (NaN); a run whose records lack "flops": FLOPs unknown."""
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
    flopped = counted and all("flops" in r for r in by_step.values())
    flops = [by_step[r["step"]]["flops"] if r["step"] else 0 for r in evals] if flopped else [math.nan] * len(evals)
    finished = records[-1]["wall_time"] >= BUDGET and "eval_accuracy" in records[-1]
    return {
        "time": [r["wall_time"] for r in evals],
        "accuracy": [r["eval_accuracy"] for r in evals],
        "completions": completions,
        "tokens": tokens,
        "flops": flops,
        "counted": counted,
        "flopped": flopped,
        "finished": finished,
    }


def _num(x: str) -> float:
    return math.nan if x in ("", "nan") else float(x)


# ---- the tests


@pytest.mark.e2e
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

    assert np.isnan(run.flops).all() and not run.has_flops
    assert apart.flops[0] == 0 and apart.flops[-1] == records[-2]["flops"] and apart.has_flops
    assert len(apart.flops) == len(apart.times)

    old = load_run(workdir / "eggroll" / "seed2", "eggroll", 2)  # tokens but no FLOPs counter
    assert old.has_tokens and not old.has_flops and np.isnan(old.flops).all()

    assert VIEWS == ("time", "completions", "tokens", "flops")
    for view, attr in zip(VIEWS, ("times", "completions", "tokens", "flops")):
        np.testing.assert_array_equal(view_x(apart, view), getattr(apart, attr))
    with pytest.raises(ValueError, match="view"):
        view_x(apart, "steps")


@pytest.mark.e2e
def test_view_aucs_ranges_and_pairs_match_the_metrics(workdir):
    paths = write_report(workdir)
    for key in ("figure", "views"):
        assert paths[key].is_file() and paths[key].stat().st_size > 0
    assert paths["views"].name == "views.png" and paths["figure"].name == "accuracy_vs_time.png"

    spec, runs = load_comparison(workdir)
    measured = {(r.method, r.seed): _measured(workdir, r.method, r.seed) for r in runs}
    assert {k for k, m in measured.items() if not m["finished"]} == {UNFINISHED}
    assert {k for k, m in measured.items() if not m["counted"]} == {FALLBACK}
    assert {k for k, m in measured.items() if not m["flopped"]} == {FALLBACK, NO_FLOPS}

    # The common ranges: the smallest final count over the finished runs of all methods (tokens: those counted).
    finished = {k: m for k, m in measured.items() if m["finished"]}
    x_c = min(m["completions"][-1] for m in finished.values())
    x_t = min(m["tokens"][-1] for m in finished.values() if m["counted"])
    x_f = min(m["flops"][-1] for m in finished.values() if m["flopped"])
    assert measured[UNFINISHED]["flops"][-1] < x_f  # it would have set the FLOPs range
    assert measured[NO_FLOPS]["tokens"][-1] > x_t  # counted in the tokens view
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
            "auc_flops": _mean_over(m["flops"], m["accuracy"], x_f) if m["flopped"] else math.nan,
            "final_flops": m["flops"][-1],
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
        assert _num(r["range_flops"]) == x_f
    seeds = (0, 1, 2)
    for method in spec["methods"]:
        row = results[method]
        assert int(row["n_seeds"]) == 3
        columns = ("auc", "auc_completions", "auc_tokens", "final_completions", "final_tokens")
        for column in (*columns, "auc_flops", "final_flops"):
            values = [expected[method, s][column] for s in seeds]
            values = [v for v in values if not math.isnan(v)]
            assert _num(row[f"{column}_mean"]) == pytest.approx(np.mean(values), rel=1e-12), (method, column)
            assert _num(row[f"{column}_sd"]) == pytest.approx(np.std(values, ddof=1), rel=1e-9), (method, column)
    assert int(results["grpo"]["n_seeds_tokens"]) == 2 and int(results["eggroll"]["n_seeds_tokens"]) == 3
    assert int(results["grpo"]["n_seeds_flops"]) == 2 and int(results["eggroll"]["n_seeds_flops"]) == 2

    # Paired differences, grpo − eggroll on the same seed; the tokens view drops the run without token counts.
    grpo = results["grpo"]
    assert int(grpo["n_pairs"]) == 3 and int(grpo["n_pairs_tokens"]) == 2 and int(grpo["n_pairs_flops"]) == 2
    paired = (("auc", seeds), ("auc_completions", seeds), ("auc_tokens", (0, 1)), ("auc_flops", (0, 1)))
    for column, pair_seeds in paired:
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
    assert "AUC vs FLOPs" in text and f"X = {x_f:.3e}" in text
    assert "no FLOPs counter" in text and "eggroll (1), grpo (1)" in text  # the runs left out of the FLOPs view
    assert "3 (2 with FLOPs)" in text and "3 (2 with tokens, 2 with FLOPs)" in text


# ---- the FLOPs view, by hand

# (wall time, completions, tokens, flops, eval accuracy or None) per step record after the evaluation at step 0.
_HAND = {
    # eggroll seed 0: evaluations at FLOPs 0, 3e14, 6e14 with accuracies 0.2, 0.4, 0.5
    ("eggroll", 0): [(1.0, 8, 10, 1e14, None), (2.0, 16, 20, 3e14, 0.4), (3.0, 24, 30, 6e14, 0.5)],
    # grpo seed 0: evaluations at FLOPs 0, 1.5e14, 4.5e14 with accuracies 0.1, 0.3, 0.6
    ("grpo", 0): [(1.5, 6, 10, 1.5e14, 0.3), (3.0, 12, 25, 4.5e14, 0.6)],
    # seed 1: as seed 0 but without the FLOPs counter: logged before it existed (eggroll), or resumed from a
    # checkpoint that predates it, its later records counting from 0 (grpo)
    ("eggroll", 1): [(1.0, 8, 10, None, None), (2.0, 16, 20, None, 0.4), (3.0, 24, 30, None, 0.5)],
    ("grpo", 1): [(1.5, 6, 10, None, 0.3), (3.0, 12, 25, 3e14, 0.6)],
}
_HAND_ACC0 = {"eggroll": 0.2, "grpo": 0.1}


def _hand_records(method: str, seed: int) -> list[dict]:
    records = [{"step": 0, "wall_time": 0.0, "eval_accuracy": _HAND_ACC0[method]}]
    for step, (wall, completions, tokens, flops, acc) in enumerate(_HAND[method, seed], 1):
        record = {"step": step, "wall_time": wall, "completions": completions, "tokens": tokens}
        if flops is not None:
            record["flops"] = flops
        if acc is not None:
            record["eval_accuracy"] = acc
        records.append(record)
    return records


def test_auc_against_flops_by_hand(tmp_path):
    spec = {"methods": ["eggroll", "grpo"], "seeds": [0, 1], "time_budget_s": 3.0, "reference": "eggroll"}
    (tmp_path / "comparison.json").write_text(json.dumps(spec))
    cfg = {"prompts_per_step": 2, "time_budget_s": 3.0, "steps": 100}
    for method, seed in _HAND:
        directory = tmp_path / method / f"seed{seed}"
        directory.mkdir(parents=True)
        config = {"method": method, "train": cfg, "es": {"population": 4}, "grpo": {"group_size": 3}}
        (directory / "config.json").write_text(json.dumps(config))
        (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _hand_records(method, seed)))

    _, flops = generated_counts(_hand_records("eggroll", 0), 8)[1:]
    np.testing.assert_array_equal(flops, [0.0, 3e14, 6e14])
    for key in (("eggroll", 1), ("grpo", 1)):  # no FLOPs (the resumed run's 3e14 counts from its resumption)
        assert np.isnan(generated_counts(_hand_records(*key), 8)[2]).all()
        assert np.isfinite(generated_counts(_hand_records(*key), 8)[1]).all()

    # X = 4.5e14, grpo's final FLOPs (the runs without the counter cannot set it).
    # eggroll over [0, 4.5e14]: 3e14·(0.2 + 0.4)/2 + 1.5e14·(0.4 + 0.45)/2 = 1.5375e14 (0.45 at 4.5e14, midway
    # from 0.4 to 0.5), divided by 4.5e14: 0.341666...
    # grpo: 1.5e14·(0.1 + 0.3)/2 + 3e14·(0.3 + 0.6)/2 = 1.65e14, divided by 4.5e14: 0.366666...
    auc = {"eggroll": 1.5375 / 4.5, "grpo": 1.65 / 4.5}
    run = load_run(tmp_path / "eggroll" / "seed0", "eggroll", 0)
    assert view_auc(run, "flops", 4.5e14) == pytest.approx(auc["eggroll"], rel=1e-12)
    assert view_auc(run, "flops", 6e14) == pytest.approx((0.9 + 1.35) / 6, rel=1e-12)  # 2.25e14 over [0, 6e14]
    assert math.isnan(view_auc(load_run(tmp_path / "eggroll" / "seed1", "eggroll", 1), "flops", 4.5e14))

    paths = write_report(tmp_path)
    rows = {(r["method"], int(r["seed"])): r for r in _rows(paths["runs_csv"])}
    for method in spec["methods"]:
        assert _num(rows[method, 0]["auc_flops"]) == pytest.approx(auc[method], rel=1e-12)
        assert _num(rows[method, 0]["final_flops"]) == {"eggroll": 6e14, "grpo": 4.5e14}[method]
        assert math.isnan(_num(rows[method, 1]["auc_flops"])) and math.isnan(_num(rows[method, 1]["final_flops"]))
        assert math.isfinite(_num(rows[method, 1]["auc_tokens"]))  # still in the tokens view
    results = {r["method"]: r for r in _rows(paths["results_csv"])}
    for method in spec["methods"]:
        row = results[method]
        assert _num(row["range_flops"]) == 4.5e14
        assert (int(row["n_seeds"]), int(row["n_seeds_tokens"]), int(row["n_seeds_flops"])) == (2, 2, 1)
        assert _num(row["auc_flops_mean"]) == pytest.approx(auc[method], rel=1e-12)
    grpo = results["grpo"]
    assert (int(grpo["n_pairs"]), int(grpo["n_pairs_tokens"]), int(grpo["n_pairs_flops"])) == (2, 2, 1)
    assert _num(grpo["auc_flops_diff_mean"]) == pytest.approx(auc["grpo"] - auc["eggroll"], rel=1e-9)
    text = paths["results_md"].read_text()
    assert "X = 4.500e+14" in text and "2 (1 with FLOPs)" in text
    assert "no FLOPs counter" in text and "eggroll (1), grpo (1)" in text
    assert "| grpo | AUC vs FLOPs | 1 | 2.5 |" in text  # 36.67 − 34.17 points
