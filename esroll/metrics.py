"""Per-step metrics: metrics.jsonl (one JSON object per step), TensorBoard event files, and the final PNG."""

from __future__ import annotations

import json
from pathlib import Path


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
            raise ValueError(f"{path}:{i + 1}: not a JSON object") from None
    return records


class MetricsWriter:
    """Appends to workdir/metrics.jsonl and workdir/tb. On resume, lines after the restored step are dropped, so the
    file always describes exactly one uninterrupted history."""

    def __init__(self, workdir: str | Path, enabled: bool = True):
        self.path = Path(workdir) / "metrics.jsonl"
        self.enabled = enabled
        self._tb = None
        if enabled:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(Path(workdir) / "tb"))

    def records(self) -> list[dict]:
        return read_metrics(self.path)

    def truncate_after(self, step: int) -> None:
        if not self.enabled:
            return
        kept = [r for r in self.records() if r["step"] <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        tmp.replace(self.path)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for k, v in record.items():
            if k != "step" and isinstance(v, (int, float)):
                self._tb.add_scalar(k, v, record["step"])

    def _evals(self) -> list[dict]:
        return [r for r in self.records() if "eval_accuracy" in r]

    def first_eval(self) -> float | None:
        evals = self._evals()
        return evals[0]["eval_accuracy"] if evals else None

    def last_eval_record(self) -> dict | None:
        evals = self._evals()
        return evals[-1] if evals else None

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


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
