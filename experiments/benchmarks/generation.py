"""Generation throughput: esroll against transformers' PyTorch `generate`, and ES population against plain decoding.

Both sides of each ratio run in the same process on the same rows, after one warm-up call each (compilation
excluded), in interleaved rounds so that load from other processes hits both alike; the figure is a ratio of median
wall times. EOS is disabled, so every row decodes exactly `new_tokens` tokens on both sides.

PyTorch runs both with one intra-op thread per core and with a single thread, and the faster counts: on a
shared, oversubscribed machine its multi-threaded kernels can stall far beyond their fair share, which would
flatter esroll. esroll runs with its rows split over every device (one per core on a CPU host, as the trainers
run) and, for reference, on one device. es_generate_vs_plain runs both sides on one device.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from esroll import parallel
from esroll.models import LowRank, Perturbation, load_hf
from esroll.sampling import generate, pad_prompts
from experiments.benchmarks._shapes import SHAPES, hf_config_kwargs

_TIMING = "median of interleaved rounds after one warm-up call each (compile excluded)"


def _sizes(args) -> dict:
    if args.quick:
        return dict(batch=8, new_tokens=16, reps=2, members=4)
    return dict(batch=64, new_tokens=64, reps=9, members=16)


def _build(args, folder: str, name: str = ""):
    """Save a random Qwen3 model with the named shape; return (torch model, esroll cfg, esroll params)."""
    import torch
    import transformers

    # Default: a random Qwen3-architecture model small enough for a CPU yet wide enough that matmuls dominate.
    name = name or args.model or "small"
    if name not in SHAPES:
        raise ValueError(f"unknown --model {name!r}; known: {', '.join(SHAPES)}")
    torch.manual_seed(0)
    hf_cfg = transformers.Qwen3Config(**hf_config_kwargs(name), max_position_embeddings=4096, initializer_range=0.1)
    dtype = getattr(torch, args.dtype)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).eval()
    model.save_pretrained(folder)
    cfg, params = load_hf(folder)
    return model, cfg, params


def _prompts(vocab: int, batch: int, seed: int = 0):
    """Left-padded prompts of 8 to 32 tokens."""
    rng = np.random.default_rng(seed)
    return pad_prompts([list(rng.integers(1, vocab, size=rng.integers(8, 33))) for _ in range(batch)])


def _median_times(fns: dict, reps: int) -> dict:
    """Median wall time of each function over `reps` interleaved rounds, after one untimed warm-up call each."""
    for fn in fns.values():
        fn()  # compilation (esroll) and first-call allocations (torch) are not timed
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def generate_vs_hf(args) -> dict:
    """Greedy tokens/s of esroll.sampling.generate over transformers' generate on identical weights.

    esroll splits the rows over every device (on a CPU host, one per core: `parallel.use_cpu_cores_as_devices`, as
    the trainers do), and is also timed on one device; transformers gets one intra-op thread per core, and one.
    """
    import torch

    s = _sizes(args)
    with tempfile.TemporaryDirectory() as folder:
        model, cfg, params = _build(args, folder)
    tokens, mask = _prompts(cfg.vocab_size, s["batch"])
    n = s["new_tokens"]
    mesh = parallel.make_mesh()
    if s["batch"] % mesh.size:
        mesh = parallel.make_mesh(1)
    split = (parallel.put_replicated(mesh, params), parallel.put_rows(mesh, tokens), parallel.put_rows(mesh, mask))

    def ours(params, tokens, mask):
        return generate(
            cfg, params, tokens, jax.random.key(0), max_new_tokens=n, temperature=0.0, prompt_mask=mask
        ).tokens.block_until_ready()

    model.generation_config.eos_token_id = None
    ids, attn = torch.tensor(tokens, dtype=torch.long), torch.tensor(mask, dtype=torch.long)

    def theirs(threads: int):
        torch.set_num_threads(threads)
        with torch.no_grad():
            return model.generate(
                input_ids=ids,
                attention_mask=attn,
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0,
                eos_token_id=None,
            )

    cores = len(os.sched_getaffinity(0))
    runs = {"esroll": lambda: ours(*split), "esroll_1device": lambda: ours(params, tokens, mask)}
    if not args.no_peers:
        runs |= {"hf": lambda: theirs(cores), "hf_1thread": lambda: theirs(1)}
    t = _median_times(runs, s["reps"])
    generated = s["batch"] * n
    esroll_figures = {
        "esroll_tokens_per_s": generated / t["esroll"],
        "esroll_tokens_per_s_1device": generated / t["esroll_1device"],
        "esroll_devices": mesh.size,
        "batch": s["batch"],
        "new_tokens": n,
        "prompt_len": tokens.shape[1],
        "reps": s["reps"],
        "backend": jax.default_backend(),
        "timing": _TIMING,
    }
    if args.no_peers:
        return {"generate_vs_hf": None, "reason": "--no_peers: esroll's side only", **esroll_figures}
    t_hf = min(t["hf"], t["hf_1thread"])
    match = (np.asarray(ours(*split)) == theirs(cores)[:, tokens.shape[1] :].numpy()).mean()
    return {
        "generate_vs_hf": t_hf / t["esroll"],
        "generate_vs_hf_1device": t_hf / t["esroll_1device"],
        f"hf_tokens_per_s_{cores}threads": generated / t["hf"],
        "hf_tokens_per_s_1thread": generated / t["hf_1thread"],
        "greedy_token_agreement": float(match),
        **esroll_figures,
    }


def _rank1_population(params, members: int, sigma: float, key) -> dict:
    """Rank-1 factors of every matrix leaf (layers and lm_head) for `members` members, `a` already scaled by σ."""

    def factors(i, lead, d_in, d_out):
        ka, kb = jax.random.split(jax.random.fold_in(key, i))
        dtype = params["embed"].dtype
        return LowRank(
            sigma * jax.random.normal(ka, (*lead, members, d_in, 1), dtype),
            jax.random.normal(kb, (*lead, members, d_out, 1), dtype),
        )

    matrices = sorted((n, w.shape) for n, w in params["layers"].items() if w.ndim == 3)
    deltas = {"layers": {n: factors(i, (L,), d_in, d_out) for i, (n, (L, d_in, d_out)) in enumerate(matrices)}}
    if "lm_head" in params:
        deltas["lm_head"] = factors(len(matrices), (), *params["lm_head"].shape)
    return deltas


def es_generate_vs_plain(args) -> dict:
    """Throughput of population generation (members x prompts rows, rank-1 perturbed) over plain generation.

    The figure is taken at the "mid" shape (hidden 1024, as es_forward_vs_plain), and also reported at the "small"
    shape of generate_vs_hf (hidden 256), where the per-member term is relatively four times dearer: its FLOPs
    relative to the weight's are N·r·(1/in + 1/out). --model or --quick pick one shape instead.
    """
    s = _sizes(args)
    names = [args.model] if args.model else ["quick"] if args.quick else ["mid", "small"]
    out = {}
    for name in names:
        res = _es_generate_vs_plain(args, name, s)
        if not out:
            out.update(res, shape=name)
        out[f"es_generate_vs_plain_{name}"] = res["es_generate_vs_plain"]
    return out


def _es_generate_vs_plain(args, name: str, s: dict) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        _, cfg, params = _build(args, folder, name)
    members = s["members"]
    per_member = s["batch"] // members
    tokens, mask = _prompts(cfg.vocab_size, per_member)
    tokens, mask = np.tile(tokens, (members, 1)), np.tile(mask, (members, 1))  # row = member * per_member + prompt
    perturb = Perturbation(
        _rank1_population(params, members, 1e-3, jax.random.key(1)), jnp.repeat(jnp.arange(members), per_member)
    )
    n = s["new_tokens"]

    def run(p):
        return generate(
            cfg, params, tokens, jax.random.key(0), max_new_tokens=n, temperature=0.0, prompt_mask=mask, perturb=p
        ).tokens.block_until_ready()

    t = _median_times({"plain": lambda: run(None), "es": lambda: run(perturb)}, s["reps"])
    return {
        "es_generate_vs_plain": t["plain"] / t["es"],
        "es_tokens_per_s": tokens.shape[0] * n / t["es"],
        "plain_tokens_per_s": tokens.shape[0] * n / t["plain"],
        "members": members,
        "rows": tokens.shape[0],
        "new_tokens": n,
        "rank": 1,
        "reps": s["reps"],
        "backend": jax.default_backend(),
        "timing": _TIMING,
    }


BENCHMARKS = {"generate_vs_hf": generate_vs_hf, "es_generate_vs_plain": es_generate_vs_plain}
