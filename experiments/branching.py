"""Does APPO's Branching Score find the tokens whose choice changes the chance of a right answer? Its score, the
entropy and the future likelihood gain Ω alone, each against the Monte Carlo |ΔV| of every token position of
completions sampled from one or more fixed models (`esroll.grpo.branch_credit`); writes results.json and results.md
to --out.

    python -m experiments.branching --models shipped=assets/tiny-qwen3-steps,grpo50=runs/credit_grpo50/final \
        --out docs/results/branching

Each model is named `label=path` (a Hugging Face folder); Ω is its likelihood gain over --reference (the shipped
steps model: for the shipped model itself Ω is 1 everywhere, and APPO's choice falls back to the entropy). The
task, sampling temperature and new-token budget are `configs/step_level.py:grpo`'s (--config for another); the
completions are --group per question of the first --prompts held-out questions.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from esroll import parallel
from esroll.data import make_splits
from esroll.grpo.branch_credit import SIGNALS, measure
from esroll.task import load_task
from experiments._entry import quiet_tpu_probe
from experiments.credit import _config, check_halves, command_of, parse_models, run_meta, write_results

NAMES = {"bs": "Branching Score (BS)", "entropy": "entropy H", "omega": "future gain Ω"}


def _cell(s: dict, name: str) -> str:
    if not np.isfinite(s[name]):
        return "–"
    return f"{s[name]:.2f} [{s[name + '_low']:.2f}, {s[name + '_high']:.2f}]"


def report(results: dict, command: str, meta: dict) -> str:
    lines = [
        "# APPO's Branching Score against Monte Carlo value changes",
        "",
        f"```\n{command}\n```",
        "",
        f"Run on {meta['date']}, {meta['platform']} ({meta['cpus']} CPU cores), {meta['seconds']:.0f} s; seed "
        f"{meta['seed']}. Ω against `{meta['reference']}`.",
        "",
        "At every token position t ≥ 1 of each completion, |ΔV_t| = |V(first t + 1 tokens) − V(first t tokens)|, each",
        "V the mean reward of K continuations (the whole completion's: its reward). Spearman: pooled over all",
        "positions; within: the mean over completions of the correlation within one; lift: mean |ΔV| at the positions",
        "APPO would branch at (for H and Ω alone, their top positions; Ω picks none where it is the same at every",
        "token) over the mean |ΔV| of their completions, once per pick (1 = positions drawn at random), and that less",
        "the entropy's (paired on the same completions).",
        "Brackets: 95% bootstrap intervals over prompts. Reliability: split-half rank correlation of |ΔV| from two",
        "halves of the continuations, stepped up to K — about the ceiling of a correlation seen through this noise.",
    ]
    for label, res in results.items():
        s = res["sample"]
        lines += [
            "",
            f"## {label}",
            "",
            f"{s['prompts']} prompts × {s['completions'] // s['prompts']} completions, mean reward "
            f"{s['mean_reward']:.3f}, {s['positions']} positions, K = {s['k']} ({s['continuations']} continuations), "
            f"mean |ΔV| {s['abs_dv_mean']:.3f}; Ω varies within {100 * s['omega_varies']:.0f}% of the completions; "
            f"{s['positions_per_branch']} positions per completion; |ΔV| reliability {res['reliability']:.2f}.",
            "",
            "| signal | Spearman with abs ΔV | within a completion | lift at its chosen positions | lift − entropy's |",
            "|---|---|---|---|---|",
        ]
        for name in SIGNALS:
            r = res[name]
            diff = _cell(r, "lift_over_entropy") if "lift_over_entropy" in r else "–"
            cells = " | ".join(_cell(r, key) for key in ("spearman", "spearman_within", "lift"))
            lines.append(f"| {NAMES[name]} | {cells} | {diff} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="shipped=assets/tiny-qwen3-steps", help="label=path,...")
    parser.add_argument("--reference", default="assets/tiny-qwen3-steps")
    parser.add_argument("--config", default="configs/step_level.py:grpo")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--group", type=int, default=2)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--boot", type=int, default=1000)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    quiet_tpu_probe()
    models = parse_models(args.models)
    check_halves("--k", args.k)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mesh = parallel.make_mesh(1)
    start = time.perf_counter()
    ref_cfg = _config(args.config, args.reference)
    _, ref_params = load_task(ref_cfg, *make_splits(ref_cfg.data), mesh)  # the one reference of every model's Ω
    results = {}
    for label, path in models:
        cfg = _config(args.config, path)
        train, held_out = make_splits(cfg.data)
        if args.prompts > len(held_out):
            raise SystemExit(f"error: --prompts: {args.prompts} > the {len(held_out)} held-out questions")
        task, params = load_task(cfg, train, held_out, mesh)
        results[label] = measure(
            cfg, task, params, ref_params, mesh, held_out[: args.prompts],
            group_size=args.group, k=args.k, seed=args.seed, boot=args.boot,
        )  # fmt: skip
    meta = run_meta(start, args.seed, models, reference=args.reference)
    write_results(out, results, meta, report(results, command_of("experiments.branching", parser, args), meta))
    return results


if __name__ == "__main__":
    main()
