"""The notebooks execute from top to bottom (in their FAST mode: small sample counts) without an error."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import xla_flags

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@pytest.mark.e2e
@pytest.mark.parametrize(
    "name", ["variance_analysis.ipynb", "training_dynamics.ipynb", "training_variance.ipynb", "td_variance.ipynb"]
)
def test_notebook_runs(name, monkeypatch):
    monkeypatch.setenv("ESROLL_NOTEBOOK_FAST", "1")
    # One CPU device, as a reader would have; conftest's cheaper XLA passes (compilation dominates these runs).
    monkeypatch.setenv("XLA_FLAGS", xla_flags(None))
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors
    images = sum(
        "image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert images >= 5, f"{name}: expected a figure per section, got {images}"
