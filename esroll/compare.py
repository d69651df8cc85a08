"""Matched wall-time comparisons of training methods, paired over seeds: what to run, and running it.

Every method trains for the same wall-time budget (`train.time_budget_s`, steps set high) once per seed, each run an
ordinary `train_and_evaluate` run in workdir/<method>/seed<k>, so an interrupted comparison resumes where it stopped
and finished runs are skipped. A seed sets the experiment seed (perturbation and sampling noise) and the order of the
training batches (`data.order_seed`) for every method; the data and its splits (`data.seed`) stay the experiment's,
so no seed moves a held-out question into the data the model was pretrained on. Runs of one seed differ only in the
method: the statistics compare methods by paired differences over seeds. The methods' order rotates from seed to
seed, so that drift in the machine's speed favours none.

The tuned protocol (`Tuning`) first gives every method the same number of tuning runs: its own setting and settings
drawn from its declared search space, each trained on every tuning seed (disjoint from the evaluation seeds) and
scored on the validation split (`data.validation_size`, disjoint from the test split); the setting with the best mean
validation AUC against wall time is then run on the evaluation seeds and scored on the test split. Tuning runs live in
workdir/tuning/<method>/c<k>/seed<s>, and the choice is recomputed from their metrics on every invocation
(workdir/tuning/choice.json records it).

The report of a finished or partly finished workdir is `esroll.report`, whose `esroll.report.runs` also defines the
workdir's layout (comparison.json, <method>/seed<k>) and when a run is finished, so that both read the workdir alike.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import tempfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from esroll.config import ExperimentConfig, dotted, from_config_dict, nested
from esroll.experiment import as_current, check_names
from esroll.metrics import read_metrics
from esroll.report import SPEC_FILE, area_under_curve, run_dir, run_ended
from esroll.train import train_and_evaluate

SEARCHES = ("grid", "random")
CHOICE_FILE = "choice.json"


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Equal tuning budgets: each method gets `runs` settings, its own (candidate 0) and `runs` − 1 from its
    search space, each trained for `time_budget_s` on every tuning seed and scored by validation AUC.

    `spaces`: method -> {dotted config key: values}, where values is a list (the choices; a grid's axis) or a string
    "log:LOW:HIGH" / "uniform:LOW:HIGH" (random search only). `search` grid draws `runs` − 1 distinct points of the
    grid in a seeded order; random draws each key independently. With `runs` > 1 every method needs a space: all
    are tuned alike; an empty space ({}) declares that the method has nothing of its own to tune, and it runs its own
    setting alone. `shared_draws`: methods with the same space get the same candidates (seeded by the space, not the
    method's name), so that their comparison is not one of luckier draws. `inherit`: method -> another method whose
    chosen setting it starts from (its own candidates are applied over it): variants of a baseline that share the
    baseline's tuned learning rate and tune only their own option. Inheriting methods are tuned after the others."""

    seeds: tuple[int, ...]
    runs: int
    search: str
    spaces: dict[str, dict[str, Any]]
    time_budget_s: float
    seed: int = 0
    shared_draws: bool = False
    inherit: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One experiment config per method name (with `train.time_budget_s` = `time_budget_s`); every method runs once
    per seed (`run_config`). With `tuning`, each method's config is first tuned (`run_tuning`)."""

    configs: dict[str, ExperimentConfig]
    seeds: tuple[int, ...]
    time_budget_s: float
    reference: str
    warmup: bool = True
    tuning: Tuning | None = None

    def run_config(self, name: str, seed: int, overrides: dict | None = None) -> ExperimentConfig:
        """Method `name` on `seed`: the seed sets the noise and the batch order, never the data or its splits."""
        cfg = _with(self.configs[name], overrides or {})
        split = "test" if self.tuning else cfg.data.eval_split
        data = dataclasses.replace(cfg.data, order_seed=seed, eval_split=split)
        return dataclasses.replace(cfg, seed=seed, data=data)

    def tuning_config(self, name: str, seed: int, overrides: dict) -> ExperimentConfig:
        """A tuning run: the candidate's setting on a tuning seed, for the tuning budget, scored on validation."""
        cfg = self.run_config(name, seed, overrides)
        train = dataclasses.replace(cfg.train, time_budget_s=self.tuning.time_budget_s)
        return dataclasses.replace(cfg, train=train, data=dataclasses.replace(cfg.data, eval_split="validation"))

    def order(self, index: int) -> list[str]:
        """The methods in the order seed number `index` runs them: rotated by one per seed."""
        names = list(self.configs)
        k = index % len(names)
        return names[k:] + names[:k]


def _merge(base: dict, overrides: dict) -> dict:
    out = dict(base)
    for key, value in overrides.items():
        out[key] = _merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def _with(cfg: ExperimentConfig, overrides: dict) -> ExperimentConfig:
    """`cfg` with nested `overrides`, validated as a config file's values are."""
    if not overrides:
        return cfg
    return check_names(from_config_dict(_merge(_config_json(cfg), overrides)))


def _draw(values: Any, rng: np.random.Generator, where: str) -> Any:
    if isinstance(values, (list, tuple)):
        return values[int(rng.integers(len(values)))]
    kind, low, high = _range(values, where)
    if kind == "log":
        return float(math.exp(rng.uniform(math.log(low), math.log(high))))
    return float(rng.uniform(low, high))


def _range(values: Any, where: str) -> tuple[str, float, float]:
    parts = values.split(":") if isinstance(values, str) else []
    try:
        kind, low, high = parts[0], float(parts[1]), float(parts[2])
    except (IndexError, ValueError):
        kind, low, high = "", 0.0, 0.0
    if len(parts) != 3 or kind not in ("log", "uniform") or not low < high or (kind == "log" and low <= 0):
        raise ValueError(
            f"config: tuning.space.{where} must be a list of values or 'log:LOW:HIGH' / 'uniform:LOW:HIGH' with "
            f"LOW < HIGH (and LOW > 0 for log), got {values!r}"
        )
    return kind, low, high


def candidates(tuning: Tuning, method: str) -> list[dict]:
    """The settings `method` is tuned over, as nested overrides: [{}] (its own setting) and `runs` − 1 more (none
    with an empty space), the same on every call (seeded by the tuning seed and the method's name, or with
    `shared_draws` its space)."""
    space = dotted(tuning.spaces.get(method, {}))
    if not space:
        return [{}]
    key = json.dumps(space, sort_keys=True) if tuning.shared_draws else method
    rng = np.random.default_rng([tuning.seed, zlib.crc32(key.encode())])
    if tuning.search == "grid":
        for key, values in space.items():
            if not isinstance(values, (list, tuple)):
                raise ValueError(f"config: tuning.space.{method}.{key} must be a list of values for a grid search")
        grid = [dict(zip(space, point)) for point in itertools.product(*space.values())]
        if len(grid) < tuning.runs - 1:
            raise ValueError(
                f"config: tuning.space.{method} has {len(grid)} grid points, fewer than tuning.runs - 1 = "
                f"{tuning.runs - 1}: every method gets the same number of tuning runs"
            )
        points = [grid[i] for i in rng.permutation(len(grid))[: tuning.runs - 1]]
    else:
        points = [{key: _draw(v, rng, f"{method}.{key}") for key, v in space.items()} for _ in range(tuning.runs - 1)]
    return [{}] + [nested(p) for p in points]


def _tuning_from_dict(d: dict, methods: tuple[str, ...], eval_seeds: tuple[int, ...], budget: float) -> Tuning | None:
    seeds = tuple(int(s) for s in d.get("seeds", ()))
    if not seeds:
        return None
    overlap = sorted(set(seeds) & set(eval_seeds))
    if overlap:
        raise ValueError(f"config: tuning.seeds and seeds share {overlap}: tuning never runs on an evaluation seed")
    if d["search"] not in SEARCHES:
        raise ValueError(f"config: tuning.search must be one of {', '.join(SEARCHES)}, got {d['search']!r}")
    if d["runs"] < 1:
        raise ValueError("config: tuning.runs must be >= 1")
    spaces = dict(d.get("space") or {})
    untuned = [m for m in methods if m not in spaces and d["runs"] > 1]
    if untuned:
        raise ValueError(f"config: tuning.space has no entry for method {untuned[0]!r}: every method is tuned alike")
    inherit = dict(d.get("inherit") or {})
    for method, source in inherit.items():
        if method not in methods or source not in methods or source in inherit:
            raise ValueError(
                f"config: tuning.inherit.{method} = {source!r}: both must be methods of the comparison, and the "
                "source must not inherit itself"
            )
    tuning = Tuning(
        seeds,
        int(d["runs"]),
        d["search"],
        spaces,
        float(d["time_budget_s"] or budget),
        int(d["seed"]),
        bool(d.get("shared_draws", False)),
        inherit,
    )
    for m in methods:
        candidates(tuning, m)  # refuses a malformed space now, not after hours of runs
    return tuning


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
        configs[name] = check_names(from_config_dict(cd))
    seeds = tuple(int(s) for s in d["seeds"])
    tuning = _tuning_from_dict(d.get("tuning") or {}, methods, seeds, float(d["time_budget_s"]))
    if tuning and any(c.data.validation_size == 0 for c in configs.values()):
        raise ValueError("config: tuning needs a validation split: set experiment.data.validation_size > 0")
    return Comparison(configs, seeds, float(d["time_budget_s"]), d["reference"], bool(d["warmup"]), tuning)


def _config_json(cfg: ExperimentConfig) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def is_complete(directory: Path, cfg: ExperimentConfig) -> bool:
    """True when `directory` holds a finished run of `cfg`."""
    config_path = directory / "config.json"
    config = _config_json(cfg)
    if not config_path.is_file() or as_current(json.loads(config_path.read_text())) != config:
        return False
    return run_ended(read_metrics(directory / "metrics.jsonl"), config["train"])


def _warm_up(cfg: ExperimentConfig, mesh_devices: int) -> None:
    """Two untimed steps in a throwaway workdir, so that jit compilation (cached per process) is not charged to the
    budget of whichever run of this setting comes first."""
    train = dataclasses.replace(
        cfg.train, steps=2, time_budget_s=0.0, eval_every=10**9, checkpoint_every=10**9, export=False
    )
    with tempfile.TemporaryDirectory() as tmp:
        train_and_evaluate(dataclasses.replace(cfg, train=train), tmp, mesh_devices=mesh_devices, progress=False)


def tuning_dir(workdir: str | Path, method: str, candidate: int, seed: int) -> Path:
    return Path(workdir) / "tuning" / method / f"c{candidate}" / f"seed{seed}"


def validation_auc(directory: Path, budget: float) -> float | None:
    """The run's AUC of validation accuracy against training wall time over `budget`, or None unless it finished."""
    records = read_metrics(directory / "metrics.jsonl")
    config_path = directory / "config.json"
    if not config_path.is_file() or not run_ended(records, json.loads(config_path.read_text())["train"]):
        return None
    evals = [r for r in records if "eval_accuracy" in r]
    return area_under_curve([r["wall_time"] for r in evals], [r["eval_accuracy"] for r in evals], budget)


def tuned_candidates(comp: Comparison, name: str, chosen: dict[str, dict]) -> list[dict]:
    """`name`'s candidates as run: over the chosen setting of the method it inherits from (`Tuning.inherit`)."""
    source = comp.tuning.inherit.get(name)
    base = chosen[source]["overrides"] if source else {}
    return [_merge(base, c) for c in candidates(comp.tuning, name)]


def choose(comp: Comparison, workdir: str | Path, names: list[str] | None = None) -> dict[str, dict]:
    """Each method's chosen setting from the tuning runs on disk: the candidate with the highest mean validation AUC
    over the tuning seeds (the lowest index on a tie); the methods that inherit after those they inherit from.
    Raises if a tuning run has not finished. `names`: only these (and what they inherit from)."""
    out: dict[str, dict] = {}
    inherit = comp.tuning.inherit
    wanted = list(comp.configs) if names is None else names
    needed = [n for n in comp.configs if n in wanted or n in {inherit.get(w) for w in wanted}]
    for name in sorted(needed, key=lambda n: n in inherit):
        scored = []
        for k, overrides in enumerate(tuned_candidates(comp, name, out)):
            aucs = [
                validation_auc(tuning_dir(workdir, name, k, s), comp.tuning.time_budget_s) for s in comp.tuning.seeds
            ]
            if any(a is None for a in aucs):
                raise RuntimeError(f"tuning run {name} c{k} has not finished in {workdir}/tuning")
            scored.append(
                {"candidate": k, "overrides": overrides, "validation_auc": aucs, "mean": float(np.mean(aucs))}
            )
        best = max(scored, key=lambda c: (c["mean"], -c["candidate"]))
        out[name] = {"chosen": best["candidate"], "overrides": best["overrides"], "candidates": scored}
    return out


def _run(cfg, directory, warm, mesh_devices, overwrite, progress, label) -> str:
    if is_complete(directory, cfg):
        return "skipped"
    key = json.dumps(_config_json(dataclasses.replace(cfg, seed=0, data=dataclasses.replace(cfg.data, order_seed=0))))
    if warm is not None and key not in warm:  # one warm-up per distinct setting: each compiles its own programs
        _warm_up(cfg, mesh_devices)
        warm.add(key)
    print(f"[compare] {label}: training for {cfg.train.time_budget_s:.0f} s", flush=True)
    train_and_evaluate(cfg, directory, overwrite=overwrite, mesh_devices=mesh_devices, progress=progress)
    return "ran"


def run_comparison(
    comp: Comparison, workdir: str | Path, *, overwrite: bool = False, mesh_devices: int = 0, progress: bool = True
) -> list[tuple[str, int, str]]:
    """Run every (method, seed) not yet finished in `workdir` (after the tuning runs, with `comp.tuning`); returns
    (method, seed, "ran" | "skipped") of the evaluation runs in run order.

    Seed-major order (all methods of seed 0, then seed 1, ...), so that the runs paired in the statistics ran close
    together in time, under similar machine load, the methods rotated from seed to seed (`Comparison.order`).
    workdir/comparison.json records this invocation's methods, seeds, budget, reference and tuning protocol: the
    report covers those.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    spec = {
        "methods": list(comp.configs),
        "seeds": list(comp.seeds),
        "time_budget_s": comp.time_budget_s,
        "reference": comp.reference,
    }
    if comp.tuning:
        spec["tuning"] = dataclasses.asdict(comp.tuning)
    (workdir / SPEC_FILE).write_text(json.dumps(spec, indent=2) + "\n")
    warm: set[str] | None = set() if comp.warmup else None  # None: no warm-up runs (comparisons in seconds, tests)
    chosen = {name: {} for name in comp.configs}
    if comp.tuning:
        inherit = comp.tuning.inherit
        for phase in (False, True):  # first the methods that inherit nothing, then those that do, from their choice
            names = [n for n in comp.configs if (n in inherit) == phase]
            chosen_before = choose(comp, workdir, sorted(set(inherit.values()))) if phase and names else {}
            for i, seed in enumerate(comp.tuning.seeds):
                for name in [n for n in comp.order(i) if n in names]:
                    for k, overrides in enumerate(tuned_candidates(comp, name, chosen_before)):
                        cfg = comp.tuning_config(name, seed, overrides)
                        label = f"tuning {name} c{k} seed {seed}"
                        _run(cfg, tuning_dir(workdir, name, k, seed), warm, mesh_devices, overwrite, progress, label)
        choice = choose(comp, workdir)
        (workdir / "tuning" / CHOICE_FILE).write_text(json.dumps(choice, indent=2) + "\n")
        chosen = {name: c["overrides"] for name, c in choice.items()}
    done = []
    for i, seed in enumerate(comp.seeds):
        for name in comp.order(i):
            cfg = comp.run_config(name, seed, chosen[name])
            status = _run(
                cfg, run_dir(workdir, name, seed), warm, mesh_devices, overwrite, progress, f"{name} seed {seed}"
            )
            done.append((name, seed, status))
    return done
