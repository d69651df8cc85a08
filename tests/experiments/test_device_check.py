"""`python -m experiments.device_check --quick --attention auto,xla` runs without ml_collections and tensorboardX (the
GPU machine it is meant for has neither) and writes a finite, positive figure for every phase under each setting, and
the two kernels' agreement (on a CPU both settings are XLA's: no difference at all)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from conftest import REPO
import pytest

# The entry point, run with the two modules made unimportable (a None entry in sys.modules makes `import` fail).
BLOCKED = ("ml_collections", "tensorboardX")
RUN = (
    "import runpy, sys\n"
    f"sys.modules.update(dict.fromkeys({BLOCKED!r}))\n"
    "sys.argv = ['device_check', *sys.argv[1:]]\n"
    "runpy.run_module('experiments.device_check', run_name='__main__', alter_sys=True)\n"
)


@pytest.mark.e2e
def test_device_check_quick(tmp_path):
    out = tmp_path / "device_check.json"
    proc = subprocess.run(
        [sys.executable, "-c", RUN, "--quick", "--attention", "auto,xla", "--json", str(out)],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["quick"] and report["backend"] == "cpu"
    assert report["jax_version"] and report["device_kind"] and report["bytes_limit"] is None
    assert report["imported"] == {"ml_collections": False, "tensorboardX": False}
    phases = ["prefill", "generate", "perturbed", "looroll", "grpo"]
    assert [r["phase"] for r in report["results"]] == [*phases, *phases, "agreement"]
    assert report["attention"] == ["auto", "xla"] and {r["attention"] for r in report["results"]} == {"xla", "xla/xla"}
    *timed, agree = report["results"]
    assert agree["max_abs_diff"] == 0.0 and agree["max_abs_logit"] > 0
    for r in timed:
        assert r["error"] is None, r
        for key in ("seconds", "first_call_s"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["phase"], key, r[key])
        assert math.isfinite(r["compile_s"]), r
        assert r["peak_bytes"] is None  # the CPU reports no memory statistics
        if r["phase"] in ("prefill", "generate", "perturbed"):
            assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0, r
        if r["phase"] in ("generate", "perturbed"):
            assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0, r
            assert math.isfinite(r["decode_step_s"]) and r["decode_bytes"] > 0, r
            assert r["bandwidth_fraction"] is None  # no peak bandwidth known for a CPU
    assert "tiny generate" in proc.stdout and "tokens/s" in proc.stdout  # the table
