"""Benchmarks: one entry point, tables on stdout and figures by name in JSON.

    python -m experiments.bench [--quick] [--json PATH] [--only NAME[,NAME]] [--model SHAPE] [--dtype bfloat16]
        [--grpo_remat none] [--no_peers]

Each benchmark measures a ratio in one run (on a shared, noisy machine both sides run interleaved in the same
process), never asserts a time. Benchmarks live in experiments/benchmarks/*.py, each exposing
`BENCHMARKS = {name: fn(args) -> dict}`; every dict holds at least the named figure under the key `name`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import platform
import time
from pathlib import Path

import jax

import experiments.benchmarks as benchmarks_pkg
from esroll import parallel


def registry() -> dict:
    found = {}
    for mod in pkgutil.iter_modules(benchmarks_pkg.__path__):
        if mod.name.startswith("_"):
            continue
        found.update(importlib.import_module(f"experiments.benchmarks.{mod.name}").BENCHMARKS)
    return found


def main(argv=None) -> dict:
    reg = registry()
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="benchmarks: " + ", ".join(sorted(reg)),
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, for CI smoke runs")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--only", default="", help="comma-separated benchmark names (default: all, listed below)")
    parser.add_argument("--model", default="", help="a named real-model shape with random weights, e.g. qwen3-0.6b")
    parser.add_argument("--dtype", default="float32", help="parameter dtype of the benchmark models")
    parser.add_argument(
        "--grpo_remat",
        default="",
        help="esroll's grpo.remat in the peer GRPO benchmarks (default 'none', as the peers run; TRL is told to match)",
    )
    parser.add_argument(
        "--no_peers",
        action="store_true",
        help="run only esroll's side of the peer benchmarks (their esroll figures; the ratios are None)",
    )
    args = parser.parse_args(argv)
    parallel.use_cpu_cores_as_devices()  # generate_vs_hf splits rows over one device per core, as the trainers do

    names = [n for n in args.only.split(",") if n] or sorted(reg)
    unknown = [n for n in names if n not in reg]
    if unknown:
        parser.error(f"unknown benchmark {unknown[0]!r}; known: {', '.join(sorted(reg))}")
    results = {
        "_meta": {
            "backend": jax.default_backend(),
            "devices": str(jax.devices()),
            "host": platform.node(),
            "quick": args.quick,
            "model": args.model,
            "dtype": args.dtype,
            "grpo_remat": args.grpo_remat,
            "no_peers": args.no_peers,
            "time": time.time(),
        }
    }
    for name in names:
        print(f"\n== {name}", flush=True)
        res = reg[name](args)
        results[name] = res
        width = max(len(k) for k in res)
        for k, v in res.items():
            print(f"  {k:<{width}}  {v:.4g}" if isinstance(v, float) else f"  {k:<{width}}  {v}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return results


if __name__ == "__main__":
    main()
