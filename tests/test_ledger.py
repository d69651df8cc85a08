"""esroll.ledger against XLA's own FLOP count of the esroll programs, and against hand computations.

XLA's count (`compiled.cost_analysis()["flops"]`) includes the elementwise ops the ledger leaves out (norms, RoPE,
softmax, SiLU, masking, one FLOP per element per op), so it lies above the ledger by a few percent at these widths:
the check is ledger ≤ XLA ≤ (1 + TOL)·ledger. The matrix products alone are compared exactly, summed from the
optimized HLO's dot instructions. A rolled `lax.scan` body is counted once by cost_analysis whatever the layer
count, so the programs are compiled with their layer scan unrolled (`unroll=L`), and the per-layer increment from
1 to 2 layers is checked as well.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest

from esroll import ledger
from esroll.es import noise
from esroll.models import KVCache, LowRank, ModelConfig, Perturbation, forward, param_shapes
from esroll.scoring import sequence_logprobs

TOL = 0.05  # XLA's elementwise FLOPs are 1.2-2.6% of the total for these configs, forward and backward

FAMILIES = {
    "qwen3": {"qk_norm": True},  # grouped-query attention, q/k norms, untied head
    "qwen2": {"qkv_bias": True, "tie_word_embeddings": True},
    "llama": {"o_bias": True, "qkv_bias": True},
}


def config(family: str, layers: int) -> ModelConfig:
    return ModelConfig(
        family=family, vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=layers, num_heads=4,
        num_kv_heads=2, head_dim=32, **FAMILIES[family],
    )  # fmt: skip


def abstract_params(cfg: ModelConfig) -> dict:
    shapes = noise.flatten(param_shapes(cfg))
    return noise.unflatten({path: jax.ShapeDtypeStruct(shape, jnp.float32) for path, shape in shapes.items()})


def compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile()


def xla_flops(c) -> float:
    analysis = c.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # some versions and platforms: one dict per program
        analysis = analysis[0]
    return float(analysis["flops"])


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\w+\[([\d,]*)\]")


def dot_flops(c) -> int | None:
    """2·(output elements)·(contracted size) summed over the dot instructions of the optimized HLO text; None if the
    text has none in the form parsed here (another XLA version may print or rewrite them differently)."""
    shapes, total, found = {}, 0, False
    lines = c.as_text().splitlines()
    for line in lines:
        if m := _INSTRUCTION.match(line):
            shapes[m.group(1)] = [int(x) for x in m.group(2).split(",") if x]
    for line in lines:
        if " dot(" not in line or not (m := _INSTRUCTION.match(line)):
            continue
        operand = re.search(r"dot\((?:\w+\[([\d,]*)\]\S*\s+)?%?([\w.\-]+)", line)
        lhs = [int(x) for x in operand.group(1).split(",") if x] if operand.group(1) is not None else None
        lhs = lhs if lhs is not None else shapes[operand.group(2)]
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line).group(1)
        k = math.prod(lhs[int(d)] for d in contracting.split(",") if d)
        total += 2 * math.prod(shapes[m.group(1)]) * k
        found = True
    return total if found else None


def check(c, expected: int, what: str):
    """XLA's matmul FLOPs equal `expected` exactly; its total lies within [expected, (1 + TOL)·expected]."""
    dots, total = dot_flops(c), xla_flops(c)
    if dots is not None:
        assert dots == expected, f"{what}: XLA's dot FLOPs {dots}, ledger {expected}"
    assert expected <= total <= (1 + TOL) * expected, (
        f"{what}: XLA {total:.0f}, ledger {expected} ({total / expected - 1:+.2%})"
    )
    return total


B, T = 2, 16


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_flops_match_xla(family):
    """The full-sequence forward at 1 and 2 layers, and the 2-layer minus 1-layer increment. XLA runs dense
    attention (T² pairs), so the ledger is taken with causal=False; causal=True counts T(T+1)/2 pairs."""
    totals = {}
    for layers in (1, 2):
        cfg = config(family, layers)
        tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)
        c = compiled(lambda p, x, cfg=cfg: forward(cfg, p, x, unroll=cfg.num_layers)[0], abstract_params(cfg), tokens)
        totals[layers] = (check(c, ledger.forward_flops(cfg, B, T, causal=False), f"{family} L={layers}"), cfg)
    (one, cfg1), (two, cfg2) = totals[1], totals[2]
    per_layer = ledger.forward_flops(cfg2, B, T, causal=False) - ledger.forward_flops(cfg1, B, T, causal=False)
    assert per_layer == B * T * ledger.layer_flops_per_token(cfg1) + ledger.attention_flops(cfg1, B, T, causal=False)
    assert per_layer <= two - one <= (1 + TOL) * per_layer
    dense_minus_causal = ledger.forward_flops(cfg1, B, T, causal=False) - ledger.forward_flops(cfg1, B, T)
    assert dense_minus_causal == 4 * cfg1.num_heads * cfg1.head_dim * B * (T * T - T * (T + 1) // 2)


def test_perturbed_forward_and_decode_step_match_xla():
    """A rank-2 member perturbation of every layer matrix (2·r·(I+O) per matrix and token), and one KV-cache decode
    step over a cache of S slots (dense over the buffer: S pairs per row; the ledger's causal decode counts the
    filled ones)."""
    cfg, rank, members = config("qwen3", 2), 2, 3
    params = abstract_params(cfg)
    shapes = noise.flatten(param_shapes(cfg))
    deltas = {
        name: LowRank(
            jax.ShapeDtypeStruct((cfg.num_layers, members, shapes[f"layers/{name}"][1], rank), jnp.float32),
            jax.ShapeDtypeStruct((cfg.num_layers, members, shapes[f"layers/{name}"][2], rank), jnp.float32),
        )
        for name in ("q", "k", "v", "o", "gate", "up", "down")
    }
    perturb = Perturbation({"layers": deltas}, jax.ShapeDtypeStruct((B,), jnp.int32))
    run = lambda p, x, d: forward(cfg, p, x, perturb=d, unroll=cfg.num_layers)[0]
    c = compiled(run, params, jax.ShapeDtypeStruct((B, T), jnp.int32), perturb)
    check(c, ledger.forward_flops(cfg, B, T, causal=False, perturb_rank=rank), "perturbed forward")

    S = 24
    shape = (cfg.num_layers, B, cfg.num_kv_heads, S, cfg.head_dim)
    cache = KVCache(
        jax.ShapeDtypeStruct(shape, jnp.float32),
        jax.ShapeDtypeStruct(shape, jnp.float32),
        jax.ShapeDtypeStruct((B, S), bool),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    step = lambda p, x, kv: forward(cfg, p, x, cache=kv, unroll=cfg.num_layers)[0]
    c = compiled(step, params, jax.ShapeDtypeStruct((B, 1), jnp.int32), cache)
    # The step's query reads the cache's S slots (the one it writes among them, masked) and its own new key; the
    # value sum over that one new key contracts a length-1 axis, which XLA rewrites as a product, not a dot.
    new_value_sum = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * B
    expected = (
        B * ledger.layer_flops_per_token(cfg) + ledger.attention_flops(cfg, B, 1, S, causal=False) - new_value_sum
    )
    check(c, expected + ledger.head_flops(cfg, B, 1), "decode step")


@pytest.mark.parametrize("remat", [None, "full", "dots"])
def test_train_flops_match_xla(remat):
    """The gradient of a loss of `sequence_logprobs` (GRPO's scoring pass): 3× its forward, plus what `remat`
    recomputes."""
    cfg, P, N = config("qwen3", 1), 8, 8
    abstract = (
        abstract_params(cfg),
        jax.ShapeDtypeStruct((B, P), jnp.int32),
        jax.ShapeDtypeStruct((B, P), bool),
        jax.ShapeDtypeStruct((B, N), jnp.int32),
        jax.ShapeDtypeStruct((B, N), bool),
    )

    def loss(*args):
        return sequence_logprobs(cfg, *args, remat=remat, unroll=cfg.num_layers).sum()

    forward_only = ledger.forward_flops(cfg, B, P + N, head_positions=N, causal=False)
    check(compiled(loss, *abstract), forward_only, "scoring forward")
    expected = ledger.train_flops(cfg, B, P, N, causal=False, remat=remat)
    assert (expected == 3 * forward_only) == (remat is None)
    check(compiled(jax.grad(loss), *abstract), expected, f"gradient, remat={remat}")


def test_generate_flops_by_hand():
    """D = 8, F = 16, Q = 2 query heads, K = 1, H = 4, V = 10, L = 3; 2 rows, prompt 5, 3 new tokens.

    Per token and layer: q 2·8·8 = 128, k and v 2·8·4 = 64 each, o 128, gate and up 2·8·16 = 256 each, down 256:
    1152, so 3456 over 3 layers. Attention: 4·L·Q·H = 96 per (query, key) pair. Head: 2·8·10 = 160.
    Prefill: 4 tokens per row, 2·4·3456 = 27648, and 1 + 2 + 3 + 4 = 10 pairs per row, 96·2·10 = 1920: 29568.
    Decode: 3 steps per row of 3456 + 160, 2·3·3616 = 21696, attending over 5, 6, 7 slots, 96·2·18 = 3456: 25152.
    """
    cfg = ModelConfig(
        family="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=3, num_heads=2,
        num_kv_heads=1, head_dim=4, tie_word_embeddings=True,
    )  # fmt: skip
    assert ledger.layer_flops_per_token(cfg) == 3456
    assert ledger.prefill_flops(cfg, 2, 5) == 29568
    assert ledger.decode_flops(cfg, 2, 5, 3) == 25152
    assert ledger.generate_flops(cfg, 2, 5, 3) == 29568 + 25152
    # With a cache every position runs once: the causal forward over P + N − 1 positions, the head at N of them.
    assert ledger.generate_flops(cfg, 2, 5, 3) == ledger.forward_flops(cfg, 2, 7, head_positions=3)
    # Rank 1 on every layer matrix: 2·(I + O) each, q 32, k and v 24, o 32, gate and up 48, down 48: 256 per layer.
    assert ledger.layer_flops_per_token(cfg, perturb_rank=1) == 3456 + 3 * 256
    assert ledger.generate_flops(cfg, 2, 5, 3, perturb_rank=1) == 29568 + 25152 + 2 * 7 * 3 * 256
    # Training on prompt + completion: 3 × (2·8·3456 + 96·2·36 + 2·3·160).
    assert ledger.train_flops(cfg, 2, 5, 3) == 3 * (55296 + 6912 + 960)
    with pytest.raises(ValueError, match="non-negative integer"):
        ledger.generate_flops(cfg, 2, -1, 3)
    with pytest.raises(ValueError, match="remat"):
        ledger.train_flops(cfg, 2, 5, 3, remat="some")
