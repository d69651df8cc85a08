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
from typing import Any

from etils import epath

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


def check_workdir(workdir: str | os.PathLike, config: dict, overwrite: bool) -> bool:
    """Whether `workdir` already holds this run (True: resume); writes nothing.

    A workdir holding a run of another config is refused (an InputError naming the first differing key) unless
    `overwrite`, in which case `claim_workdir` will move that run aside.
    """
    path = workdir_path(workdir) / "config.json"
    if not path.is_file():
        return False
    try:
        old = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not valid JSON ({e.msg}); move the file aside or use another --workdir") from None
    if old == json.loads(_dumps(config)):
        return True
    if overwrite:
        return False
    raise InputError(
        f"{path}: this workdir holds a run with a different config ({_first_difference(old, config)}); "
        "use another --workdir, or pass --overwrite to move the old run aside"
    )


def claim_workdir(workdir: str | os.PathLike, config: dict) -> None:
    """Record the run's config in workdir/config.json, once the run is known to start. A run of another config found
    there (allowed by `check_workdir` with overwrite) is moved to workdir/replaced-N with its checkpoints and logs,
    never deleted; a workdir without a config.json is written into as it is."""
    workdir = workdir_path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "config.json"
    text = _dumps(config)
    if path.is_file() and json.loads(path.read_text()) == json.loads(text):
        return
    if path.is_file():
        aside = next(workdir / f"replaced-{i}" for i in range(1, 10_000) if not (workdir / f"replaced-{i}").exists())
        aside.mkdir()
        for child in list(workdir.iterdir()):
            if not child.name.startswith("replaced-"):
                child.rename(aside / child.name)
    write_atomically(path, text)


def _dumps(config: dict) -> str:
    return json.dumps(config, indent=2, sort_keys=True, default=str)


def _first_difference(a: Any, b: Any, prefix: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{prefix}{k}.")
    return f"'{prefix.rstrip('.')}' was {a!r}, now {b!r}"
