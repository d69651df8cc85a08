"""The matched wall-time comparison: statistics on cases with known answers, the configs, the report of a hand-written
workdir, and the quick comparison end to end (its tables recomputed from the runs' metrics.jsonl), including
resumption."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from configs.compare import get_config
from esroll.compare import comparison_from_dict, run_comparison
from esroll.experiment import check_names
from esroll.metrics import read_metrics
from esroll.report import area_under_curve, load_comparison, paired_test, write_report

from conftest import REPO, SHIPPED_MODEL


# ---- statistics with known answers


def test_paired_test_known_mean_and_sd():
    """d = (1, 2, 3): mean 2, sd 1, t = 2√3. With 2 degrees of freedom the t distribution has closed forms:
    sf(t) = (1 − t/√(t² + 2))/2 and the 0.975 quantile is 0.95·√(2/(4·0.975·0.025))."""
    out = paired_test([1.0, 2.0, 3.0])
    t = 2 * math.sqrt(3)
    q = 0.95 * math.sqrt(2 / (4 * 0.975 * 0.025))
    assert out["n"] == 3 and out["mean"] == pytest.approx(2.0) and out["sd"] == pytest.approx(1.0)
    assert out["t"] == pytest.approx(t)
    assert out["p_t"] == pytest.approx(1 - t / math.sqrt(t**2 + 2))
    assert out["ci_low"] == pytest.approx(2 - q / math.sqrt(3))
    assert out["ci_high"] == pytest.approx(2 + q / math.sqrt(3))
    q80 = 0.6 * math.sqrt(2 / (4 * 0.8 * 0.2))  # the 0.8 quantile, by the same closed form
    assert out["mde80"] == pytest.approx((q + q80) / math.sqrt(3))


@pytest.mark.parametrize("n", [3, 5, 8])
def test_all_positive_differences_give_the_smallest_exact_p(n):
    out = paired_test(np.linspace(0.01, 0.2, n)[::-1])
    assert out["p_sign"] == pytest.approx(2 * 0.5**n)
    assert out["p_wilcoxon"] == pytest.approx(2 * 0.5**n)  # all ranks positive: the most extreme of 2^n sign patterns


def test_paired_test_zeros_and_small_n():
    out = paired_test([0.0, 0.5, -0.5])  # zeros dropped: one positive, one negative
    assert out["p_sign"] == pytest.approx(1.0) and out["mean"] == pytest.approx(0.0)
    assert paired_test([0.0, 0.0, 0.0])["p_sign"] == 1.0
    assert math.isnan(paired_test([0.3])["p_t"]) and paired_test([0.3])["mean"] == pytest.approx(0.3)


def test_holm_adjustment_by_hand():
    """p = (0.01, 0.04, 0.03) and a NaN: m = 3 finite; sorted 0.01·3 = 0.03, 0.03·2 = 0.06, 0.04·1 = 0.04 raised to
    the earlier 0.06; a product above 1 is 1."""
    from esroll.report import holm

    out = holm([0.01, 0.04, 0.03, math.nan])
    assert out[:3] == pytest.approx([0.03, 0.06, 0.06]) and math.isnan(out[3])
    assert holm([0.6, 0.5]) == [1.0, 1.0] and holm([]) == []


def test_area_under_curve_of_known_curves():
    # Trapezoids 0-10 and 10-20, then held at 0.6 until the budget: (3 + 5 + 6) / 30.
    assert area_under_curve([0, 10, 20], [0.2, 0.4, 0.6], 30) == pytest.approx(14 / 30)
    # An evaluation past the budget is interpolated at the budget: the triangle up to (5, 0.5), over 5 s.
    assert area_under_curve([0, 10], [0.0, 1.0], 5) == pytest.approx(0.25)
    # A constant curve has its constant as AUC, whatever the evaluation times.
    assert area_under_curve([0, 3, 4.5, 9], [0.7] * 4, 8) == pytest.approx(0.7)


# ---- configs


@pytest.mark.parametrize(
    "variant",
    [
        "default",
        "quick",
        "tuned",
        "tuned_quick",
        "tuned_hard",
        "es_fall",
        "countdown",
        "gsm8k_qwen3_0.6b",
        "gsm8k_qwen3_8b",
    ],
)
def test_variants_build_valid_comparisons(variant):
    comp = comparison_from_dict(get_config(variant).to_dict())
    assert comp.reference == "looroll" and comp.reference in comp.configs
    for cfg in comp.configs.values():
        assert cfg.train.time_budget_s == comp.time_budget_s and cfg.train.steps >= 2


def test_methods_follow_their_training_configs_and_seeds_pair_them():
    from configs.default import get_config as default_config
    from esroll.config import from_config_dict

    cd = get_config()
    cd.methods = "looroll,eggroll,grpo,looroll_r8"
    comp = comparison_from_dict(cd.to_dict())
    grpo = check_names(from_config_dict(default_config("grpo").to_dict()))
    # configs/default.py:grpo, but for the learning rate (see configs/compare.py) and what the comparison sets.
    assert comp.configs["grpo"].grpo == grpo.grpo and comp.configs["grpo"].model == grpo.model
    assert comp.configs["grpo"].optimizer == dataclasses.replace(grpo.optimizer, lr=1e-4)
    assert comp.configs["grpo"].train.prompts_per_step == grpo.train.prompts_per_step
    assert comp.configs["eggroll"].method == "eggroll" and comp.configs["looroll_r8"].es.rank == 8
    runs = [comp.run_config(m, 2) for m in comp.configs]
    # A seed moves the noise and the batch order, never the data or its held-out split.
    assert {(c.seed, c.data.seed, c.data.batch_seed) for c in runs} == {(2, 0, 2)}
    assert [comp.order(i) for i in range(3)] == [
        ["looroll", "eggroll", "grpo", "looroll_r8"],
        ["eggroll", "grpo", "looroll_r8", "looroll"],
        ["grpo", "looroll_r8", "looroll", "eggroll"],
    ]
    cd.methods = "looroll,sgd"
    with pytest.raises(ValueError, match="method 'sgd' has no entry"):
        comparison_from_dict(cd.to_dict())


@pytest.mark.parametrize(
    "change, message",
    [
        ({"reference": "eggroll", "methods": "looroll,grpo"}, "reference 'eggroll' is not one of the methods"),
        ({"time_budget_s": 0.0}, "need time_budget_s > 0"),
        ({"seeds": ()}, "at least one seed"),
        ({"tuning": {"seeds": (1,), "runs": 2, "search": "random", "seed": 0, "time_budget_s": 0.0}}, "share \\[1\\]"),
        (
            {"tuning": {"seeds": (9,), "runs": 2, "search": "random", "seed": 0, "time_budget_s": 0.0, "space": {}}},
            "no entry for method 'looroll'",
        ),
        (
            {
                "tuning": {
                    "seeds": (9,),
                    "runs": 3,
                    "search": "grid",
                    "seed": 0,
                    "time_budget_s": 0.0,
                    "space": {m: {"optimizer": {"lr": [1e-3]}} for m in ("looroll", "eggroll", "grpo")},
                }
            },
            "1 grid points, fewer than tuning.runs - 1 = 2",
        ),
        (
            {
                "tuning": {
                    "seeds": (9,),
                    "runs": 2,
                    "search": "random",
                    "seed": 0,
                    "time_budget_s": 0.0,
                    "space": {m: {"optimizer": {"lr": "log:0:1"}} for m in ("looroll", "eggroll", "grpo")},
                }
            },
            "tuning.space.looroll.optimizer.lr must be",
        ),
    ],
)
def test_invalid_comparisons_are_refused(change, message):
    d = {**get_config().to_dict(), **change}
    with pytest.raises(ValueError, match=message):
        comparison_from_dict(d)


# ---- the report of a hand-written workdir


def _write_run(directory: Path, method: str, evals: list[tuple[int, float, float]], tail: str = "") -> None:
    """A run directory as `train_and_evaluate` leaves it: config.json and one metrics record per (step, time, acc)."""
    directory.mkdir(parents=True)
    train = {"prompts_per_step": 4, "steps": 100, "time_budget_s": 10.0}
    cfg = {"method": method, "train": train, "es": {"population": 8}}
    (directory / "config.json").write_text(json.dumps(cfg))
    lines = [json.dumps({"step": s, "wall_time": t, "eval_accuracy": a}) for s, t, a in evals]
    (directory / "metrics.jsonl").write_text("".join(line + "\n" for line in lines) + tail)


@pytest.mark.e2e
def test_report_reads_the_workdir_only_and_skips_unfinished_runs(tmp_path):
    spec = {"methods": ["looroll", "eggroll"], "seeds": [0, 1], "time_budget_s": 10.0, "reference": "looroll"}
    (tmp_path / "comparison.json").write_text(json.dumps(spec))
    for seed in (0, 1):
        _write_run(tmp_path / "looroll" / f"seed{seed}", "looroll", [(0, 0.0, 0.4), (5, 10.0, 0.5)])
    _write_run(tmp_path / "eggroll" / "seed0", "eggroll", [(0, 0.0, 0.4), (5, 10.0, 0.7)])
    # Killed mid-append before its last evaluation: a partial last line, and the run is not finished.
    _write_run(tmp_path / "eggroll" / "seed1", "eggroll", [(0, 0.0, 0.4), (3, 6.0, 0.6)], tail='{"step": 5, "wall')

    _, runs = load_comparison(tmp_path)
    complete = {(r.method, r.seed): r.complete for r in runs}
    assert complete == {("looroll", 0): True, ("looroll", 1): True, ("eggroll", 0): True, ("eggroll", 1): False}
    paths = write_report(tmp_path)
    assert len(_rows(paths["runs_csv"])) == 4
    results = {r["method"]: r for r in _rows(paths["results_csv"])}
    assert int(results["eggroll"]["n_seeds"]) == 1 and int(results["eggroll"]["n_pairs"]) == 1
    assert float(results["eggroll"]["final_accuracy_diff_mean"]) == pytest.approx(0.2)
    assert float(results["looroll"]["auc_mean"]) == pytest.approx(0.45)
    assert float(results["looroll"]["evaluations_mean"]) == 8 * 5


@pytest.mark.e2e
def test_reporting_does_not_import_jax():
    code = "import sys, esroll.report; assert 'jax' not in sys.modules, 'esroll.report imported jax'"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


# ---- the quick comparison, end to end


def _rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def _auc_by_segments(times, accs, budget):
    """Independent of the library: sum of trapezoids, each clipped at the budget, then the last value held."""
    area, t_prev, a_prev = 0.0, times[0], accs[0]
    for t, a in zip(times[1:], accs[1:]):
        if t_prev >= budget:
            break
        end = min(t, budget)
        a_end = a_prev + (a - a_prev) * (end - t_prev) / (t - t_prev)
        area += (end - t_prev) * (a_prev + a_end) / 2
        t_prev, a_prev = end, a_end
    return (area + max(budget - t_prev, 0.0) * a_prev) / budget


@pytest.fixture(scope="module")
def quick_comparison(tmp_path_factory):
    """The tuned protocol in seconds (configs/compare.py:tuned_quick): LOO-ROLL and GRPO, each tuned over 2
    settings on one tuning seed, then run on 2 evaluation seeds."""
    cd = get_config("tuned_quick")
    cd.experiment.model.path = SHIPPED_MODEL
    comp = comparison_from_dict(cd.to_dict())
    workdir = tmp_path_factory.mktemp("compare")
    statuses = run_comparison(comp, workdir, mesh_devices=1, progress=False)
    return comp, workdir, statuses


@pytest.mark.e2e
def test_tuning_chooses_on_validation_from_the_runs_on_disk_and_never_evaluates_on_a_tuning_seed(quick_comparison):
    from esroll.compare import candidates, choose, tuning_dir
    from esroll.data import make_splits

    comp, workdir, _ = quick_comparison
    tuning = comp.tuning
    choice = json.loads((workdir / "tuning" / "choice.json").read_text())
    assert choice == json.loads(json.dumps(choose(comp, workdir)))  # reproducible from the tuning runs on disk
    for method in comp.configs:
        means = []
        for k, overrides in enumerate(candidates(tuning, method)):
            aucs = []
            for seed in tuning.seeds:
                run = tuning_dir(workdir, method, k, seed)
                cfg = json.loads((run / "config.json").read_text())
                assert cfg["seed"] == seed and cfg["data"]["eval_split"] == "validation"
                assert cfg["train"]["time_budget_s"] == tuning.time_budget_s
                evals = [r for r in read_metrics(run / "metrics.jsonl") if "eval_accuracy" in r]
                times, accs = [r["wall_time"] for r in evals], [r["eval_accuracy"] for r in evals]
                aucs.append(_auc_by_segments(times, accs, tuning.time_budget_s))
            means.append(np.mean(aucs))
        best = int(np.argmax(means))  # the first of equal maxima
        assert choice[method]["chosen"] == best
        assert choice[method]["overrides"] == candidates(tuning, method)[best]
        for seed in comp.seeds:  # the evaluation runs: the chosen setting, on the test split, never a tuning seed
            cfg = json.loads((workdir / method / f"seed{seed}" / "config.json").read_text())
            assert cfg["seed"] == seed and seed not in tuning.seeds and cfg["data"]["eval_split"] == "test"
            expected = comp.run_config(method, seed, choice[method]["overrides"])
            assert cfg["optimizer"]["lr"] == expected.optimizer.lr
    base = comp.configs["looroll"]
    validation = make_splits(dataclasses.replace(base.data, eval_split="validation"))[1]
    test = make_splits(base.data)[1]
    assert len(validation) == base.data.validation_size and len(test) == base.data.eval_size - len(validation)
    assert not {e.prompt for e in validation} & {e.prompt for e in test}


@pytest.mark.e2e
def test_quick_comparison_tables_match_the_runs(quick_comparison):
    comp, workdir, statuses = quick_comparison
    assert statuses == [(m, s, "ran") for i, s in enumerate(comp.seeds) for m in comp.order(i)]
    paths = write_report(workdir)
    md = paths["results_md"].read_text()
    assert paths["figure"].stat().st_size > 0 and "Wilcoxon" in md
    assert "Machine speed alongside" in md and "| looroll | **c" in md  # the speed probe, the chosen settings

    runs = {(r["method"], int(r["seed"])): r for r in _rows(paths["runs_csv"])}
    assert set(runs) == {(m, s) for m in comp.configs for s in comp.seeds}
    finals, aucs = {}, {}
    for (method, seed), row in runs.items():
        run = workdir / method / f"seed{seed}"
        cfg = json.loads((run / "config.json").read_text())
        assert (cfg["method"], cfg["seed"], cfg["data"]["seed"], cfg["data"]["order_seed"]) == (method, seed, 0, seed)
        records = read_metrics(run / "metrics.jsonl")
        evals = [r for r in records if "eval_accuracy" in r]
        steps = records[-1]["step"]
        finals[method, seed] = evals[-1]["eval_accuracy"]
        assert row["complete"] == "True" and int(row["steps"]) == steps
        assert records[-1]["wall_time"] >= comp.time_budget_s or steps == cfg["train"]["steps"]
        assert float(row["final_accuracy"]) == evals[-1]["eval_accuracy"]
        assert float(row["initial_accuracy"]) == evals[0]["eval_accuracy"]
        auc = _auc_by_segments([r["wall_time"] for r in evals], [r["eval_accuracy"] for r in evals], comp.time_budget_s)
        assert float(row["auc"]) == pytest.approx(auc, abs=1e-12)
        aucs[method, seed] = auc
        per_step = cfg["train"]["prompts_per_step"] * (
            cfg["grpo"]["group_size"] if method == "grpo" else cfg["es"]["population"]
        )
        assert int(row["completions"]) == per_step * steps == records[-1]["completions"]
    # Paired runs start from the same model on the same held-out set.
    for seed in comp.seeds:
        assert runs["grpo", seed]["initial_accuracy"] == runs["looroll", seed]["initial_accuracy"]

    results = {r["method"]: r for r in _rows(paths["results_csv"])}
    diffs = [finals["grpo", s] - finals["looroll", s] for s in comp.seeds]
    for method in comp.configs:
        mine = [finals[method, s] for s in comp.seeds]
        assert float(results[method]["final_accuracy_mean"]) == pytest.approx(np.mean(mine))
        assert float(results[method]["final_accuracy_sd"]) == pytest.approx(np.std(mine, ddof=1))
        assert float(results[method]["auc_mean"]) == pytest.approx(np.mean([aucs[method, s] for s in comp.seeds]))
    egg = results["grpo"]
    assert int(egg["n_pairs"]) == len(comp.seeds)
    assert float(egg["final_accuracy_diff_mean"]) == pytest.approx(np.mean(diffs))
    assert float(egg["final_accuracy_diff_sd"]) == pytest.approx(np.std(diffs, ddof=1))
    nonzero = [d for d in diffs if d != 0]
    m, k = len(nonzero), sum(d > 0 for d in nonzero)
    sign_p = min(1.0, 2 * sum(math.comb(m, i) for i in range(min(k, m - k) + 1)) / 2**m)
    assert float(egg["final_accuracy_diff_p_sign"]) == pytest.approx(sign_p)
    # One method against the reference: Holm over one test leaves its p as it is.
    assert egg["final_accuracy_diff_p_holm"] == egg["final_accuracy_diff_p_t"]


@pytest.mark.e2e
def test_rerun_skips_finished_runs_and_resumes_an_interrupted_one(quick_comparison):
    comp, workdir, _ = quick_comparison
    files = sorted(workdir.glob("*/seed*/metrics.jsonl"))
    before = {p: p.read_text() for p in files}
    statuses = run_comparison(comp, workdir, mesh_devices=1, progress=False)
    assert statuses == [(m, s, "skipped") for i, s in enumerate(comp.seeds) for m in comp.order(i)]
    assert {p: p.read_text() for p in files} == before

    # Interrupt looroll seed 1 before its final evaluation was written: only that run runs again, and it resumes
    # (the records it kept are unchanged) instead of starting over.
    interrupted = workdir / "looroll" / "seed1" / "metrics.jsonl"
    kept = before[interrupted].splitlines(keepends=True)[:-1]
    interrupted.write_text("".join(kept))
    statuses = run_comparison(comp, workdir, mesh_devices=1, progress=False)
    assert [s for s in statuses if s[2] == "ran"] == [("looroll", 1, "ran")]
    resumed = interrupted.read_text().splitlines(keepends=True)
    assert resumed[: len(kept)] == kept and "eval_accuracy" in read_metrics(interrupted)[-1]


@pytest.mark.e2e
def test_entry_script_writes_the_report(quick_comparison):
    _, workdir, _ = quick_comparison
    (workdir / "results.md").unlink(missing_ok=True)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.compare",
            "--config",
            "configs/compare.py:tuned_quick",
            "--workdir",
            str(workdir),
            "--report_only",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert (workdir / "results.md").read_text() in out.stdout


@pytest.mark.e2e
def test_advantage_estimator_comparison_quick(tmp_path):
    """configs/advantages.py:quick through the comparison: plain GRPO, ntf (one completion per prompt) and DDRL
    (label-free: majority-vote rewards), paired against GRPO, with the fraction of all-equal groups in the report
    (none for ntf's groups of one); every variant builds. (BV-Blend's state: test_grpo's resume test; the ES
    counterparts: test_advantage_estimators.)"""
    from configs import advantages

    for variant in advantages.VARIANTS:
        comp = comparison_from_dict(advantages.get_config(variant).to_dict())
        assert comp.reference in comp.configs and len(comp.configs) >= 3
    cd = advantages.get_config("quick")
    cd.experiment.model.path = SHIPPED_MODEL
    comp = comparison_from_dict(cd.to_dict())
    run_comparison(comp, tmp_path, mesh_devices=1, progress=False)
    assert json.loads((tmp_path / "ddrl" / "seed1" / "config.json").read_text())["grpo"]["advantage"] == "ddrl"
    ntf = read_metrics(tmp_path / "ntf" / "seed0" / "metrics.jsonl")[1]
    assert "ntf_filtered_fraction" in ntf and ntf["completions"] == 16  # 16 prompts × 1, as GRPO's 4 × 4
    ddrl = read_metrics(tmp_path / "ddrl" / "seed0" / "metrics.jsonl")
    assert 0 <= ddrl[1]["pseudo_label_agreement"] <= 1 and "ddrl_kept_fraction" in ddrl[1]
    assert "eval_accuracy" in ddrl[-1]  # the gold answer still scores evaluation
    paths = write_report(tmp_path)
    results = {r["method"]: r for r in _rows(paths["results_csv"])}
    assert results["grpo"]["all_equal_groups_mean"] != "nan" and results["ntf"]["all_equal_groups_mean"] == "nan"
    assert int(results["ddrl"]["n_pairs"]) == 2 and "all-equal groups" in paths["results_md"].read_text()


def test_shared_draws_give_methods_with_one_space_the_same_candidates():
    from configs.compare import ES_SPACE
    from esroll.compare import Tuning, candidates

    spaces = {"looroll": ES_SPACE, "eggroll": ES_SPACE}
    own = Tuning((100,), 4, "random", spaces, 60.0)
    shared = dataclasses.replace(own, shared_draws=True)
    assert candidates(shared, "looroll") == candidates(shared, "eggroll")
    assert candidates(own, "looroll") != candidates(own, "eggroll")  # each method's own draws (the measured `tuned`)
    assert comparison_from_dict(get_config("tuned_hard").to_dict()).tuning.shared_draws


@pytest.mark.e2e
def test_step_level_comparison_quick_inherits_grpo_s_tuned_learning_rate(tmp_path):
    """configs/step_level_compare.py:quick through the tuned protocol: plain GRPO tunes its learning rate, VeriGate
    starts from GRPO's chosen setting (`tuning.inherit`) and tunes only its own γ, LOO-ROLL with the dense step
    fitness tunes its learning rate; the report gives each arm's all-equal groups and the share of them with a
    signal. Every variant builds, with its 11 arms paired against plain GRPO."""
    from configs import step_level_compare
    from esroll.compare import candidates, choose, tuning_dir

    for variant in step_level_compare.VARIANTS:
        comp = comparison_from_dict(step_level_compare.get_config(variant).to_dict())
        assert comp.reference == "grpo" and comp.configs["looroll_dense"].es.step_weight == 0.5
        if variant != "quick":
            assert list(comp.configs) == list(step_level_compare.ARMS)
            assert candidates(comp.tuning, "graft") == [{}]  # no option of its own
    cd = step_level_compare.get_config("quick")
    cd.experiment.model.path = str(REPO / "assets" / "tiny-qwen3-steps")
    comp = comparison_from_dict(cd.to_dict())
    run_comparison(comp, tmp_path, mesh_devices=1, progress=False)
    choice = json.loads((tmp_path / "tuning" / "choice.json").read_text())
    assert choice == json.loads(json.dumps(choose(comp, tmp_path)))
    grpo_lr = [1e-4, 2e-4][choice["grpo"]["chosen"]]
    for k, gamma in enumerate((1.0, 0.9)):  # VeriGate's candidates: its own γ and 0.9, both at GRPO's chosen rate
        cfg = json.loads((tuning_dir(tmp_path, "verigate", k, 100) / "config.json").read_text())
        assert cfg["optimizer"]["lr"] == grpo_lr and cfg["grpo"]["adv"]["verigate"]["gamma"] == gamma
    verigate = json.loads((tmp_path / "verigate" / "seed1" / "config.json").read_text())
    assert verigate["optimizer"]["lr"] == grpo_lr and verigate["data"]["eval_split"] == "test"
    dense = read_metrics(tmp_path / "looroll_dense" / "seed0" / "metrics.jsonl")
    assert "step_score_mean" in dense[1] and "frac_groups_all_equal" in dense[1]
    results = {r["method"]: r for r in _rows(write_report(tmp_path)["results_csv"])}
    assert set(results) == {"grpo", "verigate", "looroll_dense"} and int(results["verigate"]["n_pairs"]) == 2
    assert "all_equal_signal_mean" in results["verigate"]


def test_critic_comparison_pairs_ppo_with_grpo_s_tuned_setting():
    """configs/critic_compare.py: every variant builds with GRPO as the reference; PPO differs from GRPO only by its
    estimator (so the pairing isolates the critic); every critic arm (PPO; SR-PPO on the step task; HyGAE and DAE on
    FrozenLake) starts from GRPO's chosen setting and tunes its critic's learning rate (its own 1e-4, or 1e-3);
    LOO-ROLL tunes its learning rate."""
    from configs import critic_compare
    from esroll.compare import candidates

    critic_arms = {"steps": ("ppo", "srppo"), "frozenlake": ("ppo", "hygae", "dae"), "quick": ("ppo",)}
    estimator = {"ppo": "gae", "srppo": "srppo", "hygae": "hygae", "dae": "dae"}
    for variant in critic_compare.VARIANTS:
        comp = comparison_from_dict(critic_compare.get_config(variant).to_dict())
        assert comp.reference == "grpo" and comp.tuning.inherit == {a: "grpo" for a in critic_arms[variant]}
        grpo, ppo = (dataclasses.asdict(comp.configs[m]) for m in ("grpo", "ppo"))
        assert ppo["grpo"].pop("advantage") == "gae" and grpo["grpo"].pop("advantage") == "grpo"
        assert ppo == grpo
        for arm in critic_arms[variant]:
            assert comp.configs[arm].grpo.advantage == estimator[arm]
            lr = {"grpo": {"adv": {estimator[arm]: {"critic_lr": 1e-3}}}}
            assert candidates(comp.tuning, arm) == [{}, lr]
        if variant != "quick":
            assert list(comp.configs) == list(critic_compare.ARMS[variant])
            assert len(candidates(comp.tuning, "looroll")) == 2
    assert (
        comparison_from_dict(critic_compare.get_config("frozenlake").to_dict()).configs["ppo"].env.name == "frozenlake"
    )


def test_distill_comparison_builds_every_arm_with_the_teacher():
    """configs/distill_compare.py: the 7 arms paired against plain GRPO; each distillation arm and LOO-ROLL with the
    teacher fitness read the shipped teacher, plain GRPO and LOO-ROLL none; OPD+ at the Jensen–Shannon f; the
    distillation arms start from GRPO's chosen setting with no option of their own, LOO-ROLL with the teacher from
    LOO-ROLL's. The quick variant builds its 3 arms."""
    from configs import distill_compare
    from esroll.compare import candidates
    from esroll.experiment import unread_keys

    comp = comparison_from_dict(distill_compare.get_config("steps").to_dict())
    assert comp.reference == "grpo" and list(comp.configs) == list(distill_compare.ARMS)
    for arm, cfg in comp.configs.items():
        reads = arm not in ("grpo", "looroll")
        assert (cfg.teacher.path == "assets/tiny-qwen3-steps-teacher") == reads, arm
        assert ("teacher.path" in unread_keys(cfg)) != reads, arm
    assert comp.configs["opd_plus_js"].grpo.adv["opd_plus"].divergence == "js"
    assert comp.configs["gkd"].grpo.advantage == "gkd" and comp.configs["looroll_teacher"].es.teacher_weight == 1.0
    assert dict(comp.tuning.inherit) == distill_compare.INHERIT
    assert all(candidates(comp.tuning, arm) == [{}] for arm in distill_compare.INHERIT)
    assert len(candidates(comp.tuning, "grpo")) == len(candidates(comp.tuning, "looroll")) == 2
    quick = comparison_from_dict(distill_compare.get_config("quick").to_dict())
    assert list(quick.configs) == ["grpo", "opd", "looroll_teacher"]
    with pytest.raises(ValueError, match="configs/distill_compare.py"):
        distill_compare.get_config("hard")


@pytest.mark.e2e
def test_dense_comparison_quick_runs_the_judge_arms(tmp_path):
    """configs/dense_compare.py:quick through the tuned protocol: plain GRPO, ExpRL (the judge as its step verifier,
    GRPO's chosen setting with the source's first-step credit or its rise) and LOO-ROLL with the judge's fitness
    (half of it), each logging its judge's figures; every variant builds with GRPO as the reference (steps: APPO from
    GRPO's setting tuning its branch points; frozenlake: SVM from GRPO's setting tuning its λ, and LOO-ROLL with its
    fitness)."""
    from configs import dense_compare
    from esroll.compare import candidates

    svm = comparison_from_dict(dense_compare.get_config("frozenlake").to_dict())
    assert list(svm.configs) == list(dense_compare.ARMS["frozenlake"]) and svm.tuning.inherit == {"svm": "grpo"}
    assert svm.configs["svm"].grpo.advantage == "svm" and svm.configs["looroll_svm"].es.svm_weight == 0.1
    assert candidates(svm.tuning, "svm") == [{}, {"grpo": {"adv": {"svm": {"lam": 0.3}}}}]
    for variant in ("steps", "quick"):
        comp = comparison_from_dict(dense_compare.get_config(variant).to_dict())
        assert comp.reference == "grpo" and comp.tuning.inherit["exprl"] == "grpo"
        exprl, dense = comp.configs["exprl"], comp.configs["looroll_exprl"]
        assert exprl.grpo.advantage == "exprl" and exprl.steps.verifier == "exprl"
        assert dense.es.step_weight == 0.5 and dense.steps.verifier == "exprl"
        assert candidates(comp.tuning, "exprl") == [{}, {"grpo": {"adv": {"exprl": {"first_step": "rise"}}}}]
        if variant != "quick":
            assert list(comp.configs) == list(dense_compare.ARMS[variant])
            assert comp.tuning.inherit == {"exprl": "grpo", "appo": "grpo"}
            assert comp.configs["appo"].grpo.advantage == "appo"
            assert candidates(comp.tuning, "appo") == [{}, {"grpo": {"adv": {"appo": {"positions": 1}}}}]
    cd = dense_compare.get_config("quick")
    cd.experiment.model.path = str(REPO / "assets" / "tiny-qwen3-steps")
    run_comparison(comparison_from_dict(cd.to_dict()), tmp_path, mesh_devices=1, progress=False)
    assert "exprl_final_score" in read_metrics(tmp_path / "exprl" / "seed0" / "metrics.jsonl")[1]
    assert "step_score_mean" in read_metrics(tmp_path / "looroll_exprl" / "seed1" / "metrics.jsonl")[1]
    results = {r["method"]: r for r in _rows(write_report(tmp_path)["results_csv"])}
    assert set(results) == {"grpo", "exprl", "looroll_exprl"} and int(results["exprl"]["n_pairs"]) == 2
