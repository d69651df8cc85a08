"""experiments.benchmarks.tpu_cost --quick: a training step's programs compiled for a TPU v5e 2x2 slice that is not
there (deviceless AOT, libtpu from the `plan` extra, which the `test` extra installs), and the cost model's figures
against the roofline."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("libtpu")

from experiments.benchmarks import _tpu_hlo, _tpu_programs, tpu_cost

PROGRAMS = ("decode_plain", "decode_perturbed", "prefill", "tell", "update")


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


@pytest.fixture(scope="module")
def quick():
    return tpu_cost.measure(quick=True, log=lambda *args, **kwargs: None)


@pytest.mark.e2e
def test_every_program_has_finite_positive_figures(quick):
    case = quick["cases"]["quick"]
    assert case["topology"] == "v5e:2x2" and case["device_kind"] == "TPU v5 lite"
    assert case["mesh"] == {"data": 2, "model": 2}
    assert quick["jax_version"] and case["shapes"]["layers"] == 2
    assert tuple(case["programs"]) == PROGRAMS
    for name, p in case["programs"].items():
        assert p["valid"], name  # only layer scans left, one layer per iteration; no op the model could not cost
        for field in ("flops", "bytes_accessed", "optimal_seconds", "must_move_bytes", "roofline_s", "roofline_ratio"):
            assert math.isfinite(p[field]) and p[field] > 0, (name, field, p[field])


@pytest.mark.e2e
def test_roofline_fields_are_the_quotients_of_the_reported_numbers(quick):
    case = quick["cases"]["quick"]
    hbm, peak = quick["hbm_bytes_per_s"], quick["peak_flops"]
    assert (hbm, peak) == (819e9, 197e12)
    for name, p in case["programs"].items():
        parts = [v for k, v in p.items() if k.startswith("must_move_") and k != "must_move_bytes"]
        assert parts and sum(parts) == p["must_move_bytes"], name
        assert close(p["roofline_s"], max(p["must_move_bytes"] / hbm, p["flops"] / peak)), name
        assert close(p["roofline_ratio"], p["optimal_seconds"] / p["roofline_s"]), name
    programs = case["programs"]
    for name in ("decode_plain", "decode_perturbed"):
        p = programs[name]
        read = p["must_move_weights_bytes"] + p["must_move_kv_cache_bytes"]
        assert close(p["bytes_over_weights_kv"], p["bytes_accessed"] / read), name
    assert programs["decode_perturbed"]["must_move_factors_bytes"] > 0
    ratio = programs["decode_plain"]["optimal_seconds"] / programs["decode_perturbed"]["optimal_seconds"]
    assert close(case["perturbed_over_plain"], ratio)
    assert quick["tpu_cost"] == min(c["perturbed_over_plain"] for c in quick["cases"].values())


@pytest.mark.e2e
def test_calibration_programs_count_the_must_do_products(quick):
    """The prefill's and update's calibration programs do the products counted by hand from the shapes (2·m·n·k
    FLOPs each, over the 4 chips): the prefill's within 1% (the rest is the residual adds and the gating product),
    the update's forward and backward products (each weight and attention product three times: forward, input and
    weight gradient; the head over the completion tokens) at least and within 10% (the rest: the log-softmax and the
    optimizer's arithmetic). Each program's `over_calibration` is its optimal_seconds over its calibration's."""
    case = quick["cases"]["quick"]
    s, chips = case["shapes"], 4
    D, F, Hd, L, V = s["hidden"], s["intermediate"], s["head_dim"], s["layers"], s["vocab"]
    q, kv = s["heads"] * Hd, s["kv_heads"] * Hd

    def layers(rows, tokens):
        weights = 2 * rows * tokens * (D * q + 2 * D * kv + q * D + 3 * D * F)
        attention = 2 * 2 * rows * s["heads"] * tokens * tokens * Hd
        return L * (weights + attention)

    prefill = case["programs"]["prefill"]
    by_hand = layers(s["rows"], s["prompt"] - 1) / chips
    assert by_hand <= prefill["calibration"]["flops"] <= 1.01 * by_hand
    update = case["programs"]["update"]
    rows, tokens = s["update_rows"], s["prompt"] + s["update_completion_tokens"] - 1
    by_hand = 3 * (layers(rows, tokens) + 2 * rows * s["update_completion_tokens"] * D * V) / chips
    assert by_hand <= update["calibration"]["flops"] <= 1.1 * by_hand
    for name in ("prefill", "tell", "update"):
        p = case["programs"][name]
        assert p["calibration"]["valid"], name
        assert close(p["over_calibration"], p["optimal_seconds"] / p["calibration"]["optimal_seconds"]), name


@pytest.mark.e2e
def test_layer_figures_resolve_the_scan_by_depth(quick):
    """Each figure is a + b·L + c·L from the programs compiled at depths 0, d and D (the module docstring)."""
    for name in ("decode_plain", "decode_perturbed", "prefill", "update"):
        p = quick["cases"]["quick"]["programs"][name]
        d0, d1, d2 = sorted(p["counted"])
        assert d0 == 0 and p["trip_counts"][d0] == [] and all(n == d2 for n in p["trip_counts"][d2]), name
        for f in tpu_cost.FIELDS:
            a, b, c = p[f"{f}_once"], p[f"{f}_per_layer_outside_loop"], p[f"{f}_layer_body"]
            assert close(a, p["counted"][d0][f]), (name, f)
            assert math.isclose(a + b * d1 + c, p["counted"][d1][f], rel_tol=1e-9), (name, f)
            assert math.isclose(a + b * d2 + c, p["counted"][d2][f], rel_tol=1e-9), (name, f)
            assert math.isclose(p[f], a + (b + c) * 2, rel_tol=1e-9), (name, f)


@pytest.mark.parametrize("perturbed", [False, True])
def test_decode_layer_body_reads_each_layers_cache_where_it_lies(perturbed):
    """Qwen3-0.6B's decode step on v5e:2x2 (8 rows per chip, 4 layers), instruction by instruction (`breakdown`): no
    instruction of the layer body copies a layer's keys or values out of the stacked cache before the products (a
    dynamic-slice of one layer's cache), while the products read them (some instruction reads at least that many
    bytes)."""
    import dataclasses

    t = _tpu_programs.CaseTarget(dataclasses.replace(_tpu_programs.CASES["0.6b"], rows_per_device=8))
    rows = _tpu_hlo.breakdown(t.lower_decode(4, perturbed).compile().as_text())
    layer_kv = t.cache_bytes(t.slots) // (2 * t.model_cfg.num_layers)  # one layer's keys (or values), per chip

    def cache_slice(shape: str) -> bool:  # one layer's keys or values: an array [.., S, .., H] of layer_kv bytes
        found = _tpu_hlo.SHAPE.search(shape)
        dims = [int(d) for d in found.group(2).split(",") if d] if found else []
        return {t.slots, t.model_cfg.head_dim} <= set(dims) and _tpu_hlo.shapes_bytes(found.group(0)) == layer_kv

    assert max(r["bytes"] for r in rows) >= layer_kv
    copies = [r["name"] for r in rows if "dynamic-slice" in r["ops"] + [r["opcode"]] and cache_slice(r["shape"])]
    assert not copies, copies


def test_splash_kernels_are_counted_by_hand():
    """The quick case's prefill on v5e:2x2 (2 x 2 mesh: 2 rows, 2 query heads and 1 kv head of width 64 per chip;
    prompt 16, so 15 tokens padded to one block of 128) runs one splash forward kernel per layer. By hand: 4·H FLOPs
    per pair of the causal blocks (one block, 128² pairs) per row and query head, 4 · 64 · 2 · 2 · 128² = 16,777,216;
    bytes: q and o (2 · 2 · 128 · 64 · 2 B each) and k and v (2 · 1 · 128 · 64 · 2 B each), 196,608. The program's
    figure is the cost model's plus max(bytes / HBM, FLOPs / rate) for the kernel in the layer body."""
    t = _tpu_programs.CaseTarget(_tpu_programs.QUICK)
    assert t.model_cfg.attention.kernel == "splash"
    lowered = t.lower_prefill(3)
    kernels = _tpu_hlo.custom_calls(lowered.compile().as_text())
    assert [(k["flops"], k["bytes"], k["block"], k["width"]) for k in kernels] == [(16_777_216, 196_608, 128, 64)]
    assert kernels[0]["kernel"].startswith("splash_mha_fwd")
    rate = _tpu_hlo.matmul_rate(t.mesh.devices.flat[0], 128, 64)
    assert 0 < rate < tpu_cost.PEAK_FLOPS
    c = _tpu_hlo.cost(lowered)
    assert c["kernels"] == 1 and close(c["kernel_seconds"], max(196_608 / 819e9, 16_777_216 / rate))
    assert close(c["optimal_seconds"], c["optimal_seconds_declared"] + c["kernel_seconds"])


def test_the_update_runs_splash_forward_twice_and_one_fused_backward():
    """The quick case's update (1 row per chip, 2 query heads of width 64, 16 + 16 tokens padded to one block of 128)
    under full remat: the forward kernel in the forward pass and again in the backward pass (4H FLOPs per pair each),
    then one fused backward kernel for dq, dk and dv (10H): 4 · 64 · 2 · 128² = 8,388,608 and 20,971,520."""
    t = _tpu_programs.CaseTarget(_tpu_programs.QUICK)
    kernels = _tpu_hlo.custom_calls(t.lower_update(3, t.update_rows()).compile().as_text())
    named = sorted((k["kernel"].split("_segmented")[0], k["flops"]) for k in kernels)
    assert named == [("splash_mha_dkv", 20_971_520), ("splash_mha_fwd", 8_388_608), ("splash_mha_fwd", 8_388_608)]


@pytest.mark.e2e
def test_a_program_the_chip_cannot_hold_is_compiled_at_fewer_rows_and_extrapolated(monkeypatch):
    """The quick case at 4 rows per chip, its prefill refused above 2 (as the compiler refuses a program whose
    temporaries exceed the chip's memory): compiled at 2 and 1 rows and extrapolated linearly to 4, within 10% of
    the figures the same program has when it does compile at 4 rows."""
    import dataclasses

    import jax

    case = dataclasses.replace(_tpu_programs.QUICK, rows_per_device=4)
    whole = tpu_cost.run_case(case, log=lambda *a, **k: None, programs_wanted=["prefill"])["programs"]["prefill"]
    assert whole["rows_compiled"] == [4]
    lower = _tpu_programs.CaseTarget.lower_prefill

    def refuse_above_2(self, depth):
        if self.rows_per_device > 2:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory")
        return lower(self, depth)

    monkeypatch.setattr(_tpu_programs.CaseTarget, "lower_prefill", refuse_above_2)
    fitted = tpu_cost.run_case(case, log=lambda *a, **k: None, programs_wanted=["prefill"])["programs"]["prefill"]
    assert fitted["rows_compiled"] == [2, 1] and fitted["valid"]
    assert fitted["must_move_bytes"] == whole["must_move_bytes"]  # the bytes the 4 rows must move, by shapes
    for f in ("flops", "bytes_accessed", "optimal_seconds"):
        assert math.isclose(fitted[f], whole[f], rel_tol=0.1), (f, fitted[f], whole[f])
