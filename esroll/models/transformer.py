"""The decoder as one pure function: forward(cfg, params, tokens, ...) -> (logits, cache).

Parameters are a dict; per-layer weights are stacked on a leading layer axis. Without a KV cache (training, scoring)
the layers run under `lax.scan`, so compile time does not grow with depth; with one (generation) they run as a
Python loop over per-layer weights and cache buffers, so a decode step copies neither. Weights are stored [in, out]
(the transpose of torch's Linear).

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
from esroll.models.layers import Perturbation, linears, rms_norm, rope, rope_tables, row_vector

Array = jax.Array
_NEG = -1e30  # finite, so a query with no visible key (a padded one) gives a uniform row instead of NaN


class KVCache(NamedTuple):
    """Keys and values of every slot written so far. All rows share the write index (prompts are left-padded).

    One buffer per layer, in the layouts a decode step's attention products read fastest: keys [B, Nkv, H, S] (slots
    as the contiguous output dimension of q·kᵀ), values [B, Nkv, S, H]. Each step writes its slot in place.
    """

    k: tuple[Array, ...]  # L x [B, Nkv, H, S]
    v: tuple[Array, ...]  # L x [B, Nkv, S, H]
    valid_BxS: Array  # bool: slot holds a real (non-pad) token
    index: Array  # int32 scalar: next slot to write


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    k_shape = (batch, cfg.num_kv_heads, cfg.head_dim, max_len)
    v_shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    return KVCache(
        k=tuple(jnp.zeros(k_shape, dtype) for _ in range(cfg.num_layers)),
        v=tuple(jnp.zeros(v_shape, dtype) for _ in range(cfg.num_layers)),
        valid_BxS=jnp.zeros((batch, max_len), bool),
        index=jnp.zeros((), jnp.int32),
    )


def unstack_layers(tree, num_layers: int) -> list:
    """A layer-stacked pytree (params["layers"], or a perturbation's layer deltas) as one pytree per layer.

    `forward` with a cache runs its layers as a Python loop over such a list; slicing once, outside a decode loop,
    keeps per-layer weight copies out of every step. An empty tree (no perturbed layer leaf) gives L empty ones.
    """
    if isinstance(tree, (list, tuple)):
        return list(tree)
    return [jax.tree.map(lambda leaf, i=i: leaf[i], tree) for i in range(num_layers)]


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

    Without a cache the layers run under `lax.scan` (compile time independent of depth). With one they run as a
    Python loop, each layer writing its own cache buffer in place: a decode step then copies neither weights nor
    keys. `params["layers"]` (and the perturbation's layer deltas) may already be a per-layer list
    (`unstack_layers`), as `esroll.sampling.generate` passes them.
    """
    B, T = tokens_BxT.shape
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

    deltas = {} if perturb is None else perturb.deltas
    member_B = None if perturb is None else perturb.member_B
    x = params["embed"][tokens_BxT]
    cos_sin = rope_tables(positions_BxT, cfg.inv_freq(), num_positions, x.dtype)

    def block(x_BxTxD, p, d, kv):
        h = rms_norm(x_BxTxD, row_vector(p["attn_norm"], d.get("attn_norm"), member_B), cfg.rms_norm_eps)
        h, kv = _attention(cfg, p, d, member_B, h, cos_sin, visible_BxTxS, kv)
        x_BxTxD = x_BxTxD + h
        h = rms_norm(x_BxTxD, row_vector(p["mlp_norm"], d.get("mlp_norm"), member_B), cfg.rms_norm_eps)
        gate, up = linears(h, p, d, ("gate", "up"), member_B)
        return x_BxTxD + linears(jax.nn.silu(gate) * up, p, d, ("down",), member_B)[0], kv

    layer_deltas = deltas.get("layers", {})
    if cache is None:
        x, _ = jax.lax.scan(lambda x, pd: (block(x, *pd, None)[0], None), x, (params["layers"], layer_deltas))
    else:
        layers = unstack_layers(params["layers"], cfg.num_layers)
        per_layer_deltas = unstack_layers(layer_deltas, cfg.num_layers)
        new_k, new_v = [], []
        for p, d, k, v in zip(layers, per_layer_deltas, cache.k, cache.v, strict=True):
            x, (k, v) = block(x, p, d, (k, v, cache.index))
            new_k.append(k)
            new_v.append(v)
    x = rms_norm(x, row_vector(params["final_norm"], deltas.get("final_norm"), member_B), cfg.rms_norm_eps)
    if cfg.tie_word_embeddings:
        logits = jnp.einsum("btd,vd->btv", x, params["embed"])
    else:
        logits = linears(x, params, deltas, ("lm_head",), member_B)[0]
    logits = logits.astype(jnp.float32)

    if cache is None:
        return logits, None
    return logits, KVCache(tuple(new_k), tuple(new_v), valid_BxS=key_valid_BxS, index=cache.index + T)


def _attention(cfg, p, d, member_B, h_BxTxD, cos_sin, visible_BxTxS, kv):
    """Grouped-query attention; `kv` is None (attend to these T tokens) or (k, v, index) of one layer's cache."""
    B, T, _ = h_BxTxD.shape
    H, Nq, Nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads

    q, k, v = linears(h_BxTxD, p, d, ("q", "k", "v"), member_B)
    if "q_bias" in p:
        q, k, v = (y + row_vector(p[f"{n}_bias"], d.get(f"{n}_bias"), member_B) for y, n in zip((q, k, v), "qkv"))
    q, k, v = q.reshape(B, T, Nq, H), k.reshape(B, T, Nkv, H), v.reshape(B, T, Nkv, H)
    if cfg.qk_norm:
        q = rms_norm(q, row_vector(p["q_norm"], d.get("q_norm"), member_B)[:, :, None], cfg.rms_norm_eps)
        k = rms_norm(k, row_vector(p["k_norm"], d.get("k_norm"), member_B)[:, :, None], cfg.rms_norm_eps)
    q = rope(q, cos_sin)
    k = rope(k, cos_sin).transpose(0, 2, 3, 1)  # [B, Nkv, H, T]
    v = v.transpose(0, 2, 1, 3)

    if kv is not None:
        k_all, v_all, index = kv
        k_all = jax.lax.dynamic_update_slice(k_all, k.astype(k_all.dtype), (0, 0, 0, index))
        v_all = jax.lax.dynamic_update_slice(v_all, v.astype(v_all.dtype), (0, 0, index, 0))
        kv = (k_all, v_all)
        k, v = k_all.astype(q.dtype), v_all.astype(q.dtype)

    # Batched (rows x kv heads) products with the kv head's query rows (G heads x T positions) as M and the cache
    # slots as the long, contiguous N of q·kᵀ. Written as plain dot_generals so that XLA keeps this operand order;
    # from einsums it picked one with a 2-wide output dimension, several times slower on a CPU.
    G = Nq // Nkv
    q = q.reshape(B, T, Nkv, G, H).transpose(0, 2, 3, 1, 4).reshape(B, Nkv, G * T, H)
    scores = jax.lax.dot_general(q, k, (((3,), (2,)), ((0, 1), (0, 1)))).reshape(B, Nkv, G, T, -1)
    scores = jnp.where(visible_BxTxS[:, None, None], scores.astype(jnp.float32) / np.sqrt(H), _NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(B, Nkv, G * T, -1)
    out = jax.lax.dot_general(probs, v, (((3,), (2,)), ((0, 1), (0, 1))))  # [B, Nkv, G·T, H]
    out = out.reshape(B, Nkv, G, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, Nq * H)
    out = linears(out, p, d, ("o",), member_B)[0]
    if "o_bias" in p:
        out = out + row_vector(p["o_bias"], d.get("o_bias"), member_B)
    return out, kv
