"""A comparison's workdir (written by `esroll.compare.run_comparison`) and what each of its runs measured.

The layout: comparison.json (`SPEC_FILE`: methods, seeds, budget, reference) at the top, one directory per method and
seed (`run_dir`) holding the run's config.json and metrics.jsonl. A run is finished when its records end as
`train_and_evaluate` ends a run (`run_ended`); `esroll.compare` reads the layout and that rule from here.

`load_run` and `load_comparison` read the runs that have an evaluation, finished or not, into `RunResult`s: held-out
accuracy at each evaluation with the training wall time, completions, tokens and training FLOPs (rollout + update, as
counted by `esroll.ledger`) spent before it. Each run is seen four ways (`VIEWS`): accuracy against each of those
(`view_x`). Runs logged before a counter existed ("tokens", "flops" in metrics.jsonl) have NaN there.

Reads files only; imports neither JAX nor `esroll.compare` (which imports the training configs).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

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
    completions: np.ndarray  # sequences generated for training before each evaluation (cumulative)
    tokens: np.ndarray  # tokens generated for training before each evaluation (cumulative; NaN: not logged)
    flops: np.ndarray  # training FLOPs (rollout + update) before each evaluation (cumulative; NaN: not logged)
    steps: int
    wall_time: float
    evaluations_per_step: int  # ES: population members; GRPO: sampled completions
    completions_per_step: int  # sequences generated per step
    complete: bool
    probe_s: float = math.nan  # the evaluation before training: greedy decoding of the held-out set (NaN: not timed)
    # Mean over steps of the fraction of groups whose rewards are all equal (GRPO: a prompt's completions; ES: a
    # prompt's rows over the members), and of those the fraction that still carry a learning signal (steps with any).
    all_equal_groups: float = math.nan
    all_equal_signal: float = math.nan

    @property
    def final_accuracy(self) -> float:
        return float(self.accuracies[-1])

    @property
    def has_tokens(self) -> bool:
        """Whether its metrics counted tokens (runs logged before the counters existed did not)."""
        return bool(np.isfinite(self.tokens).all())

    @property
    def has_flops(self) -> bool:
        """Whether its metrics counted training FLOPs throughout (runs logged before the counter existed did not)."""
        return bool(np.isfinite(self.flops).all())


def evaluation_counts(cfg: dict) -> tuple[int, int]:
    """(evaluations, completions) per step of a run config (as in its config.json). An ES member's evaluation is
    its mean reward on the step's shared prompts; a GRPO evaluation is one sampled completion."""
    prompts = cfg["train"]["prompts_per_step"]
    if cfg["method"] == "grpo":
        completions = prompts * cfg["grpo"]["group_size"]
        return completions, completions
    return cfg["es"]["population"], cfg["es"]["population"] * prompts * cfg["es"].get("samples", 1)


_COUNTERS = ("completions", "tokens", "flops")  # the cumulative counters of a step record, as train.py logs them


def generated_counts(records: list[dict], completions_per_step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(completions, tokens, flops) generated for training before each evaluation record in `records`; flops: the
    training FLOPs, rollout + update.

    Step records carry the cumulative counters "completions", "tokens" and "flops"; an evaluation record without
    them (the one before training, or a final evaluation written apart from its step's record) has the counts of the
    latest record before it (0 before any). A counter is read only when every record that carries a counter carries
    it: a run logged before "flops" existed (or resumed from a checkpoint that predates it, whose later records count
    FLOPs from 0) has NaN FLOPs. A run whose records hold no counter at all (logged before they existed) falls back to
    step × `completions_per_step` completions and NaN tokens and FLOPs.
    """
    counting = [r for r in records if any(key in r for key in _COUNTERS)]
    counted = {key: bool(counting) and all(key in r for r in counting) for key in _COUNTERS}
    current = dict.fromkeys(_COUNTERS, 0.0)
    out: dict[str, list[float]] = {key: [] for key in _COUNTERS}
    for r in records:
        for key in current:
            current[key] = float(r.get(key, current[key]))
        if "eval_accuracy" not in r:
            continue
        fallback = {"completions": float(r["step"] * completions_per_step), "tokens": math.nan, "flops": math.nan}
        for key in current:
            out[key].append(current[key] if counted[key] else fallback[key])
    return tuple(np.array(out[key], float) for key in _COUNTERS)


def load_run(directory: Path, method: str, seed: int) -> RunResult | None:
    """The run in `directory`, or None when it has no evaluation yet."""
    records = read_metrics(directory / "metrics.jsonl")
    evals = [r for r in records if "eval_accuracy" in r]
    if not evals:
        return None
    cfg = json.loads((directory / "config.json").read_text())
    per_eval, per_completion = evaluation_counts(cfg)
    completions, tokens, flops = generated_counts(records, per_completion)
    equal = [r["frac_groups_all_equal"] for r in records if "frac_groups_all_equal" in r]
    signal = [r["frac_all_equal_signal"] for r in records if "frac_all_equal_signal" in r]
    return RunResult(
        method=method,
        seed=seed,
        times=np.array([r["wall_time"] for r in evals], float),
        accuracies=np.array([r["eval_accuracy"] for r in evals], float),
        completions=completions,
        tokens=tokens,
        flops=flops,
        steps=int(records[-1]["step"]),
        wall_time=float(records[-1]["wall_time"]),
        evaluations_per_step=per_eval,
        completions_per_step=per_completion,
        complete=run_ended(records, cfg["train"]),
        probe_s=float(evals[0].get("eval_s", math.nan)) if evals[0]["step"] == 0 else math.nan,
        all_equal_groups=float(np.mean(equal)) if equal else math.nan,
        all_equal_signal=float(np.mean(signal)) if signal else math.nan,
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


# ---- views: what accuracy is plotted against

VIEWS = ("time", "completions", "tokens", "flops")
VIEW_LABELS = {
    "time": "training wall time (s)",
    "completions": "completions generated for training",
    "tokens": "tokens generated for training",
    "flops": "training FLOPs (rollout + update)",
}


def view_x(run: RunResult, view: str) -> np.ndarray:
    """The run's x at each evaluation in `view`: training wall time, completions or tokens generated so far, or the
    training FLOPs (rollout + update) spent so far."""
    if view not in VIEWS:
        raise ValueError(f"unknown view {view!r}; expected one of {VIEWS}")
    return {"time": run.times, "completions": run.completions, "tokens": run.tokens, "flops": run.flops}[view]
