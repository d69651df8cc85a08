"""What the estimator diagnostics cost: training wall time of the default experiment (configs/default.py, LOO-ROLL)
with `train.diagnostics_every` 0 against 10, and against 10 with the policy-gradient cosine (`train.diagnostics_pg`).

The settings run in interleaved rounds in one process, after a 2-step warm-up of each (so that no timed run pays a
compilation the others do not); the figure of a round is each setting's training wall time (evaluation excluded) over
the round's run without diagnostics. `--quick`: the test-suite variant of the config, 4 steps with diagnostics every 2, 1 round.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile

from configs.default import get_config
from esroll.config import from_config_dict
from esroll.train import train_and_evaluate

SETTINGS = {"off": (0, False), "every_10": (10, False), "every_10_pg": (10, True)}


def _config(quick: bool, every: int, pg: bool, steps: int | None = None):
    cd = get_config("quick" if quick else None)
    cfg = from_config_dict(cd.to_dict())
    train = dict(diagnostics_every=every, diagnostics_pg=pg, export=False)
    if steps is not None:
        train.update(steps=steps, eval_every=steps, checkpoint_every=steps)
    elif quick:  # 4 steps, diagnostics on two of them
        train.update(steps=4, eval_every=4, checkpoint_every=4, diagnostics_every=min(every, 2))
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train)).validate()


def diagnostics_overhead(args) -> dict:
    rounds = 1 if args.quick else 3
    out: dict = {}
    with tempfile.TemporaryDirectory() as root:
        for name, (every, pg) in SETTINGS.items():  # compile every program each setting runs
            train_and_evaluate(_config(args.quick, min(every, 1), pg, steps=2), f"{root}/warm_{name}", progress=False)
        ratios: dict[str, list[float]] = {name: [] for name in SETTINGS if name != "off"}
        for r in range(rounds):
            seconds = {}
            for name, (every, pg) in SETTINGS.items():
                summary = train_and_evaluate(_config(args.quick, every, pg), f"{root}/{name}_{r}", progress=False)
                seconds[name] = summary["wall_time"]
                out[f"round{r}_{name}_s"] = seconds[name]
            for name in ratios:
                ratios[name].append(seconds[name] / seconds["off"])
    for name, values in ratios.items():
        out[f"{name}_over_off_median"] = statistics.median(values)
        out[f"{name}_over_off_max"] = max(values)
        out[f"{name}_over_off_min"] = min(values)
    out["diagnostics_overhead"] = out["every_10_over_off_median"] - 1.0
    return out


BENCHMARKS = {"diagnostics_overhead": diagnostics_overhead}
