"""Credit accuracy of every step-level estimator (and GRPO, GuAE, `mc_steps` at small K) against Monte Carlo step
advantages (raw and corrected for the reference's reliability), on groups sampled from one or more fixed models
(`esroll.grpo.credit`); writes results.json, results.md and credit.png to --out.

    python -m experiments.credit --models shipped=assets/tiny-qwen3-steps,grpo50=runs/credit_grpo50/final \
        --out docs/results/credit

Each model is named `label=path` (a Hugging Face folder: the shipped model, or a run's `final` export); `--critics
label=path` scores a PPO run's critic (its `final_critic` export) on the groups of the model of that label: rows
`ppo` (GAE at the config's λ) and `ppo_lam1` (λ = 1); `--success_heads label=path` an SR-PPO run's success head
(its `final_critic`): rows `srppo_k1` and `srppo_k4` (its pass@k credit). The task,
the sampling temperature, the steps section and the new-token budget are `configs/step_level.py:grpo`'s (--config
for another); the groups are the first --prompts held-out questions, --group completions each.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import time
from pathlib import Path

import jax
import numpy as np

from esroll import parallel
from esroll.config import from_config_dict
from esroll.grpo.credit import BRANCHED, OPTION_ROWS, SCORED, measure
from esroll.data import make_splits
from esroll.experiment import check_names
from esroll.models import load_hf
from esroll.task import load_task
from experiments._entry import quiet_tpu_probe

ROWS = (*SCORED, *OPTION_ROWS, *BRANCHED, "mc_steps_k2", "mc_steps_k4")
CRITIC_ROWS = ("ppo", "ppo_lam1", "srppo_k1", "srppo_k4")


def rows(results: dict) -> tuple[str, ...]:
    """The report's rows: every estimator's, then the critics' where any model has one."""
    return ROWS + tuple(n for n in CRITIC_ROWS if any(n in res for res in results.values()))


def _config(spec: str, model: str):
    path, _, variant = spec.partition(":")
    module = importlib.util.spec_from_file_location("credit_config", path)
    loaded = importlib.util.module_from_spec(module)
    module.loader.exec_module(loaded)
    cd = loaded.get_config(variant or None)
    cd.model.path = model
    return check_names(from_config_dict(cd.to_dict()))


def _cell(s: dict, name: str) -> str:
    if np.isnan(s[name]):
        return "–"
    return f"{s[name]:.2f} [{s[name + '_low']:.2f}, {s[name + '_high']:.2f}]"


def report(results: dict, command: str, meta: dict) -> str:
    models = ", ".join(f"{label} = `{path}`" for label, path in meta["models"])
    lines = [
        "# Credit accuracy of the step-level estimators",
        "",
        "```",
        command,
        "```",
        "",
        f"Run on {meta['date']}, {meta['platform']} ({meta['cpus']} CPU cores), {meta['seconds']:.0f} s; seed "
        f"{meta['seed']}. Models: {models}.",
        "",
        "Per model: Spearman correlation of each method's step advantages with Monte Carlo step advantages (V(prompt)",
        "from K_ref fresh rollouts of the prompt, V after each step from K_ref continuations, the completion's reward",
        "after its last step), pooled over all steps; the same corrected for the reference's noise (divided by the",
        "square root of its split-half reliability: an estimate of the correlation with the exact step advantages);",
        "sign agreement over the steps whose Monte Carlo advantage is non-zero at 95%; the share of all-equal groups",
        "given a non-zero signal. Brackets: 95% bootstrap intervals over prompts. `mc_steps_k2` / `_k4`: `mc_steps`",
        "from 2 / 4 continuations sampled apart from the reference's, V(prompt) leave-one-out from the group. `appo`:",
        "APPO at its defaults, with one continuation from each of the 3 token positions it picks per completion (the",
        "most uncertain tokens: against the sampling model itself Ω is 1), read per step as the mean over the step's",
        "tokens. `grpo` (the same advantage on every step of a completion) is the row to beat.",
    ]
    for label, res in results.items():
        s = res["sample"]
        lines += [
            "",
            f"## {label}",
            "",
            f"{s['prompts']} prompts × {s['group_size']} completions, mean reward {s['mean_reward']:.3f}, "
            f"{s['mean_steps']:.2f} steps per completion, {s['all_equal_groups']} all-equal groups, K_ref = "
            f"{s['k_ref']} ({s['reference_rows']} reference continuations), {res[SCORED[0]]['steps']} steps scored, "
            f"{res[SCORED[0]]['significant_steps']} with a Monte Carlo advantage non-zero at 95%; "
            f"{s['prompt_rollouts']} fresh rollouts of the prompts (mean reward {s['prompt_value']:.3f}; per prompt, "
            f"fresh − group {s['prompt_value_gap']:+.3f} [{s['prompt_value_gap_low']:+.3f}, "
            f"{s['prompt_value_gap_high']:+.3f}]); the "
            f"reference's split-half reliability {_cell(res[SCORED[0]], 'reliability')}.",
            "",
            "| method | Spearman | Spearman, corrected | sign agreement | all-equal groups with signal |",
            "|---|---|---|---|---|",
        ]
        for name in rows(results):
            if name not in res:
                lines.append(f"| `{name}` | " + " | ".join(["–"] * 4) + " |")
                continue
            r = res[name]
            cells = [_cell(r, c) for c in ("spearman", "spearman_corrected", "sign_agreement", "equal_signal")]
            lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def figure(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.6))
    width = 0.8 / max(len(results), 1)
    names = rows(results)
    nan = {"spearman": np.nan, "spearman_corrected": np.nan, "spearman_corrected_low": np.nan}
    nan["spearman_corrected_high"] = np.nan
    for i, (label, res) in enumerate(results.items()):
        x = np.arange(len(names)) + i * width
        y = np.array([res.get(n, nan)["spearman_corrected"] for n in names], np.float64)
        low = np.array([res.get(n, nan)["spearman_corrected_low"] for n in names], np.float64)
        high = np.array([res.get(n, nan)["spearman_corrected_high"] for n in names], np.float64)
        err = np.nan_to_num(np.stack([y - low, high - y]))
        ax.bar(x, np.nan_to_num(y), width, yerr=err, label=f"{label}, corrected", capsize=2)
        raw = np.array([res.get(n, nan)["spearman"] for n in names], np.float64)
        ax.scatter(
            x, raw, marker="D", s=14, color="white", edgecolor="black", zorder=3, label="raw" if i == 0 else None
        )
    ax.set_xticks(np.arange(len(names)) + width * (len(results) - 1) / 2, names, rotation=30, ha="right")
    ax.set_ylabel("Spearman with MC step advantage")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _value_model(flag: str, path: str | None) -> dict | None:
    """The parameters of the value model at `path` (None: none named); anything else is refused naming `flag`."""
    if path is None:
        return None
    cfg, params = load_hf(path)
    if cfg.head != "value":
        raise SystemExit(f"error: {flag}: {path} is not a value model")
    return params


def parse_models(text: str) -> list[list[str]]:
    """`--models`' [label, path] pairs from "label=path,label=path"; anything else is refused naming the flag."""
    models = [m.split("=", 1) for m in text.split(",") if m]
    if not models or any(len(m) != 2 or not m[0] or not m[1] for m in models):
        raise SystemExit(f"error: --models: expected label=path[,label=path...], got {text!r}")
    return models


def check_halves(flag: str, k: int) -> None:
    """A count of samples the reliability splits in halves: even and at least 2, else refused naming `flag`."""
    if k < 2 or k % 2:
        raise SystemExit(f"error: {flag}: an even number >= 2 (the reliability splits it in halves), got {k}")


def command_of(module: str, parser, args) -> str:
    """The command line that reproduces a run: the module and every flag set away from its default, and --out."""
    flags = " ".join(f"--{k} {v}" for k, v in vars(args).items() if v != parser.get_default(k) or k == "out")
    return f"python -m {module} {flags}"


def run_meta(start: float, seed: int, models, **more) -> dict:
    """The report's meta: date, platform, CPU count, seconds since `start`, seed, models and `more`."""
    return {
        "date": datetime.date.today().isoformat(),
        "platform": jax.devices()[0].platform,
        "cpus": os.cpu_count(),
        "seconds": time.perf_counter() - start,
        "seed": seed,
        "models": models,
        **more,
    }


def write_results(out: Path, results: dict, meta: dict, text: str) -> None:
    """results.json (meta and results) and results.md (`text`) in `out`; the text printed too."""
    (out / "results.json").write_text(json.dumps({"meta": meta, **results}, indent=1, default=float) + "\n")
    (out / "results.md").write_text(text)
    print(text)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="shipped=assets/tiny-qwen3-steps", help="label=path,...")
    parser.add_argument("--critics", default="", help="label=path,...: a value model for the model of that label")
    parser.add_argument(
        "--success_heads", default="", help="label=path,...: an SR-PPO run's success head, as --critics"
    )
    parser.add_argument("--config", default="configs/step_level.py:grpo")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--k_ref", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--boot", type=int, default=1000)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    quiet_tpu_probe()
    models = parse_models(args.models)
    check_halves("--k_ref", args.k_ref)
    critics, heads = (dict(m.split("=", 1) for m in a.split(",") if m) for a in (args.critics, args.success_heads))
    for flag, named in (("--critics", critics), ("--success_heads", heads)):
        if set(named) - {label for label, _ in models}:
            raise SystemExit(f"error: {flag}: {sorted(set(named) - {label for label, _ in models})} name no model")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mesh = parallel.make_mesh(1)
    start = time.perf_counter()
    results = {}
    for label, path in models:
        cfg = _config(args.config, path)
        train, held_out = make_splits(cfg.data)
        task, params = load_task(cfg, train, held_out, mesh)
        if args.prompts > len(held_out):
            raise SystemExit(f"error: --prompts: {args.prompts} > the {len(held_out)} held-out questions")
        critic, head = (
            _value_model(flag, named.get(label)) for flag, named in (("--critics", critics), ("--success_heads", heads))
        )
        results[label] = measure(
            cfg, task, params, mesh, held_out[: args.prompts],
            group_size=args.group, k_ref=args.k_ref, seed=args.seed, boot=args.boot, critic=critic, success_head=head,
        )  # fmt: skip
    meta = run_meta(start, args.seed, models)
    write_results(out, results, meta, report(results, command_of("experiments.credit", parser, args), meta))
    figure(results, out / "credit.png")
    return results


if __name__ == "__main__":
    main()
