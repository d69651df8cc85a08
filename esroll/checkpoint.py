"""Orbax checkpoints of a training run, and the guard that keeps one workdir to one config.

A checkpoint holds the parameters, the optimizer state, the method's state (step, keys) and the data position
(batches are a pure function of (seed, step), so the step is the position). Orbax finalizes a save by renaming a
temporary directory, so an interrupted save leaves the previous checkpoint intact.

A workdir is a local folder or a URL that `etils.epath` knows (gs://bucket/run, s3://...): every path under it is
an `epath.Path` (`workdir_path`), which orbax takes as it is. orbax and jax are imported where they are used, so
that `esroll.metrics` (and the report, which reads metrics only) can use these path helpers without loading them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from etils import epath

from esroll.config import dotted
from esroll.errors import InputError


def workdir_path(workdir: str | os.PathLike) -> epath.Path:
    """`workdir` as an `epath.Path`: a URL (gs://bucket/run) unchanged, a local path made absolute."""
    s = os.fspath(workdir)
    if "://" not in s:
        return epath.Path(os.path.abspath(s))
    try:
        return epath.Path(s)
    except KeyError:
        raise InputError(f"{s}: unsupported URL scheme (use a local path, gs://, s3://, az:// or hf://)") from None


def is_local(path: epath.Path) -> bool:
    """Whether `path` is on the local filesystem (not a URL)."""
    return "://" not in str(path)


def write_atomically(path: epath.Path, text: str) -> None:
    """Replace `path`'s content by `text` in one step: written to a temporary name (the suffix replaced by .tmp),
    then renamed over it."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


class Checkpointer:
    def __init__(self, workdir: str | os.PathLike, keep: int = 2):
        import orbax.checkpoint as ocp

        self.dir = workdir_path(workdir) / "checkpoints"
        self.manager = ocp.CheckpointManager(
            self.dir, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        )

    @staticmethod
    def latest_in(workdir: str | os.PathLike) -> int | None:
        """The step of the newest finished checkpoint in `workdir`, without creating anything."""
        import orbax.checkpoint as ocp

        directory = workdir_path(workdir) / "checkpoints"
        if not directory.is_dir():
            return None
        manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=False))
        try:
            return manager.latest_step()
        finally:
            manager.close()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict) -> None:
        import orbax.checkpoint as ocp

        self.manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        )

    def restore(self, template: Any) -> tuple[Any, dict]:
        import jax
        import orbax.checkpoint as ocp

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


# The keys a rerun may raise to continue a run from its last checkpoint: they bound the run's length and nothing else
# (every schedule has a horizon of its own), so the continued run takes the same steps as one given the larger value
# from the start.
EXTENDABLE = ("train.steps", "train.time_budget_s")


def check_workdir(
    workdir: str | os.PathLike, config: dict, overwrite: bool, current: Callable[[dict], dict] = lambda d: d
) -> bool:
    """Whether `workdir` already holds this run (True: resume); writes nothing. `current` maps the saved config to
    what the current code reads from it (`esroll.experiment.as_current`: the options of implementations registered
    since filled in at their defaults), so that a run saved before them is still this run.

    A run whose config differs from `config` only by a raised `EXTENDABLE` key is this run, extended
    (`extension`). A workdir holding a run of another config is refused (an InputError naming the first differing
    key) unless `overwrite`, or unless that run never completed a step (`never_stepped`: it failed or was stopped
    before its first step, so a corrected rerun may take the workdir), in which case `claim_workdir` will move that
    run aside.
    """
    old = saved_config(workdir)
    if old is None:
        return False
    old = current(old)
    if old == json.loads(_dumps(config)) or extension(old, config):
        return True
    if overwrite or never_stepped(workdir):
        return False
    raise InputError(
        f"{workdir_path(workdir) / 'config.json'}: this workdir holds a run with a different config "
        f"({_first_difference(old, config)}); only raising train.steps or train.time_budget_s continues a run: use "
        "another --workdir, or pass --overwrite to move the old run to WORKDIR/replaced-N"
    )


def never_stepped(workdir: str | os.PathLike) -> bool:
    """Whether the run in `workdir` never completed a training step: no checkpoint, and every line of its
    metrics.jsonl a record of step 0 (the evaluation before training). A line that is not such a record (even a
    partial one) keeps the workdir a run."""
    workdir = workdir_path(workdir)
    path = workdir / "metrics.jsonl"
    for line in (path.read_text() if path.is_file() else "").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            return False
        if not isinstance(record, dict) or record.get("step") != 0:
            return False
    return Checkpointer.latest_in(workdir) is None


def extension(old: dict, new: dict) -> dict[str, tuple[Any, Any]]:
    """{key: (old value, new value)} when config `new` is config `old` with some `EXTENDABLE` keys raised and nothing
    else changed (a time budget of 0 is unbounded: raising means a larger budget or 0); else {}."""
    old, new = dotted(old), dotted(json.loads(_dumps(new)))
    changed = {k: (old.get(k), new.get(k)) for k in old.keys() | new.keys() if old.get(k) != new.get(k)}
    if not changed or any(k not in EXTENDABLE for k in changed):
        return {}

    def raised(key: str, a, b) -> bool:
        if key == "train.time_budget_s":
            return a > 0 and (b == 0 or b > a)
        return b > a

    return changed if all(raised(k, a, b) for k, (a, b) in changed.items()) else {}


def saved_config(workdir: str | os.PathLike) -> dict | None:
    """The config.json of the run in `workdir` as written (None: there is none); `check_workdir`'s `current` reads it
    as the current code does."""
    path = workdir_path(workdir) / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not valid JSON ({e.msg}); move the file aside or use another --workdir") from None


def claim_workdir(
    workdir: str | os.PathLike, config: dict, current: Callable[[dict], dict] = lambda d: d
) -> epath.Path | None:
    """Record the run's config in workdir/config.json, once the run is known to start. A run of another config found
    there (allowed by `check_workdir`: with overwrite, or a run that never completed a step) is moved to
    workdir/replaced-N with its checkpoints and logs, never deleted, and that folder returned; the config of a run
    being extended (`extension`) is kept as workdir/config.before-extension-N.json; a workdir without a config.json
    is written into as it is. `current`: as for `check_workdir`."""
    workdir = workdir_path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "config.json"
    text = _dumps(config)
    old = saved_config(workdir)
    old = None if old is None else current(old)
    if old == json.loads(text):
        return None
    if old is not None and extension(old, config):
        kept = next(
            workdir / f"config.before-extension-{i}.json"
            for i in range(1, 10_000)
            if not (workdir / f"config.before-extension-{i}.json").exists()
        )
        write_atomically(kept, _dumps(old))
    elif old is not None:
        aside = next(workdir / f"replaced-{i}" for i in range(1, 10_000) if not (workdir / f"replaced-{i}").exists())
        aside.mkdir()
        for child in list(workdir.iterdir()):
            if not child.name.startswith("replaced-"):
                child.rename(aside / child.name)
        write_atomically(path, text)
        return aside
    write_atomically(path, text)
    return None


def _dumps(config: dict) -> str:
    return json.dumps(config, indent=2, sort_keys=True, default=str)


def _first_difference(a: Any, b: Any, prefix: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{prefix}{k}.")
    return f"'{prefix.rstrip('.')}' was {a!r}, now {b!r}"
