"""The decoder as one pure function: forward(cfg, params, tokens, ...) -> (logits, cache).

Parameters are a dict; per-layer weights are stacked on a leading layer axis and run under `lax.scan`, so compile time
does not grow with depth. Weights are stored [in, out] (the transpose of torch's Linear).

    embed [V, D]; final_norm [D]; lm_head [D, V] (untied only)
    layers: attn_norm [L, D], q [L, D, Nq·H], k/v [L, D, Nkv·H], o [L, Nq·H, D],
            q_bias/k_bias/v_bias (Qwen2), o_bias (Llama attention_bias), q_norm/k_norm [L, H] (Qwen3),
            mlp_norm [L, D], gate/up [L, D, F], down [L, F, D]
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from esroll.models.config import ModelConfig
from esroll.models.layers import Perturbation, linear, rms_norm, rope, row_vector

Array = jax.Array
_NEG = -1e30  # finite, so a query with no visible key (a padded one) gives a uniform row instead of NaN


class KVCache(NamedTuple):
    """Keys and values of every slot written so far. All rows share the write index (prompts are left-padded)."""

    k: Array  # [L, B, S, Nkv, H]
    v: Array  # [L, B, S, Nkv, H]
    valid_BxS: Array  # bool: slot holds a real (non-pad) token
    index: Array  # int32 scalar: next slot to write


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
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
) -> tuple[Array, KVCache | None]:
    """Logits [B, T, V] in float32, and the updated cache (None without one).

    mask_BxT marks real tokens (False for padding); positions default to the count of real tokens before each one,
    which is right for left-padded prompts and for decoding after them. With a cache, the T new tokens are written at
    slots [index, index + T) and attend to every valid earlier slot.
    """
    B, T = tokens_BxT.shape
    mask_BxT = jnp.ones((B, T), bool) if mask_BxT is None else mask_BxT.astype(bool)
    seen_B = jnp.zeros((B,), jnp.int32) if cache is None else cache.valid_BxS.sum(-1).astype(jnp.int32)
    if positions_BxT is None:
        positions_BxT = jnp.maximum(seen_B[:, None] + jnp.cumsum(mask_BxT, -1) - 1, 0)

    if cache is None:
        key_valid_BxS = mask_BxT
        q_slot_T = jnp.arange(T)
        k_slot_S = jnp.arange(T)
    else:
        key_valid_BxS = jax.lax.dynamic_update_slice(cache.valid_BxS, mask_BxT, (0, cache.index))
        q_slot_T = cache.index + jnp.arange(T)
        k_slot_S = jnp.arange(cache.valid_BxS.shape[1])
    visible_BxTxS = key_valid_BxS[:, None, :] & (k_slot_S[None, None, :] <= q_slot_T[None, :, None])

    deltas = {} if perturb is None else perturb.deltas
    member_B = None if perturb is None else perturb.member_B
    inv_freq = jnp.asarray(cfg.inv_freq(), jnp.float32)

    x = params["embed"][tokens_BxT]
    layer_deltas = deltas.get("layers", {})
    # The whole stacked cache rides in the scan carry and each layer writes its slice in place; passing it as scan
    # xs/ys instead would copy every layer's keys and values on every decode step.
    cache_kv = None if cache is None else (cache.k, cache.v)

    def block(carry, xs):
        x_BxTxD, kv = carry
        p, d, layer = xs
        h = rms_norm(x_BxTxD, row_vector(p["attn_norm"], d.get("attn_norm"), member_B), cfg.rms_norm_eps)
        h, kv = _attention(cfg, p, d, member_B, h, positions_BxT, inv_freq, visible_BxTxS, kv, layer, cache)
        x_BxTxD = x_BxTxD + h
        h = rms_norm(x_BxTxD, row_vector(p["mlp_norm"], d.get("mlp_norm"), member_B), cfg.rms_norm_eps)
        gate = linear(h, p["gate"], d.get("gate"), member_B)
        up = linear(h, p["up"], d.get("up"), member_B)
        x_BxTxD = x_BxTxD + linear(jax.nn.silu(gate) * up, p["down"], d.get("down"), member_B)
        return (x_BxTxD, kv), None

    layers = jnp.arange(cfg.num_layers)
    (x, new_kv), _ = jax.lax.scan(block, (x, cache_kv), (params["layers"], layer_deltas, layers))
    x = rms_norm(x, row_vector(params["final_norm"], deltas.get("final_norm"), member_B), cfg.rms_norm_eps)
    if cfg.tie_word_embeddings:
        logits = jnp.einsum("btd,vd->btv", x, params["embed"])
    else:
        logits = linear(x, params["lm_head"], deltas.get("lm_head"), member_B)
    logits = logits.astype(jnp.float32)

    if cache is None:
        return logits, None
    k, v = new_kv
    return logits, KVCache(k=k, v=v, valid_BxS=key_valid_BxS, index=cache.index + T)


def _attention(cfg, p, d, member_B, h_BxTxD, positions_BxT, inv_freq, visible_BxTxS, kv, layer, cache):
    B, T, _ = h_BxTxD.shape
    H, Nq, Nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads

    def proj(name):
        y = linear(h_BxTxD, p[name], d.get(name), member_B)
        if f"{name}_bias" in p:
            y = y + row_vector(p[f"{name}_bias"], d.get(f"{name}_bias"), member_B)
        return y

    q = proj("q").reshape(B, T, Nq, H)
    k = proj("k").reshape(B, T, Nkv, H)
    v = proj("v").reshape(B, T, Nkv, H)
    if cfg.qk_norm:
        q = rms_norm(q, row_vector(p["q_norm"], d.get("q_norm"), member_B)[:, :, None], cfg.rms_norm_eps)
        k = rms_norm(k, row_vector(p["k_norm"], d.get("k_norm"), member_B)[:, :, None], cfg.rms_norm_eps)
    q = rope(q, positions_BxT, inv_freq)
    k = rope(k, positions_BxT, inv_freq)

    if kv is not None:
        k_all, v_all = kv
        k_all = jax.lax.dynamic_update_slice(k_all, k[None].astype(k_all.dtype), (layer, 0, cache.index, 0, 0))
        v_all = jax.lax.dynamic_update_slice(v_all, v[None].astype(v_all.dtype), (layer, 0, cache.index, 0, 0))
        kv = (k_all, v_all)
        k = jax.lax.dynamic_index_in_dim(k_all, layer, keepdims=False).astype(q.dtype)
        v = jax.lax.dynamic_index_in_dim(v_all, layer, keepdims=False).astype(q.dtype)

    q = q.reshape(B, T, Nkv, Nq // Nkv, H)
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k).astype(jnp.float32) / np.sqrt(H)
    scores = jnp.where(visible_BxTxS[:, None, None], scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(B, T, Nq * H)
    out = linear(out, p["o"], d.get("o"), member_B)
    if "o_bias" in p:
        out = out + row_vector(p["o_bias"], d.get("o_bias"), member_B)
    return out, kv
