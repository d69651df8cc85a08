"""Device check: generation throughput, ES and GRPO step times, compile times and peak memory of random Qwen3 models
in bfloat16, on the first device of the default backend.

    python -m experiments.device_check --json PATH [--quick] [--attention auto,xla]

Models: Qwen3-0.6B and Qwen3-8B at their real shapes, random weights drawn on the device (normal(0, 0.02) matrices,
ones for norm scales; nothing is downloaded). --quick: a two-layer model of small widths with few rows and tokens.
Each phase is called twice, and timed both times, once per `model.attention` setting asked for (`--attention`,
default auto: the platform's fused kernel, `esroll.models.attention`; "auto,xla" compares it with XLA's on the same
device):

  prefill    one cache-free forward over the prompts (the attention among new tokens: the fused kernel's work).
  generate   `esroll.sampling.generate`: greedy, no EOS, so every row decodes all `new_tokens` after its prompt.
  perturbed  the same, each row with its LOO-ROLL member's low-rank factors (`ask`), `rows_per_member` consecutive
             rows per member, as the trainer lays out a member's prompts and samples.
  looroll    one LOO-ROLL step: ask + perturbed generate + tell (fitness: a member's mean token log-probability;
             `ask` is compiled before the perturbed phase, so neither phase's compile_s counts it).
  grpo       one GRPO step: generate (the greedy program above) + `esroll.grpo.make_update` on its rows, with random
             advantages (the update's cost does not depend on their values).

Figures, per model and phase (all seconds are wall-clock, the outputs waited for):
  seconds       the second call: the run alone.
  first_call_s  the first call: compilation and a run.
  compile_s     first_call_s - seconds.
  tokens_per_s  rows * new_tokens / seconds (generation phases; the prompt's tokens are not counted); for the
                prefill, rows * prompt / seconds.
  max_abs_diff  (the "agreement" row, with two settings) the largest difference of the prefill's float32 logits at
                real tokens between the two kernels, on prompts with left and right padding, and `max_abs_logit`.
  decode_step_s (generation phases) the mean decode step: (seconds - the same call's seconds at 1 new token) /
                (new_tokens - 1), the 1-token call timed the same way (its own compile, not counted).
  decode_bytes  what a mean decode step must move: the weights it reads (layers, final norm, head), the KV cache
                slots its phase attends over (averaged over the steps), and, perturbed, the member factors.
  bandwidth_fraction  decode_bytes / decode_step_s / the device's peak memory bandwidth (`PEAK_BYTES_PER_S`:
                H200 4.8e12, H100 3.35e12, TPU v5 lite 819e9 B/s); None on other devices.
  peak_bytes    the device's "peak_bytes_in_use" after the phase: a maximum since the process began (JAX cannot
                reset it), so it bounds this phase's peak from above; None where the backend reports none (CPU).
  error, oom    why the phase failed, its figures then None, and whether by running out of memory; the run goes on
                (the exit status is 1 when a phase failed otherwise).
The JSON, written after each model, also holds the jax version, backend, device kind, the device's memory limit
("bytes_limit"; None on the CPU) and whether ml_collections / tensorboardX were imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import sys
import time
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp

import esroll.config
from esroll import es, grpo, parallel, sharding
from esroll.models import Perturbation, attention, forward, model_config, param_shapes
from esroll.sampling import generate

DTYPE = jnp.bfloat16
# Per model: rows (= LOO-ROLL members = GRPO rows), prompt and new tokens, GRPO microbatches, optimizer (SGD for 8B:
# no optimizer state, so that its steps fit an 80 GB device next to 16 GB of weights and their gradient).
PLANS = {
    "qwen3-0.6b": {
        "rows": 256,
        "prompt": 256,
        "new": 256,
        "microbatches": 4,
        "optimizer": "adam",
        "rows_per_member": 8,
    },
    "qwen3-8b": {"rows": 256, "prompt": 256, "new": 256, "microbatches": 16, "optimizer": "sgd", "rows_per_member": 8},
}
QUICK = {"tiny": {"rows": 4, "prompt": 16, "new": 8, "microbatches": 2, "optimizer": "adam", "rows_per_member": 2}}
PEAK_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "TPU v5 lite": 819e9}  # by device_kind substring


def config_class(name: str) -> type:
    """A config dataclass wherever it lives (the ES and GRPO ones may move into esroll.config)."""
    return next(getattr(m, name) for m in (es, grpo, esroll.config) if hasattr(m, name))


def model(name: str):
    if name == "tiny":
        small = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "num_kv_heads": 2}
        return dataclasses.replace(model_config("qwen3-0.6b", layers=2), **small, head_dim=16)
    return model_config(name)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _leaf(key, shape: tuple, kind: str):
    if kind == "norm":
        return jnp.ones(shape, DTYPE)
    if kind == "bias":
        return jnp.zeros(shape, DTYPE)
    return 0.02 * jax.random.normal(key, shape, DTYPE)


def random_params(cfg) -> dict:
    """make_random_model's initialisation rules, drawn on the device."""

    def build(tree, path=""):
        if isinstance(tree, dict):
            return {k: build(v, f"{path}/{k}") for k, v in tree.items()}
        kind = "norm" if path.endswith("norm") else "bias" if path.endswith("bias") else "matrix"
        return _leaf(jax.random.key(zlib.crc32(path.encode())), tuple(tree), kind)

    return build(param_shapes(cfg))


def memory_stat(name: str) -> int | None:
    return (jax.devices()[0].memory_stats() or {}).get(name)


def measure(fn) -> dict:
    """Call `fn` twice, waiting for its outputs; the first call compiles."""
    times = []
    for _ in range(2):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return {"first_call_s": times[0], "seconds": times[1], "compile_s": times[0] - times[1]}


def peak_bytes_per_s(device_kind: str) -> float | None:
    return next((v for k, v in PEAK_BYTES_PER_S.items() if k in device_kind), None)


def decode_bytes(cfg, params, rows: int, prompt: int, new: int, deltas=None) -> float:
    """What a mean decode step of `generate` must move (see the module docstring): the weights in the decoding dtype,
    the KV cache slots each step's phase attends over (`esroll.sampling._phase_ends`), averaged over the steps, and
    the factors of every member (one device holds all the rows, so every member is among them)."""
    from esroll.sampling import _phase_ends

    item = jnp.dtype(DTYPE).itemsize
    head = params["embed"] if cfg.tie_word_embeddings else params["lm_head"]
    weights = sum(x.size for x in jax.tree.leaves(params["layers"])) + params["final_norm"].size + head.size
    ends = _phase_ends(new)
    slots = sum((end - start) * (prompt - 1 + end) for start, end in zip([0, *ends], ends)) / new
    slot = 2 * cfg.num_layers * rows * cfg.num_kv_heads * cfg.head_dim * item
    factors = 0 if deltas is None else sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(deltas))
    return weights * item + slots * slot + factors


def check_model(name: str, plan: dict, setting: str = "auto") -> list[dict]:
    mesh = parallel.make_mesh(1)
    cfg = dataclasses.replace(model(name), attention=attention.choose(setting, mesh))
    B, P, N, U = plan["rows"], plan["prompt"], plan["new"], plan["microbatches"]
    R = plan["rows_per_member"]
    params = random_params(cfg)
    params = sharding.place(params, sharding.master_shardings(mesh, params))  # as the update returns them
    prompt = jax.random.randint(jax.random.key(1), (B, P), 1, cfg.vocab_size, jnp.int32)
    prompt_mask = jnp.ones((B, P), bool)

    def gen(params, perturb=None, new=N):
        return generate(
            cfg, params, prompt, jax.random.key(2), max_new_tokens=new, temperature=0.0, eos_ids=(),
            prompt_mask=prompt_mask, perturb=perturb, pad_id=0, row_offset=0,
        )  # fmt: skip

    optim = config_class("OptimConfig")(name=plan["optimizer"], lr=1e-6)
    optimizer = esroll.config.make_optimizer(optim)
    es_cfg = config_class("ESConfig")(method="looroll", population=B // R, rank=1, sigma=1e-3)

    def constrain(tree):  # the update comes out in the layout its inputs came in, so step 2 reuses step 1's program
        return jax.lax.with_sharding_constraint(tree, sharding.master_shardings(mesh, tree))

    strategy = es.make_strategy(es_cfg, optimizer, constrain=constrain)
    ask = jax.jit(strategy.ask)
    tell = jax.jit(strategy.tell, donate_argnums=(0, 1))  # updates params in place
    member_B = jnp.repeat(jnp.arange(B // R), R)
    es_state = jax.device_put(strategy.init(params, jax.random.key(3)), parallel.replicated(mesh))  # as tell's
    carry = {"params": params, "es": es_state}
    deltas = ask(carry["es"], params)  # the perturbed phase times generate alone; looroll times its own ask
    del params

    def looroll():
        deltas = ask(carry["es"], carry["params"])
        fitness_M = gen(carry["params"], Perturbation(deltas, member_B)).logprobs.mean(1).reshape(-1, R).mean(1)
        carry["params"], carry["es"], metrics = tell(carry["params"], carry["es"], fitness_M)
        return metrics

    g = config_class("GRPOConfig")(group_size=8, microbatches=U)
    update = grpo.make_update(cfg, g, optim, mesh, "bfloat16")

    def grpo_step():
        if "grpo" not in carry:
            layout = grpo.state_shardings(g, optim, mesh, carry["params"])
            carry["grpo"] = jax.jit(functools.partial(grpo.init_state, g, optimizer), out_shardings=layout)(
                carry["params"]
            )
        out = gen(carry["params"])
        mask_BxN = jnp.ones((B, N), bool)
        advantage_B = jax.random.normal(jax.random.key(4), (B,), jnp.float32)
        advantage_BxN = jnp.broadcast_to(advantage_B[:, None], (B, N))  # per token, as the trainer passes it
        fields = (prompt, prompt_mask, out.tokens, mask_BxN, out.logprobs, advantage_BxN)
        fields += (grpo.token_weights(mask_BxN, g.aggregation),)
        batch = grpo.Rollouts(*(x.reshape(U, B // U, *x.shape[1:]) for x in fields))
        carry["params"], carry["grpo"], metrics = update(carry["params"], carry["grpo"], batch, jnp.asarray(True))
        return metrics

    prefill = jax.jit(lambda p: forward(cfg, p, prompt, mask_BxT=prompt_mask, return_hidden=True)[0])
    phases = {
        "prefill": lambda: prefill(carry["params"]),
        "generate": lambda new=N: gen(carry["params"], new=new).tokens,
        "perturbed": lambda new=N: gen(carry["params"], Perturbation(deltas, member_B), new=new).tokens,
        "looroll": looroll,
        "grpo": grpo_step,
    }
    rows = []
    for phase, fn in phases.items():
        row = {"model": name, "phase": phase, "rows": B, "prompt": P, "new_tokens": N, "optimizer": plan["optimizer"]}
        row["attention"] = cfg.attention.kernel
        row |= {"seconds": None, "first_call_s": None, "compile_s": None, "tokens_per_s": None}
        row |= {"decode_step_s": None, "decode_bytes": None, "bandwidth_fraction": None}
        row |= {"error": None, "oom": False}
        print(f"{name} {phase} ...", flush=True)
        try:
            row |= measure(fn)
            if phase == "prefill":
                row["tokens_per_s"] = B * P / row["seconds"]
            if phase in ("generate", "perturbed"):
                row["tokens_per_s"] = B * N / row["seconds"]
                row["decode_step_s"] = (row["seconds"] - measure(lambda: fn(1))["seconds"]) / (N - 1)
                row["decode_bytes"] = decode_bytes(
                    cfg, carry["params"], B, P, N, deltas if phase == "perturbed" else None
                )
                peak = peak_bytes_per_s(jax.devices()[0].device_kind)
                row["bandwidth_fraction"] = peak and row["decode_bytes"] / row["decode_step_s"] / peak
        except Exception as e:  # noqa: BLE001 — out of memory, above all: recorded, and the next phase runs
            row["error"] = f"{type(e).__name__}: {str(e)[:1000]}"
            row["oom"] = "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()
            print(f"  failed: {row['error']}", flush=True)
        gc.collect()
        row["peak_bytes"] = memory_stat("peak_bytes_in_use")
        rows.append(row)
    return rows


def agreement(name: str, plan: dict, settings: list[str]) -> dict:
    """The prefill's float32 logits under the first two settings' kernels, on the same random model and prompts
    (rows with left and with right padding), compared at the real tokens."""
    mesh = parallel.make_mesh(1)
    B, P = min(plan["rows"], 8), plan["prompt"]
    cfgs = [dataclasses.replace(model(name), attention=attention.choose(s, mesh)) for s in settings[:2]]
    params = random_params(cfgs[0])
    prompt = jax.random.randint(jax.random.key(1), (B, P), 1, cfgs[0].vocab_size, jnp.int32)
    mask = jnp.ones((B, P), bool).at[1::2, : P // 3].set(False).at[2::2, P - P // 4 :].set(False)
    logits = [jax.jit(lambda p, c=c: forward(c, p, prompt, mask_BxT=mask)[0])(params) for c in cfgs]
    diff = jnp.where(mask[:, :, None], jnp.abs(logits[0] - logits[1]), 0).max()
    row = {"model": name, "phase": "agreement", "rows": B, "prompt": P, "new_tokens": 0, "optimizer": None}
    row |= {"attention": "/".join(c.attention.kernel for c in cfgs), "seconds": None, "first_call_s": None}
    row |= {"compile_s": None, "tokens_per_s": None, "decode_step_s": None, "decode_bytes": None}
    row |= {"bandwidth_fraction": None, "error": None, "oom": False, "peak_bytes": None}
    row |= {
        "max_abs_diff": float(diff),
        "max_abs_logit": float(jnp.where(mask[:, :, None], jnp.abs(logits[1]), 0).max()),
    }
    return row


def table(rows: list[dict]) -> str:
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    lines = [
        f"{'model':<11} {'phase':<10} {'kernel':<12} {'rows':>5} {'seconds':>9} {'compile_s':>9} {'tokens/s':>10} "
        f"{'step ms':>8} {'of peak BW':>10} {'peak GiB':>8}"
    ]
    for r in rows:
        peak = None if r["peak_bytes"] is None else r["peak_bytes"] / 2**30
        step = None if r["decode_step_s"] is None else r["decode_step_s"] * 1e3
        cells = [num(r["seconds"], ".3f"), num(r["compile_s"], ".2f"), num(r["tokens_per_s"], ",.0f")]
        cells += [num(step, ".3f"), num(r["bandwidth_fraction"], ".2f"), num(peak, ".1f")]
        line = (
            f"{r['model']:<11} {r['phase']:<10} {r['attention']:<12} {r['rows']:>5} {cells[0]:>9} {cells[1]:>9} "
            f"{cells[2]:>10} {cells[3]:>8} {cells[4]:>10} {cells[5]:>8}"
        )
        if r["phase"] == "agreement":
            line += f"  max |logit difference| {r['max_abs_diff']:.3g} of max |logit| {r['max_abs_logit']:.3g}"
        lines.append(line + (f"  {r['error'][:60]}" if r["error"] else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # read when the backend starts, below
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, required=True, help="write the figures here")
    parser.add_argument("--quick", action="store_true", help="a tiny model, for a CPU smoke run")
    parser.add_argument("--attention", default="auto", help="model.attention settings to run, comma-separated")
    args = parser.parse_args(argv)
    settings = [s for s in args.attention.split(",") if s]
    unknown = sorted(set(settings) - set(attention.SETTINGS))
    if unknown or not settings:
        parser.error(f"--attention: {', '.join(unknown) or 'none given'}; each one of {', '.join(attention.SETTINGS)}")
    start = time.perf_counter()
    device = jax.devices()[0]
    report = {
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "bytes_limit": memory_stat("bytes_limit"),
        "quick": args.quick,
        "attention": settings,
        "results": [],
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    for name, plan in (QUICK if args.quick else PLANS).items():
        for setting in settings:
            report["results"] += check_model(name, plan, setting)
            gc.collect()  # the model's weights go before the next one's arrive
        if len(settings) > 1:
            report["results"].append(agreement(name, plan, settings))
            gc.collect()
        report["total_s"] = time.perf_counter() - start
        report["imported"] = {m: sys.modules.get(m) is not None for m in ("ml_collections", "tensorboardX")}
        args.json.write_text(json.dumps(report, indent=2))
    print(f"{report['device_kind']} ({report['backend']}), jax {report['jax_version']}, {report['total_s']:.0f} s")
    print(table(report["results"]))
    return report


if __name__ == "__main__":
    sys.exit(any(r["error"] and not r["oom"] for r in main()["results"]))
