"""The decoder as one pure function: forward(cfg, params, tokens, ...) -> (logits, cache).

Parameters are a dict; per-layer weights are stacked on a leading layer axis, under the top-level key `STACKED`,
and the layers run under `lax.scan` in every use (training, scoring, prefill, decode), so compile time does not
grow with depth and every platform runs the same program. The KV cache is layer-stacked too (`KVCache`). Weights are
stored [I, O] (the transpose of torch's Linear).

    embed [V, D]; final_norm [D]; lm_head [D, V] (untied only)
    layers: attn_norm [L, D], q [L, D, Q·H], k/v [L, D, K·H], o [L, Q·H, D],
            q_bias/k_bias/v_bias (Qwen2), o_bias (Llama attention_bias), q_norm/k_norm [L, H] (Qwen3),
            mlp_norm [L, D], gate/up [L, D, F], down [L, F, D]

(Shape letters: see `esroll`.)
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from esroll.models.attention import self_attention, token_padding
from esroll.models.config import ModelConfig
from esroll.models.layers import STACKED, Perturbation, linear, rms_norm, rope, rope_tables, row_vector

Array = jax.Array
# Per-layer rematerialisation of `forward` without a cache (training), by name: what the backward pass keeps of each
# layer. "none": everything autodiff saves (all layers' float32 attention scores included: the largest buffers);
# "full": only the layer's input, the residual stream [B, T, D] (the layer is recomputed in the backward pass);
# "dots": the weight matmuls' outputs too (norms, attention and activations are recomputed).
REMAT_POLICIES = ("none", "full", "dots")


def _remat(body, remat: str | None, unroll: int):
    """`body` (one scanned layer) under `jax.checkpoint` with the policy named `remat` (see REMAT_POLICIES)."""
    if remat in (None, "none"):
        return body
    if remat == "full":
        policy = None  # jax.checkpoint's default: save nothing but the inputs
    elif remat == "dots":
        policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    else:
        raise ValueError(f"unknown remat policy {remat!r}; known: {', '.join(REMAT_POLICIES)}")
    # Under a rolled lax.scan XLA cannot merge the recomputation with the forward pass (the case the optimisation
    # barrier guards against), so the barrier would only cost time; an unrolled scan's iteration holds several
    # layers, in which it could, so there it stays.
    return jax.checkpoint(body, policy=policy, prevent_cse=unroll > 1)


class KVCache(NamedTuple):
    """Keys and values of every slot written so far, one layer-stacked buffer each. All rows share the write index
    (prompts are left-padded).

    Both are [L, B, K, S, H], kv heads before slots: layer i's [B, K, S, H] is the operand both of `attend`'s
    products take as it lies (batched over B and K), and the slots are the long axis of each head's [S, H] matrix
    (a few kv heads as the second-minor axis would be padded to the tile's height on a TPU). `forward` hands the
    stacked buffers to its layer scan as read-only inputs, so layer i reads its slice where it lies (as it reads its
    weights), and writes the T new slots of every layer once, after the scan, in place.
    """

    k: Array  # [L, B, K, S, H]
    v: Array  # [L, B, K, S, H]
    valid_BxS: Array  # bool: slot holds a real (non-pad) token
    index: Array  # int32 scalar: next slot to write


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """An empty cache of `max_len` slots (see `KVCache`)."""
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        valid_BxS=jnp.zeros((batch, max_len), bool),
        index=jnp.zeros((), jnp.int32),
    )


def forward(
    cfg: ModelConfig,
    params: dict,
    tokens_BxT: Array,
    *,
    mask_BxT: Array | None = None,
    positions_BxT: Array | None = None,
    cache: KVCache | None = None,
    perturb: Perturbation | None = None,
    remat: str | None = None,
    return_hidden: bool = False,
    layer_params=None,
    unroll: int = 1,
    attend_slots: int | None = None,
) -> tuple[Array, KVCache | None]:
    """Logits [B, T, V] in float32, and the updated cache (None without one).

    One form for every use (training, scoring, prefill, decode) and every platform: the layers run under
    `lax.scan` over the layer-stacked weights, `unroll` layers per iteration (the scan's `unroll`: the program
    grows with it, the values do not change). With a cache the scan reads it as an input: layer i attends over its
    own cached slots (read where they lie, as its weights are) and its T new keys and values, and returns those
    (the scan's outputs: [L, B, K, T, H], a decode step's are small); after the scan they are written into the
    cache once, in place. Nothing is written into a buffer the scan is still reading, so no layer's slice of the
    cache has to be copied before its products.

    A member-level perturbation (`perturb.member_B` set) is gathered into per-row factors once here
    (`Perturbation.per_row`), before the scan; per-row factors and member tables (`Perturbation.tables`, what
    `esroll.sampling.generate` builds once per call, before its decode loop) are used as they are.

    `layer_params` (no cache only) maps each layer's weights inside the scan before the layer uses them: GRPO passes
    a sharding constraint that all-gathers one layer's FSDP shards at a time (and whose transpose reduce-scatters that
    layer's gradient), so no device ever holds every layer's full weights or gradients at once.

    With `return_hidden`, the final-normed hidden states [B, T, D] (model dtype) instead of the logits: a caller
    that needs only some positions' logits (`esroll.scoring.sequence_logprobs`) applies `head` to those, in chunks,
    and never holds the [B, T, V] float32 buffer. `remat` (no cache only; a name in REMAT_POLICIES, None = "none")
    rematerialises each scanned layer for the backward pass, so that what is saved per layer is the residual stream
    ("full") or it and the weight matmuls' outputs ("dots"), never the attention scores.

    mask_BxT marks real tokens (False for padding); positions default to the count of real tokens before each one,
    which is right for left-padded prompts and for decoding after them. With a cache, the T new tokens are written at
    slots [index, index + T) and attend to every valid earlier slot among the cache's first `attend_slots` (static;
    None: all of them, or none when the cache has exactly T slots, which is then being filled from its start). A
    caller that knows no slot past some S is filled yet passes S, and the step reads S slots of a larger cache; 0
    reads none (a prefill into an empty cache).
    """
    B, T = tokens_BxT.shape
    if remat not in (None, "none") and cache is not None:
        raise ValueError("forward: remat applies to the cache-free (training) path only")
    if attend_slots is not None and (cache is None or not 0 <= attend_slots <= cache.k.shape[3]):
        raise ValueError(f"forward: attend_slots = {attend_slots} needs a cache of at least as many slots")
    if (return_hidden or layer_params is not None) and cache is not None:
        raise ValueError("forward: return_hidden and layer_params apply to the cache-free path only")
    mask_BxT = jnp.ones((B, T), bool) if mask_BxT is None else mask_BxT.astype(bool)
    seen_B = jnp.zeros((B,), jnp.int32) if cache is None else cache.valid_BxS.sum(-1).astype(jnp.int32)
    num_positions = None  # an upper bound on positions, when known while tracing
    if positions_BxT is None:
        positions_BxT = jnp.maximum(seen_B[:, None] + jnp.cumsum(mask_BxT, -1) - 1, 0)
        num_positions = T if cache is None else cache.valid_BxS.shape[1]

    # The T new tokens see the real ones among themselves up to their own position; with a cache, also every valid
    # earlier slot among the first `attend_slots` (a slot at or past the write index is not valid yet).
    visible_BxTxT = mask_BxT[:, None, :] & jnp.tril(jnp.ones((T, T), bool))[None]
    if cache is not None and attend_slots is None:
        attend_slots = 0 if cache.valid_BxS.shape[1] == T else cache.valid_BxS.shape[1]
    reads_cache = bool(attend_slots)
    visible_BxTxS = cache.valid_BxS[:, None, :attend_slots] if reads_cache else None

    # A kernel that attends in blocks of tokens (splash) gets them padded once, here, to its multiple (padding after
    # every real token, which no real token sees), not each layer's queries, keys and values; sliced off after.
    pad = 0 if reads_cache else token_padding(cfg.attention, T)
    ids_BxU, real_BxU, positions_BxU = tokens_BxT, mask_BxT, positions_BxT
    if pad:
        ids_BxU, real_BxU = (jnp.pad(a, ((0, 0), (0, pad))) for a in (tokens_BxT, mask_BxT))
        positions_BxU = jnp.pad(positions_BxT, ((0, 0), (0, pad)), mode="edge")

    perturb = None if perturb is None else perturb.per_row()
    deltas = {} if perturb is None else perturb.deltas
    index_B = None if perturb is None else perturb.index_B
    vector = functools.partial(row_vector, index_B=index_B)
    x_BxTxD = params["embed"][ids_BxU]
    cos_sin = rope_tables(positions_BxU, cfg.inv_freq(), num_positions, x_BxTxD.dtype)
    gather = layer_params or (lambda p: p)  # e.g. FSDP: gather this layer's weights only, as it runs

    def layer(x_BxTxD, xs):
        p, d, old = xs
        p = gather(p)
        if old is not None and attend_slots < old[0].shape[2]:  # the slots read, sliced where they lie
            old = tuple(x[:, :, :attend_slots] for x in old)
        h_BxTxD = rms_norm(x_BxTxD, vector(p["attn_norm"], d.get("attn_norm")), cfg.rms_norm_eps)
        h_BxTxD, new = _attention(cfg, p, d, index_B, h_BxTxD, cos_sin, real_BxU, visible_BxTxT, old, visible_BxTxS)
        x_BxTxD = x_BxTxD + h_BxTxD
        h_BxTxD = rms_norm(x_BxTxD, vector(p["mlp_norm"], d.get("mlp_norm")), cfg.rms_norm_eps)
        gate_BxTxF = linear(h_BxTxD, p["gate"], d.get("gate"), index_B)
        up_BxTxF = linear(h_BxTxD, p["up"], d.get("up"), index_B)
        x_BxTxD = x_BxTxD + linear(jax.nn.silu(gate_BxTxF) * up_BxTxF, p["down"], d.get("down"), index_B)
        return x_BxTxD, new if cache is not None else None

    old = (cache.k, cache.v) if reads_cache else None
    x_BxTxD, new = jax.lax.scan(
        _remat(layer, remat, unroll), x_BxTxD, (params[STACKED], deltas.get(STACKED) or {}, old), unroll=unroll
    )
    if pad:
        x_BxTxD = x_BxTxD[:, :T]
        new = None if new is None else tuple(n[:, :, :, :T] for n in new)
    x_BxTxD = rms_norm(x_BxTxD, vector(params["final_norm"], deltas.get("final_norm")), cfg.rms_norm_eps)
    if return_hidden:
        return x_BxTxD, None
    if cfg.head != "lm":
        raise ValueError("forward: a value model has no vocabulary head (its values: esroll.critic.values)")
    logits_BxTxV = head(cfg, params, x_BxTxD, perturb)
    if cache is None:
        return logits_BxTxV, None
    if cache.k.shape[3] != T:  # every layer's T new slots, [L, B, K, T, H], written in place at the index
        at = (0, 0, 0, cache.index, 0)
        k, v = (jax.lax.dynamic_update_slice(c, n.astype(c.dtype), at) for c, n in zip((cache.k, cache.v), new))
    else:  # the T new slots are the whole cache
        k, v = (n.astype(c.dtype) for c, n in zip((cache.k, cache.v), new))
    valid_BxS = jax.lax.dynamic_update_slice(cache.valid_BxS, mask_BxT, (0, cache.index))
    return logits_BxTxV, KVCache(k, v, valid_BxS=valid_BxS, index=cache.index + T)


def head(cfg: ModelConfig, params: dict, x_BxTxD: Array, perturb: Perturbation | None = None) -> Array:
    """Logits [B, T, V] in float32 of final-normed hidden states: x·embedᵀ when the embedding is tied, else
    x·lm_head (with the perturbation's head deltas, if any). T may be any slice of positions."""
    if cfg.tie_word_embeddings:
        logits_BxTxV = jnp.einsum("btd,vd->btv", x_BxTxD, params["embed"])
    else:
        deltas = {} if perturb is None else perturb.deltas
        index_B = None if perturb is None else perturb.index_B
        logits_BxTxV = linear(x_BxTxD, params["lm_head"], deltas.get("lm_head"), index_B)
    return logits_BxTxV.astype(jnp.float32)


def _attention(cfg, p, d, index_B, h_BxTxD, cos_sin, mask_BxT, visible_BxTxT, old, visible_BxTxS):
    """Grouped-query attention of one layer (weights p, deltas d indexed by `index_B`) over its T new tokens
    (`visible_BxTxT`) and, when `old` holds the layer's cached keys and values ([B, K, S, H] each), over those slots
    too (`visible_BxTxS`).

    Returns [B, T, D] and the new tokens' keys and values ([B, K, T, H] each), which a cache stores. Without cached
    slots the attention is `esroll.models.attention.self_attention` with the kernel `cfg.attention` (XLA's:
    `jax.nn.dot_product_attention`; a fused kernel on an accelerator), with them `attend`'s (XLA's arithmetic).
    """
    B, T, _ = h_BxTxD.shape
    H, Q, K = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads

    qkv = [linear(h_BxTxD, p[n], d.get(n), index_B) for n in ("q", "k", "v")]  # [B, T, Q·H], [B, T, K·H], [B, T, K·H]
    if "q_bias" in p:
        qkv = [y + row_vector(p[f"{n}_bias"], d.get(f"{n}_bias"), index_B) for y, n in zip(qkv, "qkv")]
    q_BxTxQH, k_BxTxKH, v_BxTxKH = qkv
    q_BxTxQxH = q_BxTxQH.reshape(B, T, Q, H)
    k_BxTxKxH = k_BxTxKH.reshape(B, T, K, H)
    v_BxTxKxH = v_BxTxKH.reshape(B, T, K, H)
    if cfg.qk_norm:
        q_BxTxQxH = rms_norm(q_BxTxQxH, row_vector(p["q_norm"], d.get("q_norm"), index_B)[:, :, None], cfg.rms_norm_eps)
        k_BxTxKxH = rms_norm(k_BxTxKxH, row_vector(p["k_norm"], d.get("k_norm"), index_B)[:, :, None], cfg.rms_norm_eps)
    q_BxTxQxH = rope(q_BxTxQxH, cos_sin)
    k_BxTxKxH = rope(k_BxTxKxH, cos_sin)

    k_BxKxTxH, v_BxKxTxH = k_BxTxKxH.transpose(0, 2, 1, 3), v_BxTxKxH.transpose(0, 2, 1, 3)  # the cache's order
    if old is None:  # the T tokens among themselves (training, scoring, a prefill that fills a fresh cache)
        out_BxTxQxH = self_attention(cfg.attention, q_BxTxQxH, k_BxTxKxH, v_BxTxKxH, mask_BxT)
    else:
        k_BxKxSxH, v_BxKxSxH = (x.astype(q_BxTxQxH.dtype) for x in old)
        out_BxTxQxH = attend(q_BxTxQxH, (k_BxKxSxH, v_BxKxSxH, visible_BxTxS), (k_BxKxTxH, v_BxKxTxH, visible_BxTxT))
    out_BxTxD = linear(out_BxTxQxH.reshape(B, T, Q * H), p["o"], d.get("o"), index_B)
    if "o_bias" in p:
        out_BxTxD = out_BxTxD + row_vector(p["o_bias"], d.get("o_bias"), index_B)
    return out_BxTxD, (k_BxKxTxH, v_BxKxTxH)


# Scores of masked (query, key) pairs: finite, so that a row with no visible key gets a uniform average, not NaN.
_MASKED = -0.7 * float(np.finfo(np.float32).max)


def attend(q_BxTxQxH: Array, *blocks: tuple[Array, Array, Array]) -> Array:
    """Grouped-query attention [B, T, Q, H] over one or more blocks of keys and values, each (k [B, K, S, H],
    v [B, K, S, H], visible [B, T, S]), under one softmax: query head j reads kv head j // (Q / K) (the grouping of
    Hugging Face's `repeat_kv`), scores q·k/√H and their softmax in float32, masked pairs (visible False) left out;
    a row that sees no key at all gets the uniform average of every block's values, not NaN.

    A step over a cache attends to two blocks, the layer's cached slots and its new ones, without joining them
    into one buffer (which would copy the layer's cache). The queries are grouped to [B, K, Q/K, T, H] (a step's
    are small), so both products are batched over (B, K) with keys and values read as they lie in the cache and no
    kv head repeated. The arithmetic is that of `jax.nn.dot_product_attention`'s XLA implementation on the blocks
    joined along S (float32 scores scaled after the product, softmax in float32, probabilities cast to the values'
    dtype before the second product), which `forward` uses for the cache-free case.
    """
    B, T, Q, H = q_BxTxQxH.shape
    K = blocks[0][0].shape[1]
    q_BxKxGxTxH = q_BxTxQxH.reshape(B, T, K, Q // K, H).transpose(0, 2, 3, 1, 4)
    scores = []
    for k_BxKxSxH, _, visible_BxTxS in blocks:
        s_BxKxGxTxS = jnp.einsum("bkgth,bksh->bkgts", q_BxKxGxTxH, k_BxKxSxH, preferred_element_type=jnp.float32)
        s_BxKxGxTxS = s_BxKxGxTxS * np.float32(1.0 / np.sqrt(H))
        scores.append(jnp.where(visible_BxTxS[:, None, None], s_BxKxGxTxS, _MASKED))
    max_BxKxGxTx1 = functools.reduce(jnp.maximum, [s.max(-1, keepdims=True) for s in scores])
    exps = [jnp.exp(s - max_BxKxGxTx1) for s in scores]
    total_BxKxGxTx1 = functools.reduce(jnp.add, [e.sum(-1, keepdims=True) for e in exps])
    out_BxKxGxTxH = functools.reduce(
        jnp.add,
        [
            jnp.einsum("bkgts,bksh->bkgth", (e / total_BxKxGxTx1).astype(v_BxKxSxH.dtype), v_BxKxSxH)
            for e, (_, v_BxKxSxH, _) in zip(exps, blocks)
        ],
    )
    return out_BxKxGxTxH.transpose(0, 3, 1, 2, 4).reshape(B, T, Q, H)
