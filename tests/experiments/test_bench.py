"""The benchmark entry point runs in --quick mode and writes every requested figure as a positive number."""

import json

from experiments.bench import main
import pytest


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_peer_benchmarks_esroll_side(tmp_path):
    """Every peer benchmark runs its esroll side at the tiny shape (--no_peers: the peers, optional extras, are not
    needed), so a change to the trainer's step or to `generate` that breaks a peer benchmark fails here."""
    names = ["generate_vs_hf", "generate_vs_tunix", "grpo_step_vs_tunix", "grpo_step_vs_trl"]
    main(["--quick", "--no_peers", "--model", "quick", "--only", ",".join(names), "--json", str(tmp_path / "b.json")])
    figures = json.loads((tmp_path / "b.json").read_text())
    for name in names:
        entry = figures[name]
        assert entry[name] is None and "no_peers" in entry["reason"], name
        assert entry["esroll_tokens_per_s"] > 0 and entry["esroll_devices"] >= 1, name
    for name in ("grpo_step_vs_tunix", "grpo_step_vs_trl"):  # every completion has exactly new_tokens tokens
        entry = figures[name]
        assert entry["completion_tokens_per_step"] == entry["prompts"] * entry["group_size"] * entry["new_tokens"]
