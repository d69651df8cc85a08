"""Per-step metrics: metrics.jsonl (one JSON object per step), TensorBoard event files, and the final PNG."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from esroll.errors import InputError


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl file, in order ([] if there is none).

    A run killed while appending can leave a partial last line; it is skipped (the step it described is written
    again when the run resumes).
    """
    path = Path(path)
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


class MetricsWriter:
    """Appends to workdir/metrics.jsonl and workdir/tb, so that both describe exactly one uninterrupted history.

    On (re)start, records after `keep_through` (the restored checkpoint's step; None: no checkpoint, nothing kept)
    are dropped from metrics.jsonl, and tb/ is rewritten from the records kept (a new event file, then the old ones
    removed): a step logged by a run killed before its checkpoint appears once, when it is run again.
    """

    def __init__(self, workdir: str | Path, *, keep_through: int | None, enabled: bool = True):
        self.path = Path(workdir) / "metrics.jsonl"
        self.enabled = enabled
        self._tb = None
        if not enabled:
            return
        from tensorboardX import SummaryWriter

        kept = [r for r in read_metrics(self.path) if keep_through is not None and r["step"] <= keep_through]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(self.path)
        tb = Path(workdir) / "tb"
        old = list(tb.glob("events.out.tfevents.*"))
        self._tb = SummaryWriter(str(tb), filename_suffix=f".{os.getpid()}.{time.time_ns()}")
        for record in kept:
            self._add_scalars(record)
        self._tb.flush()
        for f in old:
            f.unlink()

    def records(self) -> list[dict]:
        return read_metrics(self.path)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self._add_scalars(record)

    def _add_scalars(self, record: dict) -> None:
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)):
                self._tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def first_eval(records: list[dict]) -> float | None:
    evals = [r for r in records if "eval_accuracy" in r]
    return evals[0]["eval_accuracy"] if evals else None


def last_eval(records: list[dict]) -> dict | None:
    evals = [r for r in records if "eval_accuracy" in r]
    return evals[-1] if evals else None


def plot_eval_curve(metrics_path: str | Path, out: str | Path, title: str = "") -> None:
    """Held-out accuracy against training wall time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = [r for r in read_metrics(metrics_path) if "eval_accuracy" in r]
    fig, ax = plt.subplots(figsize=(5, 3.5), dpi=120)
    ax.plot([r["wall_time"] for r in evals], [r["eval_accuracy"] for r in evals], marker="o")
    ax.set_xlabel("training wall time (s)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
