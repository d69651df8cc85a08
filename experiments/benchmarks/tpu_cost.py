"""Per-chip cost of a training step's accelerator programs, from the TPU compiler's cost model, without a TPU.

    python -m experiments.benchmarks.tpu_cost [--quick] [--cases 0.6b,8b] [--programs decode_plain,...]
                                              [--rows-per-device N] [--attention auto|xla]
                                              [--remat none|dots|full] [--json PATH]
    python -m experiments.benchmarks.tpu_cost --cases 0.6b --breakdown decode_plain [--hlo-out DIR]

Each program is compiled ahead of time for a deviceless TPU topology (`jax.experimental.topologies`, as
`esroll.plan.topology_mesh` does; needs libtpu) and its `compiled.cost_analysis()` is read: `flops`, `bytes accessed`
and `optimal_seconds` of the per-device SPMD program, so every figure is per chip. Parameters, caches, factors and
batches are `jax.ShapeDtypeStruct`s with the trainer's shardings (`esroll.sharding`): the decoding copy in
`model.dtype` (bfloat16) under the compute rules for decoding, float32 masters and moments under the master rules
for `tell` and the update. Programs:

    decode_plain      one decode step: `forward` of 1 token per row over the layer-stacked KV cache of prompt + new
                      slots (donated, written in place), as `generate` runs it: under `shard_map` over the rows when
                      the mesh has no model axis, else partitioned by GSPMD with the cache's rows over "data" and its
                      kv heads over "model";
    decode_perturbed  the same step with the rows' ES members' low-rank factors as member tables
                      (`Perturbation.tables`: each device's table of the distinct members among its rows, split over
                      "data" one block per device, and each row's entry) as `generate` builds them once per call
                      and hands them to every step;
    prefill           the prompt's forward (prompt - 1 tokens) into a fresh cache of every slot (as `generate`
                      allocates it once), reading none of it, perturbed as ES rolls out: the members' factors
                      (`strategy.ask`'s) built into member tables, then the forward;
    tell              the ES strategy's `tell` (estimate and optimizer update of the donated masters and moments);
    update            GRPO's `make_update` on one microbatch of the trainer's rows, the completions scored at once
                      (microbatches 1, logprob_chunk 0: memory knobs, the same arithmetic per row), so that no loop
                      but the layer scans is left in the program; the trainer's update of a minibatch sums
                      `microbatches` such gradients before its one optimizer step.

Where a chip cannot hold a program at the configured rows (the compiler refuses it: RESOURCE_EXHAUSTED), it is
compiled at r and r/2 rows, r the configured rows halved until it compiles, and its figures are extrapolated linearly
in the rows (`fitting`; `rows_compiled` says which were compiled): rows per chip for the decode steps and the
prefill, the microbatch's rows for the update; the must-move bytes stay those of the configured rows. So the default
command completes at the planner's rows whatever they are.

Attention: the programs use the attention kernel `model.attention` picks for the topology (`--attention`, default
the config's "auto": splash on a TPU, `esroll.models.attention`). The cost model prices a Mosaic kernel at the cost it
declares, which for splash attention is nothing, so each kernel is counted by hand (`_tpu_hlo.custom_calls`: its
causal blocks' FLOPs at the rate the cost model gives XLA's product of the kernel's blocks, its must-move bytes at
the chip's bandwidth) and added to the program's figures; `optimal_seconds_square` prices the kernels' FLOPs at the
rate of a large square product instead (the chip's peak: the two bound what the cost model would give a kernel it
could see into; `over_calibration_square`), and `optimal_seconds_declared` keeps the figure without the hand count
(the table's last two columns). `--attention xla` compiles XLA's attention instead (no kernel to count).

The layouts of what stays on the chip across `generate`'s decode loop (weights, cache, factors) and of the cache the
prefill hands to it are the compiler's choice (`Layout.AUTO`), as inside that loop: with default entry layouts a
lone step would convert the whole cache on entry and exit. `tell` and the update run as their own programs in the
trainer and keep the default layouts.

A while loop's body is counted once by the cost model, whatever its trip count. Hence one program per step above,
and the layer scan (`lax.scan` over the stacked layers, `parallel.scan_unroll` layers per iteration: 1 in these
configs) is resolved by compiling each program at three depths, 0, d and L layers (d = 4; 3 and 4 for a model of
at most 4 layers; at 2 the compiler keeps the small stacks in on-chip memory, a different program): the model is
cost(depth) = a + b·depth + c·[depth > 0] (a: what runs once, b·depth: what runs once but grows with depth, such
as the optimizer over the layers' leaves, c: one iteration of the layer loop), and the figure reported is
a + b·L + c·L. `tell` has no loop and is compiled once. The cost model gives -1 s to each ConcatBitcast (buffers
joined in place) in the entry and in loop bodies; those are added back (`uncosted_ops`). `valid` marks a figure
whose programs kept no loop but the layer scan, one layer per iteration, and no negative time.

Rows and shapes: the real configs (configs/gsm8k_qwen3.py: model axis, population, prompts per step, GRPO's group
size and microbatches) at the rows per device the planner chose (docs/plans/*_v5e-*.json), prompt 256 and 512 new
tokens as the plans use. Cases: Qwen3-0.6B on v5e:2x2 and Qwen3-8B on v5e:8x8; --quick: a Qwen3 of 2 layers,
narrowed (hidden 256, vocabulary 1024, untied head), on v5e:2x2 (mesh 2 x 2) with a few rows, short prompts
and a small population.

Against the roofline of a v5e chip (819e9 B/s HBM, 197e12 bf16 FLOP/s): roofline_s = max(must_move_bytes / 819e9,
flops / 197e12), flops the program's own (as above), and `roofline_ratio` = optimal_seconds / roofline_s. The bytes
that must move, per device (each tensor's shard as its sharding gives it):

    decode     the weights the step reads (layers, final norm, the head: the embedding when tied, else lm_head; the
               embedding rows gathered are left out), the KV cache read (every slot), and, perturbed, the factors of
               the distinct members among the device's rows (rows are member-major, prompts x samples per member);
    prefill    the layers' weights (the head's logits are unused) and the cache written, plus those factors;
    tell       the perturbed leaves' masters and their optimizer moments, each read once and written once;
    update     the masters and moments, read and written, and the gradient (the masters' size), written and read.

The cost model gives a plain large bfloat16 matrix product only about a fifth of the peak's FLOP/s, so a
compute-bound program is also judged against what the model can give at all: its **calibration program**, only the
must-do work of that program at the same shapes and shardings, compiled and resolved through the layers the same
way, and `over_calibration` = optimal_seconds / the calibration's optimal_seconds (the goal: <= 1.3):

    prefill    the prompt's embedding rows, each layer's weight products (q, k, v, o, gate, up, down) and attention
               contractions (q·kᵀ, then its product with v) over the prompt - 1 tokens, the keys and values written
               out; no norm, rotary, softmax, mask, perturbation or cache allocation;
    tell       each perturbed leaf's estimate Σ_k w_k A_k B_kᵀ / √r from the directions' factors (given as arguments,
               not regenerated) and the trainer's optimizer applied to the donated masters and moments;
    update     the masters cast and gathered layer by layer as the update does, the same products and contractions
               over prompt + completion, the head over the completion tokens and their log-softmax at the tokens
               weighted by the advantages, its gradient (no rematerialisation) and the optimizer's update; at the
               update's rows, halved and extrapolated as the update is where it does not fit.

Per decode step also `bytes_over_weights_kv` = bytes accessed / (weights + KV cache read), and per case
`perturbed_over_plain` = plain optimal_seconds / perturbed optimal_seconds (the goal: >= 0.95; EGGROLL's anchor is
0.91 of inference on an H100). `BENCHMARKS` for `experiments.bench`: the headline `tpu_cost` is the smallest
perturbed_over_plain over the cases run.

`--breakdown PROGRAM` says where a program's layer body spends its bytes: the instructions of the layer scan's body
(compiled at the model's depth), each with the bytes it reads and writes by the convention of XLA's cost analysis
(a slice of a layer-stacked operand counts as the slice; an in-place update as its update), largest first, beside
the cost model's own layer-body figure. A copy of a layer's keys and values or weights before a product shows as a
`dynamic-slice` fusion of that size.

Where the pieces are: the cases and the programs lowered at any depth in `_tpu_programs` (`CaseTarget`), the
calibration programs in `_tpu_calibration`, reading the compiled HLO and its cost model (the depth model, the
breakdown, the kernels' hand count) in `_tpu_hlo`; this module resolves the rows a chip holds, sets each program
against its roofline and calibration (`run_case`), and reports.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
from pathlib import Path

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax

from esroll import es
from esroll.models import attention
from esroll.models.transformer import REMAT_POLICIES
from experiments.benchmarks import _tpu_calibration
from experiments.benchmarks._tpu_hlo import (
    FIELDS,
    HBM_BYTES_PER_S,
    breakdown,
    breakdown_table,
    depths,
    fitting,
    once,
    through_layers,
)
from experiments.benchmarks._tpu_programs import CASES, QUICK, Case, CaseTarget, device_bytes

PEAK_FLOPS = 197e12  # TPU v5e, bfloat16
PROGRAMS = ("decode_plain", "decode_perturbed", "prefill", "tell", "update")


def _roofline(program: dict, must_move: int, **parts) -> dict:
    roofline = max(must_move / HBM_BYTES_PER_S, program["flops"] / PEAK_FLOPS)
    return {
        **program,
        "must_move_bytes": must_move,
        **{f"must_move_{k}_bytes": v for k, v in parts.items()},
        "roofline_s": roofline,
        "roofline_ratio": program["optimal_seconds"] / roofline,
    }


def _update_program(t: CaseTarget, layers: int, log, lower=None) -> dict:
    """The update's figures at the trainer's microbatch rows (`lower(depth, rows)`: `t.lower_update` by default, or
    its calibration), halved and extrapolated where they do not fit a chip unchunked (`fitting`)."""
    return fitting("update", lower or t.lower_update, layers, t.update_rows(), t.data, log)


def run_case(case: Case, log=print, programs_wanted=None) -> dict:
    """The figures of `case`'s programs (`programs_wanted`: the names to compile, None: all of PROGRAMS)."""
    t = CaseTarget(case)
    c = t.model_cfg
    L = c.num_layers
    log(
        f"{case.name}: {case.preset} ({L} layers) on {case.topology}, mesh {dict(t.mesh.shape)}, "
        f"{t.rows_per_device} rows per device ({t.rows} per chunk), population {t.members}, "
        f"prompt {case.prompt} + {t.new_tokens} new",
        flush=True,
    )
    weights, layers = t.decode_weights_bytes(), t.layer_weights_bytes()
    kv, factors = t.cache_bytes(t.slots), t.factor_bytes()
    programs = {}

    wanted = set(programs_wanted or PROGRAMS)
    targets = {t.rows_per_device: t}

    def at(rows_per_device: int) -> CaseTarget:  # the case at fewer rows per chip, where the plan's do not fit
        if rows_per_device not in targets:
            targets[rows_per_device] = CaseTarget(dataclasses.replace(case, rows_per_device=rows_per_device))
        return targets[rows_per_device]

    def per_chip(name, lower):  # `lower(target, depth)` at the case's rows per chip, or fewer (`fitting`)
        return lambda: fitting(name, lambda d, r: lower(at(r), d), L, t.rows_per_device, 1, log)

    def record(name, program, must_move, calibration=None, **parts):
        if name not in wanted:
            return
        programs[name] = p = _roofline(program(), must_move, **parts)
        log(f"  {name}: {p['optimal_seconds'] * 1e3:.3f} ms, compiled in {p['compile_s']:.0f} s", flush=True)
        if calibration is not None:
            cal = calibration()
            p["calibration"] = {
                k: cal[k] for k in (*FIELDS, "valid", "compile_s", *(["rows_compiled"] * ("rows_compiled" in cal)))
            }
            p["over_calibration"] = p["optimal_seconds"] / cal["optimal_seconds"]
            p["over_calibration_square"] = p["optimal_seconds_square"] / cal["optimal_seconds"]
            log(
                f"  {name} calibration: {cal['optimal_seconds'] * 1e3:.3f} ms (program / calibration "
                f"{p['over_calibration']:.2f}), compiled in {cal['compile_s']:.0f} s",
                flush=True,
            )

    record(
        "decode_plain",
        per_chip("decode_plain", lambda target, d: target.lower_decode(d, perturbed=False)),
        weights + kv,
        weights=weights,
        kv_cache=kv,
    )
    record(
        "decode_perturbed",
        per_chip("decode_perturbed", lambda target, d: target.lower_decode(d, perturbed=True)),
        weights + kv + factors,
        weights=weights,
        kv_cache=kv,
        factors=factors,
    )
    written = t.cache_bytes(case.prompt - 1)
    record(
        "prefill",
        per_chip("prefill", lambda target, d: target.lower_prefill(d)),
        layers + written + factors,
        calibration=per_chip("prefill calibration", _tpu_calibration.lower_prefill),
        weights=layers,
        kv_cache_written=written,
        factors=factors,
    )
    if "tell" in wanted:
        lowered, masters, state = t.lower_tell()
        trained = device_bytes(es.trainable(t.cfg.es_config, masters))
        moments = device_bytes(state.opt_state)
        record(
            "tell",
            lambda: once(lowered),
            2 * (trained + moments),
            calibration=lambda: once(_tpu_calibration.lower_tell(t)),
            masters=2 * trained,
            moments=2 * moments,
        )
    if "update" in wanted:
        masters, state = t.grpo_state(t.model_cfg)
        m, s = device_bytes(masters), device_bytes(state.opt_state)
        calibrate = functools.partial(_tpu_calibration.lower_update, t)
        record(
            "update", lambda: _update_program(t, L, log), 2 * m + 2 * s + 2 * m,
            calibration=lambda: _update_program(t, L, log, calibrate), masters=2 * m, moments=2 * s, gradients=2 * m,
        )  # fmt: skip
    for name in ("decode_plain", "decode_perturbed"):
        if name in programs:
            programs[name]["bytes_over_weights_kv"] = programs[name]["bytes_accessed"] / (weights + kv)
    if "decode_perturbed" in programs:
        # What the perturbed step receives per device (its rows' member tables), beside the distinct members' it must
        # read.
        factor_arguments = device_bytes(t.tables(t.perturbation(c, t.compute(c))))
        programs["decode_perturbed"]["factor_argument_bytes"] = factor_arguments
    ratio = None
    if "decode_plain" in programs and "decode_perturbed" in programs:
        ratio = programs["decode_plain"]["optimal_seconds"] / programs["decode_perturbed"]["optimal_seconds"]
    return {
        "topology": case.topology,
        "attention": c.attention.kernel,
        "grpo_remat": t.grpo_cfg.grpo.remat,
        "device_kind": getattr(t.mesh.devices.flat[0], "device_kind", ""),
        "mesh": dict(t.mesh.shape),
        "model": case.preset,
        "shapes": {
            "layers": c.num_layers,
            "hidden": c.hidden_size,
            "intermediate": c.intermediate_size,
            "heads": c.num_heads,
            "kv_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "vocab": c.vocab_size,
            "tied_embedding": c.tie_word_embeddings,
            "dtype": str(t.dtype),
            "master_dtype": t.cfg.model.master_dtype,
            "rows_per_device": t.rows_per_device,
            "rows": t.rows,
            "population": t.members,
            "rows_per_member": t.rows_per_member,
            "members_per_device": t.members_per_device(),
            "member_slots": t.member_slots,
            "rank": t.cfg.es.rank,
            "prompt": case.prompt,
            "new_tokens": t.new_tokens,
            "decode_cache_slots": t.slots,
            "update_rows": t.update_rows(),
            "update_completion_tokens": t.grpo_cfg.train.max_new_tokens,
            "grpo_microbatches_per_update": t.grpo_cfg.grpo.microbatches,
            "depths_compiled": list(depths(c.num_layers)),
        },
        "programs": programs,
        "perturbed_over_plain": ratio,
    }


def layer_breakdown(case: Case, program: str, hlo_out: Path | None = None) -> str:
    """`breakdown_table` of `program`'s layer body at the model's depth, with the cost model's layer-body bytes (c in
    the module docstring's model, from the three depths) to check the attribution against."""
    t = CaseTarget(case)
    lower = {
        "decode_plain": lambda d: t.lower_decode(d, perturbed=False),
        "decode_perturbed": lambda d: t.lower_decode(d, perturbed=True),
        "prefill": t.lower_prefill,
    }
    if program not in lower:
        raise ValueError(f"--breakdown: one of {', '.join(lower)}, not {program!r}")
    L = t.model_cfg.num_layers
    depth = depths(L)[2]
    hlo = lower[program](depth).compile().as_text()
    if hlo_out:
        hlo_out.mkdir(parents=True, exist_ok=True)
        (hlo_out / f"{case.name}_{program}_depth{depth}.hlo.txt").write_text(hlo)
    body = through_layers(lower[program], L)["bytes_accessed_layer_body"]
    head = (
        f"{case.name} {program}, depth {depth}, {t.rows_per_device} rows per chip: the layer body's instructions "
        f"(cost model's layer body: {body / 1e6:.2f} MB)"
    )
    return head + "\n" + breakdown_table(breakdown(hlo))


def table(results: dict) -> str:
    """One row per (case, program)."""
    head = (
        f"{'case':<6}{'program':<18}{'optimal ms':>11}{'roofline ms':>12}{'ratio':>7}{'GFLOP':>10}"
        f"{'GB accessed':>12}{'GB must move':>13}{'acc/(w+kv)':>11}{'/calib':>8}{'square ms':>10}{'declared ms':>12}"
    )
    lines = [head]
    for name, r in results.items():
        for prog, p in r["programs"].items():
            extra = f"{p['bytes_over_weights_kv']:>11.3f}" if "bytes_over_weights_kv" in p else f"{'':>11}"
            calib = f"{p['over_calibration']:>8.2f}" if "over_calibration" in p else f"{'':>8}"
            calib += f"{p['optimal_seconds_square'] * 1e3:>10.3f}{p['optimal_seconds_declared'] * 1e3:>12.3f}"
            lines.append(
                f"{name:<6}{prog:<18}{p['optimal_seconds'] * 1e3:>11.3f}{p['roofline_s'] * 1e3:>12.3f}"
                f"{p['roofline_ratio']:>7.2f}{p['flops'] / 1e9:>10.1f}{p['bytes_accessed'] / 1e9:>12.3f}"
                f"{p['must_move_bytes'] / 1e9:>13.3f}{extra}{calib}"
            )
        if r["perturbed_over_plain"] is not None:
            lines.append(f"{name:<6}perturbed/plain decode (plain s / perturbed s): {r['perturbed_over_plain']:.3f}")
    return "\n".join(lines)


def _chosen(quick: bool, cases=None, rows_per_device: int = 0, attention: str = "", remat: str = "") -> list[Case]:
    """The cases named (QUICK for `quick`, all by default), at `rows_per_device` rows per chip when given, with
    `model.attention` = `attention` and `grpo.remat` = `remat` when given."""
    chosen = [QUICK] if quick else [CASES[n] for n in (cases or list(CASES))]
    chosen = [dataclasses.replace(c, rows_per_device=rows_per_device) if rows_per_device else c for c in chosen]
    extra = (("model.attention", attention),) * bool(attention) + (("grpo.remat", remat),) * bool(remat)
    return [dataclasses.replace(c, overrides=(*c.overrides, *extra)) for c in chosen]


def measure(
    quick: bool, cases=None, log=print, programs=None, rows_per_device: int = 0, attention: str = "", remat: str = ""
) -> dict:
    """Every chosen case's figures (`programs`: the program names to compile, None: all; `rows_per_device`: rows
    per chip in place of the plan's, 0: the plan's; `attention`: `model.attention`, `remat`: `grpo.remat`, "": the
    config's)."""
    chosen = _chosen(quick, cases, rows_per_device, attention, remat)
    results = {case.name: run_case(case, log, programs) for case in chosen}
    log(table(results), flush=True)
    ratios = [r["perturbed_over_plain"] for r in results.values() if r["perturbed_over_plain"] is not None]
    return {
        "tpu_cost": min(ratios) if ratios else None,
        "jax_version": jax.__version__,
        "hbm_bytes_per_s": HBM_BYTES_PER_S,
        "peak_flops": PEAK_FLOPS,
        "cases": results,
    }


def tpu_cost(args) -> dict:
    return measure(args.quick)


BENCHMARKS = {"tpu_cost": tpu_cost}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 layers at Qwen3-0.6B's widths, a few rows")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--programs", default=",".join(PROGRAMS), help=f"comma-separated, of {', '.join(PROGRAMS)}")
    parser.add_argument("--rows-per-device", type=int, default=0, help="rows per chip (default: the plan's)")
    parser.add_argument(
        "--attention", choices=attention.SETTINGS, default="", help="model.attention (default: the config's, auto)"
    )
    parser.add_argument("--remat", choices=REMAT_POLICIES, default="", help="grpo.remat (default: the config's, full)")
    parser.add_argument(
        "--breakdown",
        metavar="PROGRAM",
        help="print the bytes of each instruction of PROGRAM's layer body (decode_plain, decode_perturbed, prefill) "
        "at the model's depth for each case, beside the cost model's layer-body bytes, instead of the figures",
    )
    parser.add_argument("--hlo-out", type=Path, help="with --breakdown: write each compiled HLO text here")
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    programs = [p for p in args.programs.split(",") if p]
    unknown = sorted(set(programs) - set(PROGRAMS)) + sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown program or case: {', '.join(unknown)}")
    if args.breakdown:
        for case in _chosen(args.quick, cases, args.rows_per_device, args.attention, args.remat):
            print(layer_breakdown(case, args.breakdown, args.hlo_out), flush=True)
        return {}
    results = measure(
        args.quick,
        cases,
        programs=programs,
        rows_per_device=args.rows_per_device,
        attention=args.attention,
        remat=args.remat,
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return results


if __name__ == "__main__":
    jax.config.update("jax_platforms", "cpu")  # compiled for the topology; keep JAX off any local accelerator
    main()
