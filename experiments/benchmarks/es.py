"""ES throughput: the population-perturbed forward against plain inference, and EGGROLL against dense-noise ES.

Random weights of a named shape (`--model`, see _shapes.py; default "mid": hidden 1024, 2 layers). Both sides of a
ratio are jitted, run once untimed (compilation excluded), then timed in interleaved rounds on the same tokens;
figures are ratios of median wall times.

- es_forward_vs_plain: tokens/s of one batched forward in which every row is a different population member
  (rank-1 perturbation of every layer matrix), over the plain forward on the same rows. EGGROLL reports up to 91%.
- eggroll_vs_dense_speedup: evaluation tokens/s of a whole population with EGGROLL (this step's factors + one
  batched perturbed forward) over dense-noise ES, where each member draws full Gaussian noise for every perturbed
  matrix, forms W + σE_i and runs its own forward. Dense ES costs the same per member whatever the population, so it
  is timed on `dense_members` members; its noise comes from the same generator as EGGROLL's factors
  (`esroll.es.noise.factors`, each matrix drawn whole). EGGROLL reports about 100x.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from esroll import es
from esroll.es import noise
from esroll.models import Perturbation, forward
from experiments.benchmarks._shapes import model_config, random_params, shape_name

SIGMA = 1e-3


def _sizes(name: str, quick: bool) -> dict:
    if quick:
        return dict(rows=8, tokens=16, population=16, member_tokens=16, dense_members=4, reps=3)
    if name == "mid":
        return dict(rows=32, tokens=32, population=256, member_tokens=16, dense_members=8, reps=5)
    # accelerators; float32 logits of a 151936 vocabulary are 0.6 MB a token, so keep the token count moderate
    return dict(rows=128, tokens=128, population=256, member_tokens=64, dense_members=16, reps=5)


def _setup(args):
    name = shape_name(args)
    cfg = model_config(name)
    params = random_params(cfg, jnp.dtype(args.dtype))
    return name, cfg, params, _sizes(name, args.quick)


def _tokens(cfg, rows: int, length: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (rows, length)), jnp.int32)


def _median_times(fns: dict, reps: int) -> dict:
    """Median wall time of each function over `reps` interleaved rounds, after one untimed warm-up call each."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def es_forward_vs_plain(args) -> dict:
    name, cfg, params, s = _setup(args)
    B, T = s["rows"], s["tokens"]
    tokens = _tokens(cfg, B, T)
    es_cfg = es.ESConfig(method="eggroll", population=B, rank=1, sigma=SIGMA)
    ask = jax.jit(lambda p: es.member_deltas(es_cfg, jax.random.key(0), 0, p))
    deltas = ask(params)
    plain = jax.jit(lambda p, t: forward(cfg, p, t)[0])
    perturbed = jax.jit(lambda p, d, t: forward(cfg, p, t, perturb=Perturbation(d, jnp.arange(B)))[0])
    t = _median_times(
        {
            "plain": lambda: plain(params, tokens),
            "es": lambda: perturbed(params, deltas, tokens),
            "ask": lambda: ask(params),
        },
        s["reps"],
    )
    return {
        "es_forward_vs_plain": t["plain"] / t["es"],
        "es_tokens_per_s": B * T / t["es"],
        "plain_tokens_per_s": B * T / t["plain"],
        "ask_seconds": t["ask"],
        "model": name,
        "dtype": args.dtype,
        "rows": B,
        "tokens_per_row": T,
        "members": B,
        "rank": 1,
        "reps": s["reps"],
        "backend": jax.default_backend(),
        "timing": "median of interleaved rounds after one warm-up call",
    }


def eggroll_vs_dense_speedup(args) -> dict:
    name, cfg, params, s = _setup(args)
    P, T, M = s["population"], s["member_tokens"], s["dense_members"]
    row_1xT = _tokens(cfg, 1, T)  # every member evaluates the same row (common random numbers)
    es_cfg = es.ESConfig(method="eggroll", population=P, rank=1, sigma=SIGMA)
    kinds = es.strategy.leaf_kinds(es_cfg, params)  # the same leaves are perturbed on both sides
    dense_kinds = dict.fromkeys(kinds, noise.DENSE)  # `noise.factors` draws a DENSE leaf whole, whatever its rank
    key = jax.random.key(0)

    @jax.jit
    def eggroll(p):
        deltas = es.member_deltas(es_cfg, key, 0, p)
        rows = jnp.broadcast_to(row_1xT, (P, T))
        return forward(cfg, p, rows, perturb=Perturbation(deltas, jnp.arange(P)))[0]

    @jax.jit
    def dense(p):
        def member(i):  # full Gaussian noise per matrix, from the generator EGGROLL's factors come from
            flat = noise.flatten(p)
            eps = noise.flatten(noise.factors(key, i, p, dense_kinds, 1, jnp.zeros((1,), jnp.int32)))
            for path in kinds:
                e = eps[path][:, 0] if noise.is_stacked(path) else eps[path][0]  # drop the direction axis
                flat[path] = flat[path] + (SIGMA * e).astype(flat[path].dtype)
            return forward(cfg, noise.unflatten(flat), row_1xT)[0][0]

        return jax.lax.map(member, jnp.arange(M))

    t = _median_times({"eggroll": lambda: eggroll(params), "dense": lambda: dense(params)}, s["reps"])
    eggroll_tps, dense_tps = P * T / t["eggroll"], M * T / t["dense"]
    return {
        "eggroll_vs_dense_speedup": eggroll_tps / dense_tps,
        "eggroll_tokens_per_s": eggroll_tps,
        "dense_tokens_per_s": dense_tps,
        "model": name,
        "dtype": args.dtype,
        "population": P,
        "tokens_per_member": T,
        "dense_members_timed": M,
        "rank": 1,
        "perturbed_leaves": len(kinds),
        "reps": s["reps"],
        "backend": jax.default_backend(),
        "timing": "median of interleaved rounds after one warm-up call; both include drawing the noise",
    }


BENCHMARKS = {"es_forward_vs_plain": es_forward_vs_plain, "eggroll_vs_dense_speedup": eggroll_vs_dense_speedup}
