"""Orbax checkpoints of a training run, and the guard that keeps one workdir to one config.

A checkpoint holds the parameters, the optimizer state, the method's state (step, keys) and the data position
(batches are a pure function of (seed, step), so the step is the position). Orbax finalizes a save by renaming a
temporary directory, so an interrupted save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, workdir: str | Path, keep: int = 2):
        self.dir = Path(workdir).absolute() / "checkpoints"
        self.manager = ocp.CheckpointManager(
            self.dir, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))

    def restore(self, template: Any) -> tuple[Any, dict]:
        step = self.manager.latest_step()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        out = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
        )
        return out.state, out.meta

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def guard_workdir(workdir: str | Path, config: dict, overwrite: bool) -> bool:
    """Record the run's config in workdir/config.json; refuse a workdir that holds a run of another config.

    Returns True when the workdir already holds this run (resume). With `overwrite`, a different run's
    checkpoints and logs are moved aside (workdir/replaced-N), never deleted.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "config.json"
    text = json.dumps(config, indent=2, sort_keys=True, default=str)
    if path.is_file():
        old = path.read_text()
        if old == text:
            return True
        if not overwrite:
            diff = _first_difference(json.loads(old), config)
            raise ValueError(
                f"{path}: this workdir holds a run with a different config ({diff}); "
                "use another --workdir, or pass --overwrite to move the old run aside"
            )
        aside = next(workdir / f"replaced-{i}" for i in range(1, 10_000) if not (workdir / f"replaced-{i}").exists())
        aside.mkdir()
        for child in list(workdir.iterdir()):
            if not child.name.startswith("replaced-"):
                child.rename(aside / child.name)
    path.write_text(text)
    return False


def _first_difference(a: Any, b: Any, prefix: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{prefix}{k}.")
    return f"'{prefix.rstrip('.')}' was {a!r}, now {b!r}"


def key_data(key: jax.Array) -> np.ndarray:
    return np.asarray(jax.random.key_data(key))
