"""Figures a comparison's report leaves out, from its workdir (the README quotes them): paired differences against
any method, Holm-adjusted paired-t p over the methods given, the fraction of all-equal groups over the first steps,
each run's start, peak, final accuracy and drop from its peak, and any logged training metric (--metric, repeated)
averaged over each run's first and last --early_steps steps.

    python -m experiments.comparison_extras --workdir runs/advantages_hard --reference grpo \
        --holm rloo,agrae,bv_blend,gmae,maxpo,lampo,ntf
    python -m experiments.comparison_extras --workdir runs/agents_repro --reference grpo \
        --metric reflection_parsed --metric reflection_oracle
"""

from __future__ import annotations

import argparse

import numpy as np

from esroll.metrics import read_metrics
from esroll.report import area_under_curve, holm, load_comparison, paired_test, run_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--reference", required=True, help="paired differences are method − reference")
    parser.add_argument("--holm", default="", help="comma-separated methods whose tests Holm adjusts together")
    parser.add_argument("--early_steps", type=int, default=5)
    parser.add_argument("--metric", action="append", default=[], help="a training metric to average per run")
    args = parser.parse_args(argv)

    spec, runs = load_comparison(args.workdir)
    budget = float(spec["time_budget_s"])
    by = {(r.method, r.seed): r for r in runs}
    metrics = {
        "final": lambda r: r.final_accuracy,
        "AUC": lambda r: area_under_curve(r.times, r.accuracies, budget),
    }
    print(f"paired differences against {args.reference} (points; 95% t-interval, paired t p)")
    tests = []
    for method in spec["methods"]:
        seeds = [s for s in spec["seeds"] if (method, s) in by and (args.reference, s) in by]
        if method == args.reference or not seeds:
            continue
        for name, value in metrics.items():
            t = paired_test([100 * (value(by[method, s]) - value(by[args.reference, s])) for s in seeds])
            print(
                f"  {method:22s} {name:6s} {t['mean']:+.1f} [{t['ci_low']:.1f}, {t['ci_high']:.1f}] p = {t['p_t']:.3f}"
            )
            if method in args.holm.split(","):
                tests.append((t["p_t"], method, name))
    if tests:
        print(f"Holm over {len(tests)} tests")
        for (p, method, name), adjusted in sorted(zip(tests, holm([t[0] for t in tests]))):
            print(f"  {method:22s} {name:6s} p = {p:.4f}  Holm p = {adjusted:.3f}")

    print(f"all-equal groups over the first {args.early_steps} steps (%, mean and range over seeds)")
    for method in spec["methods"]:
        early = []
        for seed in spec["seeds"]:
            records = read_metrics(run_dir(args.workdir, method, seed) / "metrics.jsonl")
            fractions = [r["frac_groups_all_equal"] for r in records if "frac_groups_all_equal" in r]
            if fractions:
                early.append(100 * np.mean(fractions[: args.early_steps]))
        if early:
            print(f"  {method:22s} {np.mean(early):.0f} ({min(early):.0f}-{max(early):.0f})")

    for name in args.metric:
        print(f"{name}: mean over the first and the last {args.early_steps} steps that log it, per run")
        for method in spec["methods"]:
            for seed in spec["seeds"]:
                records = read_metrics(run_dir(args.workdir, method, seed) / "metrics.jsonl")
                values = [float(r[name]) for r in records if name in r and np.isfinite(float(r[name]))]
                if values:
                    first, last = np.mean(values[: args.early_steps]), np.mean(values[-args.early_steps :])
                    print(f"  {method:22s} seed{seed} first {first:.3f} last {last:.3f} ({len(values)} steps)")

    print("runs: start, peak (at s), final accuracy, steps, drop from the peak (points)")
    for r in runs:
        peak = int(np.argmax(r.accuracies))
        print(
            f"  {r.method:22s} seed{r.seed} start {r.accuracies[0]:.3f} peak {r.accuracies[peak]:.3f} at "
            f"{r.times[peak]:.0f}s final {r.final_accuracy:.3f} steps {r.steps} "
            f"drop {100 * (r.accuracies[peak] - r.final_accuracy):.1f}"
        )


if __name__ == "__main__":
    main()
