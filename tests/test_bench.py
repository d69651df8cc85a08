"""The benchmark entry point runs in --quick mode and writes every requested figure as a positive number."""

import json

from experiments.bench import main


def test_bench_quick_writes_figures(tmp_path):
    # A subset keeps the suite inside its time budget: the entry point, the ES speedup figure (a timing figure like the
    # others) and every phase of realshape_step (es_generate_vs_plain and generate_vs_hf share their timing code).
    names = ["eggroll_vs_dense_speedup", "realshape_step"]
    main(["--quick", "--only", ",".join(names), "--json", str(tmp_path / "bench.json")])
    figures = json.loads((tmp_path / "bench.json").read_text())
    for name in names:
        assert figures[name][name] > 0, name
    for phase in ("prefill", "decode", "update"):  # every phase of both methods against its bound
        assert (
            0 < figures["realshape_step"][f"es_{phase}_of_bound"]
            and 0 < figures["realshape_step"][f"grpo_{phase}_of_bound"]
        )
