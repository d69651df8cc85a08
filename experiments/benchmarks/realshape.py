"""Each phase of one ES step and one GRPO step at a real model's shapes, against the host's roofline.

realshape_step: Qwen3-0.6B shapes by default (random bf16 weights, float32 masters; `--model` picks another shape,
"quick" under --quick), 64 rows, prompt 128, 64 new tokens, on one device, with the settings of
`configs/gsm8k_qwen3.py:0.6b,looroll` and `:0.6b,grpo` (ES: 32 members × 2 prompts, greedy; GRPO: 8 prompts × 8
completions at temperature 1, its microbatches, remat and chunked log-probabilities). The phases:

    prefill   `generate` with one new token: the prompt's forward into the KV cache, and the first decode step
    decode    `generate` with 64 new tokens minus the above: the other 63 decode steps (every row runs to the end:
              no end-of-sequence token is given)
    update    ES: `tell` (the estimator's low-rank sums and Adam on the float32 masters);
              GRPO: one optimizer step (forward and backward over prompt + completion, AdamW)

The roofline is measured in the same run: peak matmul FLOP/s (the best of bf16 and float32 matmuls at the model's
own shapes and at 4096³) and streaming bandwidth (the best of a bf16 sum over a large array and a skinny bf16 matmul,
the decode step's access pattern). A phase's bound is max(bytes it must move / bandwidth, FLOPs it must do / peak),
counting what any implementation must do: weight matmuls, attention over the cached context, the LM head where
logits are needed, the KV cache's reads and writes, the optimizer's reads and writes of masters and moments; no
rematerialisation. Each figure `<method>_<phase>_of_bound` is bound / measured time (1.0 is the roofline; the goal
is ≥ 0.3). `--model mid` gives the phases of the peer benchmarks' shape.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from configs.gsm8k_qwen3 import get_config
from esroll import es, grpo, parallel, sharding
from esroll.es import estimators
from esroll.es import method as es_method
from esroll.config import from_config_dict, make_optimizer
from esroll.models import Perturbation
from esroll.sampling import generate, lower_generate
from experiments.benchmarks._shapes import SHAPES, model_config, random_params

ROWS, PROMPT, NEW = 64, 128, 64
ES_PROMPTS = 2  # 32 members × 2 prompts = 64 rows
ES_UPDATE_CALLS = 5  # timed calls of ES's `tell` (after a warm-up call); the figure is their median
GRPO_GROUP = 8  # 8 prompts × 8 completions = 64 rows


def _seconds(fn, reps: int, warmup: bool = True) -> list[float]:
    """Wall times of `reps` calls, after one untimed call when `warmup`."""
    if warmup:
        jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return times


def _best_seconds(fn, reps: int) -> float:
    return min(_seconds(fn, reps))


def roofline(cfg, rows: int, prompt: int, stream_bytes: int, square: int = 4096) -> dict:
    """Peak matmul FLOP/s and streaming bytes/s of the default device, measured in the same run."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    matmul = jax.jit(lambda a, b: a @ b)
    flops = {}
    for dtype in (jnp.bfloat16, jnp.float32):
        for m, k, n in ((rows * prompt, H, I), (rows * prompt, I, H), (rows, H, I), (square,) * 3):
            a, b = jnp.ones((m, k), dtype), jnp.ones((k, n), dtype)
            flops[f"{jnp.dtype(dtype).name} {m}x{k}x{n}"] = (
                2 * m * k * n / _best_seconds(functools.partial(matmul, a, b), 3)
            )
            del a, b
    n = stream_bytes // 2
    w = jnp.ones((n,), jnp.bfloat16)
    total = jax.jit(lambda w: jnp.sum(w, dtype=jnp.float32))
    by_sum = 2 * n / _best_seconds(functools.partial(total, w), 3)
    side = int(np.sqrt(n)) // 128 * 128
    W, x = w[: side * side].reshape(side, side), jnp.ones((8, side), jnp.bfloat16)
    by_matmul = 2 * side * side / _best_seconds(functools.partial(matmul, x, W), 3)
    del w, W
    # Context, not part of the bound: how fast XLA's own elementwise loops stream on the host (an Adam-like
    # axpy over float32 arrays of the same total size: two reads, one write).
    u, v = jnp.ones((n // 4,), jnp.float32), jnp.ones((n // 4,), jnp.float32)
    axpy = jax.jit(lambda u, v: 0.9 * u + 0.1 * v)
    by_axpy = 3 * 4 * (n // 4) / _best_seconds(functools.partial(axpy, u, v), 3)
    del u, v
    best = max(flops, key=flops.get)
    return {
        "peak_flops": flops[best],
        "peak_flops_at": best,
        "bandwidth": max(by_sum, by_matmul),
        "bandwidth_sum": by_sum,
        "bandwidth_skinny_matmul": by_matmul,
        "bandwidth_xla_axpy": by_axpy,
        "matmul_flops": flops,
    }


# ---- the work each phase must do


def _layer_weights(cfg) -> int:
    """Weight-matrix entries of one decoder layer (q, k, v, o, gate, up, down)."""
    H, D = cfg.hidden_size, cfg.head_dim
    return H * D * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * H * cfg.intermediate_size


def _attention_flops(cfg, rows: int, queries: int, context_from: int) -> float:
    """QKᵀ and PV of `queries` consecutive positions per row, the first attending to `context_from` keys."""
    keys = queries * context_from + queries * (queries - 1) / 2
    return 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * rows * keys


def _kv_bytes(cfg, rows: int, positions: float, itemsize: int = 2) -> float:
    return 2.0 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * rows * positions * itemsize


def phase_work(cfg, rows: int, prompt: int, new: int, perturbed_io: int, es_update: tuple[int, int]) -> dict:
    """{phase: (FLOPs, bytes)} at bf16 weights and KV cache. `perturbed_io`: Σ (in + out) over the perturbed
    matrices (rank-1 terms, ES only; 0 for GRPO); `es_update`: (entries of the perturbed matrices, population)."""
    Lw = cfg.num_layers * _layer_weights(cfg)
    head = cfg.vocab_size * cfg.hidden_size
    weights = 2.0 * (Lw + head)  # bf16 bytes streamed by one pass over the model (the head once)
    per_token = 2.0 * Lw + 4.0 * perturbed_io  # the perturbation: x·a then (x·a)·bᵀ, per perturbed matrix
    pre = prompt - 1  # the prompt but its last token goes into the cache; the last is the first decode step's input
    prefill = (  # the prompt's forward, then the first decode step: two passes over the weights
        rows * (pre + 1) * per_token + 2.0 * rows * head + _attention_flops(cfg, rows, pre + 1, 0),
        2 * weights + 2 * _kv_bytes(cfg, rows, prompt),  # the cache written, then read by the first step
    )
    steps = new - 1  # decode steps 2..new read contexts prompt .. prompt + new - 2
    mean_context = prompt + (steps - 1) / 2
    decode = (
        steps * (rows * (per_token + 2.0 * head)) + _attention_flops(cfg, rows, steps, prompt),
        steps * (weights + _kv_bytes(cfg, rows, mean_context + 1)),
    )
    out = {"prefill": prefill, "decode": decode}
    if es_update[0]:  # Σ_i f_i a_i b_iᵀ per matrix, then Adam: masters, μ, ν float32, each read and written
        entries, population = es_update
        out["update"] = (2.0 * population * entries, 24.0 * entries)
    else:  # forward + backward (3×) over prompt + completion, the head on completion positions; AdamW on everything
        T = prompt + new
        params = Lw + head + cfg.hidden_size * (2 * cfg.num_layers + 1)
        flops = 3.0 * (rows * T * 2.0 * Lw + rows * new * 2.0 * head + _attention_flops(cfg, rows, T, 0))
        out["update"] = (flops, 32.0 * params)  # masters, gradient, μ, ν: float32 reads and writes
    return out


# ---- timing


def _generate_phases(cfg, params, prompt_BxP, key, new: int, reps: int, **kwargs) -> tuple[float, float]:
    """prefill = the fastest of `reps` interleaved rounds of `generate` with 1 new token; decode = the fastest round
    of `generate` with `new` tokens minus that. With several rounds the minimum is the estimate least disturbed by
    other work on a shared machine, and one slow round of the short program cannot drive decode negative (at full
    size there is one round). Both programs are compiled ahead of time (which fills `generate`'s compilation cache):
    no warm-up call."""
    run_1, run_n = (
        functools.partial(generate, cfg, params, prompt_BxP, key, max_new_tokens=n, **kwargs) for n in (1, new)
    )
    for n in (1, new):
        lower_generate(cfg, params, prompt_BxP, key, max_new_tokens=n, **kwargs).compile()
    one, many = [], []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(run_1())
        mid = time.perf_counter()
        jax.block_until_ready(run_n())
        one.append(mid - start)
        many.append(time.perf_counter() - mid)
    prefill, decode = min(one), min(many) - min(one)
    if decode <= 0:
        raise RuntimeError(
            f"decode time not measurable: generating {new} tokens took {min(many):.3g} s, 1 token {prefill:.3g} s "
            f"(fastest of {reps} rounds); raise the rounds or NEW tokens in realshape_step"
        )
    return prefill, decode


def _prompts(cfg, count: int, length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, cfg.vocab_size, (count, length)).astype(np.int32)


def _es_phases(cfg, masters, mesh, rows, prompt, new, reps) -> tuple[dict, dict]:
    c = from_config_dict(get_config("0.6b,looroll").to_dict())
    X = ES_PROMPTS
    M = rows // X
    es_cfg = dataclasses.replace(c.es_config, population=M)
    strategy = es_method.compiled_strategy(es_cfg, c.optimizer, mesh)  # the trainer's jitted ask / tell
    shardings = es_method.state_shardings(es_cfg, c.optimizer, mesh, masters)  # as the trainer lays the state out
    state = jax.jit(strategy.init, out_shardings=shardings)(masters, parallel.put_replicated(mesh, jax.random.key(0)))
    compute = sharding.caster(mesh, c.model.dtype)(masters)
    prompt_BxP = jnp.asarray(np.tile(_prompts(cfg, X, prompt, 1), (M, 1)))
    perturb = Perturbation(strategy.ask(state, compute), jnp.repeat(jnp.arange(M, dtype=jnp.int32), X))
    key = jax.random.key(1)

    temperature = c.train.temperature  # the ES members' (0: greedy)
    prefill, decode = _generate_phases(
        cfg, compute, prompt_BxP, key, new, reps, temperature=temperature, perturb=perturb
    )
    del compute, perturb
    fitness = parallel.put_replicated(mesh, np.random.default_rng(0).normal(size=M).astype(np.float32))
    carry = [masters, state]

    def tell():
        p, s, metrics = strategy.tell(carry[0], carry[1], fitness)
        carry[:] = [p, s]
        return metrics

    # tell donates its inputs: each call takes the last one's outputs. A call is seconds where a generate round is a
    # minute, so the update is timed over more calls than the rounds.
    update_s = _seconds(tell, max(reps, ES_UPDATE_CALLS))
    update = statistics.median(update_s)
    kinds = es.strategy.leaf_kinds(es_cfg, masters)
    flat = es.noise.flatten(masters)
    matrices = [flat[path].shape[-2:] for path in kinds]
    layers = [np.prod(flat[path].shape[:-2], dtype=int) for path in kinds]
    io = sum(n * (a + b) for n, (a, b) in zip(layers, matrices))
    entries = sum(n * a * b for n, (a, b) in zip(layers, matrices))
    work = phase_work(
        cfg, rows, prompt, new, io, (entries, estimators.num_directions(es_cfg.method, es_cfg.population))
    )
    settings = {
        "es_members": M,
        "es_prompts": X,
        "es_method": c.method,
        "es_optimizer": c.optimizer.name,
        "es_update_calls_s": update_s,
    }
    return {"prefill": prefill, "decode": decode, "update": update}, work | {"settings": settings}


def _grpo_phases(cfg, masters, mesh, rows, prompt, new, reps) -> tuple[dict, dict]:
    c = from_config_dict(get_config("0.6b,grpo").to_dict())
    g = c.grpo
    X = rows // GRPO_GROUP
    compute = sharding.caster(mesh, c.model.dtype)(masters)
    prompt_BxP = jnp.asarray(np.repeat(_prompts(cfg, X, prompt, 2), GRPO_GROUP, axis=0))
    key = jax.random.key(2)

    prefill, decode = _generate_phases(cfg, compute, prompt_BxP, key, new, reps, temperature=g.temperature)
    gen = generate(cfg, compute, prompt_BxP, key, max_new_tokens=new, temperature=g.temperature)
    del compute
    U = g.microbatches
    b = rows // U
    mask_BxN = np.ones((rows, new), bool)
    fields = (
        np.asarray(prompt_BxP),
        np.ones((rows, prompt), bool),
        np.asarray(gen.tokens),
        mask_BxN,
        np.asarray(gen.logprobs),
        np.repeat(np.random.default_rng(0).normal(size=(rows, 1)).astype(np.float32), new, axis=1),  # per token
        np.asarray(grpo.token_weights(mask_BxN, g.aggregation)),
    )
    batch = grpo.Rollouts(*(jnp.asarray(x.reshape(U, b, *x.shape[1:])) for x in fields))
    shardings = grpo.state_shardings(g, c.optimizer, mesh, masters)
    state = jax.jit(lambda p: grpo.init_state(g, make_optimizer(c.optimizer), p), out_shardings=shardings)(masters)
    update = grpo.make_update(cfg, g, c.optimizer, mesh, c.model.dtype)
    on_policy = jnp.asarray(True)
    compiled = update.lower(masters, state, batch, on_policy).compile()  # the warm-up is compilation only
    carry = [masters, state]
    del masters, state

    def step():
        p, s, metrics = compiled(*carry, batch, on_policy)
        carry[:] = [p, s]
        return metrics

    times = _seconds(step, reps, warmup=False)
    work = phase_work(cfg, rows, prompt, new, 0, (0, 0))
    settings = {
        "grpo_prompts": X,
        "grpo_group_size": GRPO_GROUP,
        "grpo_microbatches": U,
        "grpo_remat": g.remat,
        "grpo_logprob_chunk": g.logprob_chunk,
        "grpo_optimizer": c.optimizer.name,
    }
    return {"prefill": prefill, "decode": decode, "update": statistics.median(times)}, work | {"settings": settings}


def realshape_step(args) -> dict:
    name = args.model or ("quick" if args.quick else "qwen3-0.6b")
    if name not in SHAPES:
        raise ValueError(f"unknown --model {name!r}; known: {', '.join(SHAPES)}")
    cfg = model_config(name)
    rows, prompt, new, reps = (8, 16, 32, 3) if args.quick else (ROWS, PROMPT, NEW, 1)  # 1 round: ~12 min on 2 cores
    mesh = parallel.make_mesh(1)  # one device: the roofline is one device's
    line = roofline(cfg, rows, prompt, (64 if args.quick else 1024) * 2**20, 1024 if args.quick else 4096)
    out = {"model": name, "rows": rows, "prompt_len": prompt, "new_tokens": new, "reps": reps}
    for method, phases in (("es", _es_phases), ("grpo", _grpo_phases)):
        masters = random_params(cfg, jnp.float32, seed=0)
        masters = sharding.place(masters, sharding.master_shardings(mesh, masters))  # the trainers' layout
        seconds, work = phases(cfg, masters, mesh, rows, prompt, new, reps)
        print(f"  {method}: " + ", ".join(f"{k} {v:.3g} s" for k, v in seconds.items()), flush=True)
        del masters
        out.update(work.pop("settings"))
        for phase, (flops, nbytes) in work.items():
            bound = max(flops / line["peak_flops"], nbytes / line["bandwidth"])
            out[f"{method}_{phase}_of_bound"] = bound / seconds[phase]
            out[f"{method}_{phase}_s"] = seconds[phase]
            out[f"{method}_{phase}_bound_s"] = bound
            out[f"{method}_{phase}_limited_by"] = (
                "flops" if flops / line["peak_flops"] >= nbytes / line["bandwidth"] else "bytes"
            )
            out[f"{method}_{phase}_gflop"] = flops / 1e9
            out[f"{method}_{phase}_gbytes"] = nbytes / 1e9
    worst = min((k for k in out if k.endswith("_of_bound")), key=out.get)
    return {
        "realshape_step": out[worst],
        "worst_phase": worst.removesuffix("_of_bound"),
        **out,
        "peak_gflops": line["peak_flops"] / 1e9,
        "peak_at": line["peak_flops_at"],
        "bandwidth_gbs": line["bandwidth"] / 1e9,
        "bandwidth_sum_gbs": line["bandwidth_sum"] / 1e9,
        "bandwidth_skinny_matmul_gbs": line["bandwidth_skinny_matmul"] / 1e9,
        "xla_axpy_gbs": line["bandwidth_xla_axpy"] / 1e9,
        "matmul_gflops": {k: v / 1e9 for k, v in line["matmul_flops"].items()},
        "backend": jax.default_backend(),
        "timing": "prefill: the fastest of the interleaved rounds of generate(1 token); decode: the fastest "
        "generate(new tokens) minus that; both after an ahead-of-time compile; updates: the median round (GRPO "
        "after an ahead-of-time compile; ES after a warm-up call, over at least ES_UPDATE_CALLS calls: "
        "es_update_calls_s); one round at full size",
    }


BENCHMARKS = {"realshape_step": realshape_step}
