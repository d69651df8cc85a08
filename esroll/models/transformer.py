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

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

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

    Both are [L, B, S, K, H]: layer i's keys and values are the [B, S, K, H] operands `jax.nn.dot_product_attention`
    takes (the layout of JAX's and cuDNN's attention), read as they are stored. A step writes its T new slots of
    layer i in place. `forward` runs its layers under `lax.scan` with the whole cache in the scan's carry (one copy,
    updated in place), so the program holds one copy of the layer whatever the depth.
    """

    k: Array  # [L, B, S, K, H]
    v: Array  # [L, B, S, K, H]
    valid_BxS: Array  # bool: slot holds a real (non-pad) token
    index: Array  # int32 scalar: next slot to write


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """An empty cache of `max_len` slots (see `KVCache`)."""
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
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
) -> tuple[Array, KVCache | None]:
    """Logits [B, T, V] in float32, and the updated cache (None without one).

    One form for every use (training, scoring, prefill, decode) and every platform: the layers run under
    `lax.scan` over the layer-stacked weights, `unroll` layers per iteration (the scan's `unroll`: the program
    grows with it, the values do not change). With a cache the scan carries it: layer i writes its T new slots
    into the stacked buffers in place and attends over its own keys and values, the new slots included. The cache
    is deliberately not scanned over as xs / ys, which would hold the input and the output cache side by side.

    A member-level perturbation (`perturb.member_B` set) is gathered into per-row factors once here
    (`Perturbation.per_row`), before the scan; `esroll.sampling.generate` gathers once per call, before its decode
    loop, and passes per-row factors.

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
    slots [index, index + T) and attend to every valid earlier slot.
    """
    B, T = tokens_BxT.shape
    if remat not in (None, "none") and cache is not None:
        raise ValueError("forward: remat applies to the cache-free (training) path only")
    if (return_hidden or layer_params is not None) and cache is not None:
        raise ValueError("forward: return_hidden and layer_params apply to the cache-free path only")
    mask_BxT = jnp.ones((B, T), bool) if mask_BxT is None else mask_BxT.astype(bool)
    seen_B = jnp.zeros((B,), jnp.int32) if cache is None else cache.valid_BxS.sum(-1).astype(jnp.int32)
    num_positions = None  # an upper bound on positions, when known while tracing
    if positions_BxT is None:
        positions_BxT = jnp.maximum(seen_B[:, None] + jnp.cumsum(mask_BxT, -1) - 1, 0)
        num_positions = T if cache is None else cache.valid_BxS.shape[1]

    if cache is None:
        key_valid_BxS = mask_BxT
        q_slot_T = jnp.arange(T)
        k_slot_S = jnp.arange(T)
    else:
        key_valid_BxS = jax.lax.dynamic_update_slice(cache.valid_BxS, mask_BxT, (0, cache.index))
        q_slot_T = cache.index + jnp.arange(T)
        k_slot_S = jnp.arange(cache.valid_BxS.shape[1])
    visible_BxTxS = key_valid_BxS[:, None, :] & (k_slot_S[None, None, :] <= q_slot_T[None, :, None])

    perturb = None if perturb is None else perturb.per_row()
    deltas = {} if perturb is None else perturb.deltas
    x_BxTxD = params["embed"][tokens_BxT]
    cos_sin = rope_tables(positions_BxT, cfg.inv_freq(), num_positions, x_BxTxD.dtype)
    index = None if cache is None else cache.index
    gather = layer_params or (lambda p: p)  # e.g. FSDP: gather this layer's weights only, as it runs

    def layer(carry, xs):
        x_BxTxD, kv = carry
        i, p, d = xs
        p = gather(p)
        h_BxTxD = rms_norm(x_BxTxD, row_vector(p["attn_norm"], d.get("attn_norm")), cfg.rms_norm_eps)
        h_BxTxD, kv = _attention(cfg, p, d, h_BxTxD, cos_sin, visible_BxTxS, kv, index, i)
        x_BxTxD = x_BxTxD + h_BxTxD
        h_BxTxD = rms_norm(x_BxTxD, row_vector(p["mlp_norm"], d.get("mlp_norm")), cfg.rms_norm_eps)
        gate_BxTxF = linear(h_BxTxD, p["gate"], d.get("gate"))
        up_BxTxF = linear(h_BxTxD, p["up"], d.get("up"))
        x_BxTxD = x_BxTxD + linear(jax.nn.silu(gate_BxTxF) * up_BxTxF, p["down"], d.get("down"))
        return (x_BxTxD, kv), None

    layer_L = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    kv = None if cache is None else (cache.k, cache.v)
    (x_BxTxD, kv), _ = jax.lax.scan(
        _remat(layer, remat, unroll),
        (x_BxTxD, kv),
        (layer_L, params[STACKED], deltas.get(STACKED) or {}),
        unroll=unroll,
    )
    x_BxTxD = rms_norm(x_BxTxD, row_vector(params["final_norm"], deltas.get("final_norm")), cfg.rms_norm_eps)
    if return_hidden:
        return x_BxTxD, None
    logits_BxTxV = head(cfg, params, x_BxTxD, perturb)
    if cache is None:
        return logits_BxTxV, None
    return logits_BxTxV, KVCache(*kv, valid_BxS=key_valid_BxS, index=cache.index + T)


def head(cfg: ModelConfig, params: dict, x_BxTxD: Array, perturb: Perturbation | None = None) -> Array:
    """Logits [B, T, V] in float32 of final-normed hidden states: x·embedᵀ when the embedding is tied, else
    x·lm_head (with the perturbation's head deltas, if any). T may be any slice of positions."""
    if cfg.tie_word_embeddings:
        logits_BxTxV = jnp.einsum("btd,vd->btv", x_BxTxD, params["embed"])
    else:
        deltas = {} if perturb is None else perturb.deltas
        member_B = None if perturb is None else perturb.member_B
        logits_BxTxV = linear(x_BxTxD, params["lm_head"], deltas.get("lm_head"), member_B)
    return logits_BxTxV.astype(jnp.float32)


def _attention(cfg, p, d, h_BxTxD, cos_sin, visible_BxTxS, kv, index, layer):
    """Grouped-query attention of layer `layer`; `kv` is None (attend to these T tokens: S = T) or the layer-stacked
    cache buffers (k, v), whose slots [index, index + T) of this layer get the new keys and values.

    Returns [B, T, D] and the updated cache buffers (None without a cache). The products and the softmax are
    `jax.nn.dot_product_attention` over full sequences and over the cache alike (float32 scores and softmax; JAX
    picks the implementation for the platform; a row with no visible key gets a uniform average, not NaN).
    """
    B, T, _ = h_BxTxD.shape
    H, Q, K = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads

    qkv = [linear(h_BxTxD, p[n], d.get(n)) for n in ("q", "k", "v")]  # [B, T, Q·H], [B, T, K·H], [B, T, K·H]
    if "q_bias" in p:
        qkv = [y + row_vector(p[f"{n}_bias"], d.get(f"{n}_bias")) for y, n in zip(qkv, "qkv")]
    q_BxTxQH, k_BxTxKH, v_BxTxKH = qkv
    q_BxTxQxH = q_BxTxQH.reshape(B, T, Q, H)
    k_BxTxKxH = k_BxTxKH.reshape(B, T, K, H)
    v_BxTxKxH = v_BxTxKH.reshape(B, T, K, H)
    if cfg.qk_norm:
        q_BxTxQxH = rms_norm(q_BxTxQxH, row_vector(p["q_norm"], d.get("q_norm"))[:, :, None], cfg.rms_norm_eps)
        k_BxTxKxH = rms_norm(k_BxTxKxH, row_vector(p["k_norm"], d.get("k_norm"))[:, :, None], cfg.rms_norm_eps)
    q_BxTxQxH = rope(q_BxTxQxH, cos_sin)
    k_BxTxKxH = rope(k_BxTxKxH, cos_sin)

    if kv is None:
        k_BxSxKxH, v_BxSxKxH = k_BxTxKxH, v_BxTxKxH
    else:
        cache_k, cache_v = kv  # [L, B, S, K, H] each
        at = (layer, 0, index, 0, 0)
        cache_k = jax.lax.dynamic_update_slice(cache_k, k_BxTxKxH[None].astype(cache_k.dtype), at)
        cache_v = jax.lax.dynamic_update_slice(cache_v, v_BxTxKxH[None].astype(cache_v.dtype), at)
        kv = (cache_k, cache_v)
        k_BxSxKxH = jax.lax.dynamic_index_in_dim(cache_k, layer, 0, keepdims=False).astype(q_BxTxQxH.dtype)
        v_BxSxKxH = jax.lax.dynamic_index_in_dim(cache_v, layer, 0, keepdims=False).astype(q_BxTxQxH.dtype)
    out_BxTxQxH = jax.nn.dot_product_attention(
        q_BxTxQxH, k_BxSxKxH, v_BxSxKxH, mask=visible_BxTxS[:, None], scale=1.0 / np.sqrt(H)
    )
    out_BxTxD = linear(out_BxTxQxH.reshape(B, T, Q * H), p["o"], d.get("o"))
    if "o_bias" in p:
        out_BxTxD = out_BxTxD + row_vector(p["o_bias"], d.get("o_bias"))
    return out_BxTxD, kv
