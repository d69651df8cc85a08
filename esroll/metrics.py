"""Per-step metrics: metrics.jsonl (one JSON object per step), TensorBoard event files, and the final PNG.

Paths are `etils.epath` paths (`esroll.checkpoint.workdir_path`), so a workdir may be a URL such as gs://bucket/run.
"""

from __future__ import annotations

import io
import json
import os
import time

from etils import epath

from esroll.checkpoint import is_local, workdir_path, write_atomically
from esroll.errors import InputError


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics.jsonl file, in order ([] if there is none).

    A run killed while appending can leave a partial last line; it is skipped (the step it described is written
    again when the run resumes).
    """
    path = workdir_path(path)
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise InputError(f"{path}:{i + 1}: not a JSON object") from None
    return records


class _JsonLines:
    """An append-only JSON-lines file whose records carry a "step": on (re)start, those after `keep_through` (None:
    all) are dropped. In a remote workdir (a URL: object stores have no append), each write uploads the file whole."""

    def __init__(self, path: epath.Path, keep_through: int | None, create: bool = True):
        self.path = path
        self.kept = [r for r in read_metrics(path) if keep_through is not None and r["step"] <= keep_through]
        self._lines = [json.dumps(r) + "\n" for r in self.kept]
        if create or path.exists():  # else made by the first write
            write_atomically(path, "".join(self._lines))

    def write(self, records: list[dict]) -> None:
        lines = [json.dumps(r) + "\n" for r in records]
        if is_local(self.path):
            with self.path.open("a") as f:
                f.write("".join(lines))
        else:
            self._lines += lines
            self.path.write_text("".join(self._lines))  # one upload: all or nothing


class MetricsWriter:
    """Appends to workdir/metrics.jsonl, workdir/samples.jsonl and workdir/tb, so that all three describe exactly one
    uninterrupted history.

    On (re)start, records after `keep_through` (the restored checkpoint's step; None: no checkpoint, nothing kept)
    are dropped from both files, and tb/ is rewritten from the records kept (a new event file, then the old ones
    removed): a step logged by a run killed before its checkpoint appears once, when it is run again.
    """

    def __init__(self, workdir: str | os.PathLike, *, keep_through: int | None, enabled: bool = True):
        workdir = workdir_path(workdir)
        self.path = workdir / "metrics.jsonl"
        self.enabled = enabled
        self._tb = None
        if not enabled:
            return
        from tensorboardX import SummaryWriter

        self._metrics = _JsonLines(self.path, keep_through)
        self._samples = _JsonLines(workdir / "samples.jsonl", keep_through, create=False)
        tb = workdir / "tb"
        old = list(tb.glob("events.out.tfevents.*")) if tb.is_dir() else []
        self._tb = SummaryWriter(_tb_logdir(tb), filename_suffix=f".{os.getpid()}.{time.time_ns()}")
        for record in self._metrics.kept:
            self._add_scalars(record)
        self._add_samples(self._samples.kept)
        self._tb.flush()
        for f in old:
            f.unlink()

    def records(self) -> list[dict]:
        return read_metrics(self.path)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self._metrics.write([record])
        self._add_scalars(record)

    def write_samples(self, step: int, samples: list[dict]) -> None:
        """One evaluation's readable samples (`esroll.samples.readable`), a line each, under its step."""
        if not self.enabled or not samples:
            return
        records = [{"step": step, **s} for s in samples]
        self._samples.write(records)
        self._add_samples(records)

    def _add_scalars(self, record: dict) -> None:
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)):
                self._tb.add_scalar(k, v, record["step"])

    def _add_samples(self, records: list[dict]) -> None:
        from esroll.samples import as_text

        by_step: dict[int, list[str]] = {}
        for r in records:
            by_step.setdefault(r["step"], []).append(as_text(r))
        for step, texts in by_step.items():  # TensorBoard's text tab renders markdown: each sample as a code block
            self._tb.add_text("samples", "\n\n".join(f"```\n{t}\n```" for t in texts), step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


class _EpathEventFile:
    """A TensorBoard event file at a URL, written through epath: kept in memory and uploaded whole at every flush
    (as tensorboardX's own gs:// writer does)."""

    def __init__(self, path: str):
        self.path = epath.Path(path)
        self.buffer = io.BytesIO()

    def write(self, data: bytes) -> None:
        self.buffer.write(data)

    def flush(self) -> None:
        self.path.write_bytes(self.buffer.getvalue())

    def close(self) -> None:
        self.flush()


class _EpathEventFiles:
    """A tensorboardX writer factory (`record_writer.register_writer_factory`) for URLs epath can write."""

    def open(self, path: str) -> _EpathEventFile:
        return _EpathEventFile(path)

    def directory_check(self, path: str) -> None:
        epath.Path(path).mkdir(parents=True, exist_ok=True)


def _tb_logdir(tb: epath.Path) -> str:
    """The logdir string tensorboardX is given for `tb`. A URL whose scheme tensorboardX cannot write itself (gs://
    without google-cloud-storage, s3:// without boto3, any other scheme) has its event files written through epath
    (which needs gcsfs, s3fs, ... or TensorFlow for that scheme, as orbax's checkpoints in that workdir do)."""
    logdir = str(tb)
    if is_local(tb):
        return logdir
    from tensorboardX import record_writer

    scheme = logdir.split("://", 1)[0]
    native = {"gs": record_writer.GCS_ENABLED, "s3": record_writer.S3_ENABLED}.get(scheme, False)
    if not (native and scheme in record_writer.REGISTERED_FACTORIES):
        record_writer.register_writer_factory(scheme, _EpathEventFiles())
    return logdir


def first_eval(records: list[dict]) -> float | None:
    evals = [r for r in records if "eval_accuracy" in r]
    return evals[0]["eval_accuracy"] if evals else None


def last_eval(records: list[dict]) -> dict | None:
    evals = [r for r in records if "eval_accuracy" in r]
    return evals[-1] if evals else None


def wilson_interval(p, n: int, z: float = 1.96):
    """The Wilson score interval (95% at z 1.96) of a share `p` (a float or an array) of `n` held-out rows scored 0
    or 1: what an evaluation's accuracy could be from its sample alone."""
    import numpy as np

    p = np.asarray(p, np.float64)
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def plot_eval_curve(metrics_path: str | os.PathLike, out: str | os.PathLike, title: str = "", n: int = 0) -> None:
    """Held-out accuracy against training wall time, as a PNG at `out` (a local path or a URL); with `n`, the
    held-out rows, each point's 95% Wilson interval as a band, so a move smaller than the evaluation's own noise
    shows as one."""
    # A bare Figure, not pyplot: the process's backend (a notebook's inline one) is left as it is.
    from matplotlib.figure import Figure

    evals = [r for r in read_metrics(metrics_path) if "eval_accuracy" in r]
    fig = Figure(figsize=(5, 3.5), dpi=120)
    ax = fig.subplots()
    x, y = [r["wall_time"] for r in evals], [r["eval_accuracy"] for r in evals]
    ax.plot(x, y, marker="o")
    if n:
        low, high = wilson_interval(y, n)
        ax.fill_between(x, low, high, alpha=0.2, label=f"95% interval ({n} held-out rows)")
        ax.legend(fontsize="small")
    ax.set_xlabel("training wall time (s)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = workdir_path(out)
    if is_local(out):
        fig.savefig(os.fspath(out))
    else:  # rendered in memory, then uploaded
        buf = io.BytesIO()
        fig.savefig(buf, format=out.suffix.lstrip(".") or "png")
        out.write_bytes(buf.getvalue())
