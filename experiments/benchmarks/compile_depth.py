"""Compile time of perturbed `generate` against depth, per KV-cache layout, on the CPU and for a TPU target.

    python -m experiments.benchmarks.compile_depth [--depths 28,36] [--targets cpu,tpu] [--layouts unrolled,scan]
        [--repeats 1] [--json PATH]

`generate` with layers="unrolled" (per-layer cache buffers, a Python loop over the layers) holds a copy of every
layer in the prefill and in each decode phase, so its compile time grows linearly with depth; layers="scan" (one
layer-stacked cache in a `lax.scan` carry) holds one copy whatever the depth. This measures both, at the widths of a
small random Qwen3 (hidden 64, so that the figures are about program size, not about large matrices): a population of
4 members with rank-1 `LowRank` factors on every layer matrix, 8 rows, 16-token prompts, 64 new tokens (4 decode
phases). Parameters and inputs are `jax.ShapeDtypeStruct`s; each figure is the wall time of `lower_generate`
(tracing to StableHLO) and of `.compile()` (XLA), the fastest of --repeats cold compiles (caches cleared), after one
warm-up compile of a 2-layer model per target.

Targets: "cpu" (one host CPU device, platform "cpu", so "unrolled" is the CPU default form, with fused matmuls) and
"tpu", an ahead-of-time
compile on this host for a deviceless TPU v5e 2x2 topology (`jax.experimental.topologies`; needs libtpu), rows split
over its 4 chips on a ("data", "model") mesh of 4 x 1 and platform="tpu" passed to `generate`, as a TPU host would
compile it. The headline figure `compile_depth` is the largest deepest/shallowest compile-time ratio of the scan
layout over the targets measured (the aim: at most ~1.2 from 28 to 36 layers).

Also `BENCHMARKS` for `experiments.bench` (under --quick: 2 and 4 layers, CPU only).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

# A deviceless TPU topology loads libtpu in this process; other processes on the host (a TPU trainer, another
# benchmark) may hold libtpu's lockfile, which only matters to processes that drive real chips.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from esroll.models import STACKED, LowRank, ModelConfig, Perturbation, param_shapes
from esroll.sampling import lower_generate

MEMBERS, RANK, BATCH, PROMPT, NEW_TOKENS = 4, 1, 8, 16, 64
LAYOUTS = ("unrolled", "scan")


def small_qwen3(layers: int) -> ModelConfig:
    """A small-width Qwen3 of `layers` layers: hidden 64, 4 heads, 2 kv heads, head_dim 16, vocabulary 512."""
    return ModelConfig(
        family="qwen3",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=192,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=1e6,
        max_position_embeddings=4096,
        qk_norm=True,
    )


def abstract_inputs(cfg: ModelConfig, mesh: Mesh | None) -> tuple:
    """(params, prompt, mask, key, perturbation) as ShapeDtypeStructs: replicated parameters and factors, rows split
    over the mesh's "data" axis (no sharding without a mesh)."""

    def sds(shape, dtype=jnp.float32, *spec):
        sharding = None if mesh is None else NamedSharding(mesh, PartitionSpec(*spec))
        return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)

    shapes = param_shapes(cfg)
    params = {
        name: {n: sds(s) for n, s in shape.items()} if name == STACKED else sds(shape) for name, shape in shapes.items()
    }
    matrices = {n: s for n, s in shapes[STACKED].items() if len(s) == 3}  # [L, I, O]
    deltas = {
        STACKED: {
            n: LowRank(sds((L, MEMBERS, i, RANK)), sds((L, MEMBERS, o, RANK))) for n, (L, i, o) in matrices.items()
        }
    }
    perturb = Perturbation(deltas, sds((BATCH,), jnp.int32, "data"))
    key = sds((), jax.random.key(0).dtype)
    return params, sds((BATCH, PROMPT), jnp.int32, "data"), sds((BATCH, PROMPT), bool, "data"), key, perturb


def tpu_mesh() -> Mesh:
    """A ("data", "model") = 4 x 1 mesh of a deviceless TPU v5e 2x2 topology."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu")
    return Mesh(np.array(topo.devices).reshape(-1, 1), ("data", "model"))


def compile_seconds(layers: int, layout: str, target: str, mesh: Mesh | None) -> dict:
    """Lowering and compile wall times of one perturbed `generate` program, cold."""
    cfg = small_qwen3(layers)
    params, prompt, mask, key, perturb = abstract_inputs(cfg, mesh)
    jax.clear_caches()  # no traced, lowered or compiled program reused from an earlier run
    start = time.perf_counter()
    lowered = lower_generate(
        cfg,
        params,
        prompt,
        key,
        prompt_mask=mask,
        perturb=perturb,
        max_new_tokens=NEW_TOKENS,
        temperature=1.0,
        top_p=0.95,
        eos_ids=(1,),
        layers=layout,
        platform=target,
    )
    lowered_at = time.perf_counter()
    lowered.compile()
    done = time.perf_counter()
    return {"lower_s": lowered_at - start, "compile_s": done - lowered_at, "total_s": done - start}


def measure(depths: list[int], targets: list[str], repeats: int = 1, layouts=LAYOUTS) -> dict:
    """Figures per target and layout: seconds at each depth and the deepest/shallowest ratios. Each figure is the
    fastest of `repeats` runs, the depths interleaved (this host is shared: the minimum is the least disturbed)."""
    jax.config.update("jax_enable_compilation_cache", False)  # every compile cold, also across runs of the script
    out = {}
    for target in targets:
        try:
            mesh = tpu_mesh() if target == "tpu" else None
        except (RuntimeError, ImportError, ValueError) as e:  # no libtpu here: measure the other targets
            print(f"{target}: skipped ({type(e).__name__}: {e})", flush=True)
            out[target] = {"skipped": f"{type(e).__name__}: {e}"}
            continue
        compile_seconds(2, "scan", target, mesh)  # warm-up: backend start, first-compile costs
        out[target] = {}
        for layout in layouts:
            tries = {depth: [] for depth in depths}
            for _ in range(repeats):
                for depth in depths:
                    tries[depth].append(run := compile_seconds(depth, layout, target, mesh))
                    print(
                        f"{target:>4} {layout:>8} L={depth:<3} lower {run['lower_s']:7.2f} s  "
                        f"compile {run['compile_s']:7.2f} s",
                        flush=True,
                    )
            runs = {depth: min(t, key=lambda r: r["total_s"]) for depth, t in tries.items()}
            low, high = runs[min(depths)], runs[max(depths)]
            out[target][layout] = {
                "seconds": {str(d): r for d, r in runs.items()},
                "compile_ratio": high["compile_s"] / low["compile_s"],
                "total_ratio": high["total_s"] / low["total_s"],
            }
    return out


def table(results: dict, depths: list[int]) -> str:
    lo, hi = min(depths), max(depths)
    head = f"{'target':<6} {'layers':<9}" + "".join(f" {'compile L=' + str(d):>14}" for d in depths)
    head += f" {'total L=' + str(hi):>14} {f'compile {hi}/{lo}':>14} {f'total {hi}/{lo}':>12}"
    lines = [head]
    for target, layouts in results.items():
        if "skipped" in layouts:
            lines.append(f"{target:<6} skipped: {layouts['skipped']}")
            continue
        for layout, r in layouts.items():
            secs = r["seconds"]
            row = f"{target:<6} {layout:<9}" + "".join(f" {secs[str(d)]['compile_s']:>13.2f}s" for d in depths)
            row += f" {secs[str(hi)]['total_s']:>13.2f}s {r['compile_ratio']:>14.2f} {r['total_ratio']:>12.2f}"
            lines.append(row)
    return "\n".join(lines)


def headline(results: dict) -> float:
    """The largest compile-time ratio (deepest / shallowest) of the scan layout over the targets measured."""
    return max((r["scan"]["compile_ratio"] for r in results.values() if "scan" in r), default=float("nan"))


def compile_depth(args) -> dict:
    """`experiments.bench` entry: 28 and 36 layers on the CPU and the TPU target (--quick: 2 and 4, CPU only)."""
    quick = getattr(args, "quick", False)
    depths, targets = ([2, 4], ["cpu"]) if quick else ([28, 36], ["cpu", "tpu"])
    results = measure(depths, targets)
    flat = {"compile_depth": headline(results)}
    for target, layouts in results.items():
        for layout, r in layouts.items():
            if isinstance(r, dict):
                flat[f"{target}_{layout}_compile_ratio"] = r["compile_ratio"]
                for d, s in r["seconds"].items():
                    flat[f"{target}_{layout}_L{d}_compile_s"] = s["compile_s"]
    return {**flat, "depths": depths, "timing": "one cold lower + compile each, after a 2-layer warm-up"}


BENCHMARKS = {"compile_depth": compile_depth}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", default="28,36", help="comma-separated layer counts")
    parser.add_argument("--targets", default="cpu,tpu", help="comma-separated: cpu, tpu (deviceless v5e 2x2)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated: unrolled, scan")
    parser.add_argument("--repeats", type=int, default=1, help="cold compiles per figure; the fastest counts")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    depths = [int(d) for d in args.depths.split(",") if d]
    targets = [t for t in args.targets.split(",") if t]
    layouts = [x for x in args.layouts.split(",") if x]
    results = measure(depths, targets, args.repeats, layouts)
    print()
    print(table(results, depths))
    figures = {
        "compile_depth": headline(results),
        "results": results,
        "setup": {
            "model": "random Qwen3, hidden 64, 4 heads, 2 kv heads, head_dim 16, vocab 512",
            "members": MEMBERS,
            "rank": RANK,
            "batch": BATCH,
            "prompt": PROMPT,
            "new_tokens": NEW_TOKENS,
            "depths": depths,
            "repeats": args.repeats,
            "layouts": layouts,
        },
        "_meta": {"jax": jax.__version__, "host": platform.node(), "time": time.time()},
    }
    print(f"\ncompile_depth (largest scan compile ratio {max(depths)}/{min(depths)}): {figures['compile_depth']:.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2))
    return figures


if __name__ == "__main__":
    main()
