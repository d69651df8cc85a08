"""Matched wall-time comparisons of training methods, paired over seeds: what to run, and running it.

Every method trains for the same wall-time budget (`train.time_budget_s`, steps set high) once per seed, each run an
ordinary `train_and_evaluate` run in workdir/<method>/seed<k>, so an interrupted comparison resumes where it stopped
and finished runs are skipped. A seed fixes the data (`data.seed`: generation, held-out split, batch order) and the
experiment seed for every method, so runs of one seed differ only in the method: the statistics compare methods by
paired differences over seeds.

The report of a finished or partly finished workdir is `esroll.report`, which also defines the workdir's layout
(comparison.json, <method>/seed<k>) and when a run is finished, so that both modules read the workdir alike.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

from esroll.config import ExperimentConfig, from_config_dict
from esroll.metrics import read_metrics
from esroll.report import SPEC_FILE, run_dir, run_ended


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One experiment config per method name (with `train.time_budget_s` = `time_budget_s`); every method runs once
    per seed, the seed setting `seed` and `data.seed`."""

    configs: dict[str, ExperimentConfig]
    seeds: tuple[int, ...]
    time_budget_s: float
    reference: str
    warmup: bool = True

    def run_config(self, name: str, seed: int) -> ExperimentConfig:
        cfg = self.configs[name]
        return dataclasses.replace(cfg, seed=seed, data=dataclasses.replace(cfg.data, seed=seed))


def _merge(base: dict, overrides: dict) -> dict:
    out = dict(base)
    for key, value in overrides.items():
        out[key] = _merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def comparison_from_dict(d: dict) -> Comparison:
    """Build a Comparison from a configs/compare.py config (as a plain dict): the base experiment with each method's
    overrides, the budget set and steps raised to `max_steps`, so that the budget is what ends a run."""
    methods = tuple(m.strip() for m in d["methods"].split(",") if m.strip())
    unknown = [m for m in methods if m not in d["overrides"]]
    if unknown:
        known = ", ".join(d["overrides"])
        raise ValueError(f"config: method {unknown[0]!r} has no entry in 'overrides' (known: {known})")
    if d["reference"] not in methods:
        raise ValueError(f"config: reference {d['reference']!r} is not one of the methods {methods}")
    if d["time_budget_s"] <= 0 or not d["seeds"]:
        raise ValueError("config: need time_budget_s > 0 and at least one seed")
    configs = {}
    for name in methods:
        cd = _merge(d["experiment"], d["overrides"][name])
        cd["train"] = {**cd["train"], "steps": d["max_steps"], "time_budget_s": d["time_budget_s"]}
        configs[name] = from_config_dict(cd)
    seeds = tuple(int(s) for s in d["seeds"])
    return Comparison(configs, seeds, float(d["time_budget_s"]), d["reference"], bool(d["warmup"]))


def _config_json(cfg: ExperimentConfig) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def is_complete(directory: Path, cfg: ExperimentConfig) -> bool:
    """True when `directory` holds a finished run of `cfg`."""
    config_path = directory / "config.json"
    config = _config_json(cfg)
    if not config_path.is_file() or json.loads(config_path.read_text()) != config:
        return False
    return run_ended(read_metrics(directory / "metrics.jsonl"), config["train"])


def _warm_up(cfg: ExperimentConfig, mesh_devices: int) -> None:
    """Two untimed steps in a throwaway workdir, so that jit compilation (cached per process) is not charged to the
    budget of whichever run of this method comes first."""
    from esroll.train import train_and_evaluate

    train = dataclasses.replace(
        cfg.train, steps=2, time_budget_s=0.0, eval_every=10**9, checkpoint_every=10**9, export=False
    )
    with tempfile.TemporaryDirectory() as tmp:
        train_and_evaluate(dataclasses.replace(cfg, train=train), tmp, mesh_devices=mesh_devices, progress=False)


def run_comparison(
    comp: Comparison, workdir: str | Path, *, overwrite: bool = False, mesh_devices: int = 0, progress: bool = True
) -> list[tuple[str, int, str]]:
    """Run every (method, seed) not yet finished in `workdir`; returns (method, seed, "ran" | "skipped") in run order.

    Seed-major order (all methods of seed 0, then seed 1, ...), so that the runs paired in the statistics ran close
    together in time, under similar machine load. workdir/comparison.json records this invocation's methods, seeds,
    budget and reference: the report covers those.
    """
    from esroll.train import train_and_evaluate

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    spec = {
        "methods": list(comp.configs),
        "seeds": list(comp.seeds),
        "time_budget_s": comp.time_budget_s,
        "reference": comp.reference,
    }
    (workdir / SPEC_FILE).write_text(json.dumps(spec, indent=2) + "\n")
    warm: set[str] = set()
    done = []
    for seed in comp.seeds:
        for name in comp.configs:
            cfg, directory = comp.run_config(name, seed), run_dir(workdir, name, seed)
            if is_complete(directory, cfg):
                done.append((name, seed, "skipped"))
                continue
            if comp.warmup and name not in warm:
                _warm_up(cfg, mesh_devices)
                warm.add(name)
            print(f"[compare] {name} seed {seed}: training for {comp.time_budget_s:.0f} s", flush=True)
            train_and_evaluate(cfg, directory, overwrite=overwrite, mesh_devices=mesh_devices, progress=progress)
            done.append((name, seed, "ran"))
    return done
