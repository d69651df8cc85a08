"""The decoder as one pure function: forward(cfg, params, tokens, ...) -> (logits, cache).

Parameters are a dict; per-layer weights are stacked on a leading layer axis, under the top-level key `STACKED`.
Without a KV cache (training, scoring) the layers run under `lax.scan`, so compile time does not grow with depth.
With one (generation) there are two cache layouts (`init_cache`): per-layer buffers, for which the layers run as a
Python loop (a decode step copies neither weights nor keys, but the program, and its compile time, grow with depth),
and layer-stacked buffers, for which they run under `lax.scan` again (compile time flat in depth, the accelerator
form). Weights are stored [I, O] (the transpose of torch's Linear).

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
from esroll.models.layers import Perturbation, fuse_matmuls, linears, rms_norm, rope, rope_tables, row_vector

Array = jax.Array
# The top-level key of the layer-stacked parameters: every leaf under it has a leading layer axis L (and a
# perturbation's deltas under it carry L before the member axis). Declared once; `esroll.es.noise` and the
# checkpoint loaders read it from here.
STACKED = "layers"
_NEG = -1e30  # finite, so a query with no visible key (a padded one) gives a uniform row instead of NaN
# Per-layer rematerialisation of `forward` without a cache (training), by name: what the backward pass keeps of each
# layer. "none": everything autodiff saves (all layers' float32 attention scores included: the largest buffers);
# "full": only the layer's input, the residual stream [B, T, D] (the layer is recomputed in the backward pass);
# "dots": the weight matmuls' outputs too (norms, attention and activations are recomputed).
REMAT_POLICIES = ("none", "full", "dots")


def _remat(body, remat: str | None):
    """`body` (one scanned layer) under `jax.checkpoint` with the policy named `remat` (see REMAT_POLICIES)."""
    if remat in (None, "none"):
        return body
    if remat == "full":
        policy = None  # jax.checkpoint's default: save nothing but the inputs
    elif remat == "dots":
        policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    else:
        raise ValueError(f"unknown remat policy {remat!r}; known: {', '.join(REMAT_POLICIES)}")
    # prevent_cse=False: under lax.scan XLA cannot merge the recomputation with the forward pass (the case the
    # optimisation barrier guards against), so the barrier would only cost time.
    return jax.checkpoint(body, policy=policy, prevent_cse=False)


class KVCache(NamedTuple):
    """Keys and values of every slot written so far. All rows share the write index (prompts are left-padded).

    Keys and values are kept in the layouts a decode step's attention products read fastest: keys [B, K, H, S]
    (slots as the contiguous output dimension of q·kᵀ), values [B, K, S, H]. Each step writes its slots in place.
    Two layouts of the layers (`init_cache`):

    - per layer: `k` and `v` are tuples of L such buffers; `forward` runs its layers as a Python loop, so a step
      touches each layer's own buffer directly, but the traced program holds L copies of the layer.
    - stacked: `k` [L, B, K, H, S] and `v` [L, B, K, S, H], one array each; `forward` runs its layers under
      `lax.scan` with the whole cache in the scan's carry (one copy, updated in place), so the program holds one
      copy of the layer whatever the depth.
    """

    k: tuple[Array, ...] | Array  # L x [B, K, H, S], or [L, B, K, H, S] stacked
    v: tuple[Array, ...] | Array  # L x [B, K, S, H], or [L, B, K, S, H] stacked
    valid_BxS: Array  # bool: slot holds a real (non-pad) token
    index: Array  # int32 scalar: next slot to write

    @property
    def stacked(self) -> bool:
        """Whether the layers' buffers are stacked into one array (else a tuple of per-layer arrays)."""
        return not isinstance(self.k, (tuple, list))


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, stacked: bool = False) -> KVCache:
    """An empty cache of `max_len` slots: per-layer buffers, or layer-stacked ones with `stacked` (see `KVCache`)."""
    k_shape = (batch, cfg.num_kv_heads, cfg.head_dim, max_len)
    v_shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    if stacked:
        k = jnp.zeros((cfg.num_layers, *k_shape), dtype)
        v = jnp.zeros((cfg.num_layers, *v_shape), dtype)
    else:
        k = tuple(jnp.zeros(k_shape, dtype) for _ in range(cfg.num_layers))
        v = tuple(jnp.zeros(v_shape, dtype) for _ in range(cfg.num_layers))
    return KVCache(k=k, v=v, valid_BxS=jnp.zeros((batch, max_len), bool), index=jnp.zeros((), jnp.int32))


def unstack_layers(tree, num_layers: int) -> list:
    """A layer-stacked pytree (params[STACKED], or a perturbation's layer deltas) as one pytree per layer.

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
    remat: str | None = None,
    return_hidden: bool = False,
    layer_params=None,
    fuse: bool = False,
    unroll: bool = False,
) -> tuple[Array, KVCache | None]:
    """Logits [B, T, V] in float32, and the updated cache (None without one).

    `layer_params` (no cache only) maps each layer's weights inside the scan before the layer uses them: GRPO passes
    a sharding constraint that all-gathers one layer's FSDP shards at a time (and whose transpose reduce-scatters that
    layer's gradient), so no device ever holds every layer's full weights or gradients at once.

    `fuse` (no cache only) runs q/k/v and gate/up as one GEMM each (`fuse_matmuls`), the layer's weights concatenated
    inside the scan as it runs (the gradient flows back through the concatenation to the separate weights): a CPU
    speed knob (fewer, larger GEMMs, and XLA's CPU backend then makes fewer layout copies in the backward pass; the
    README's benchmarks give the effect). On a mesh that splits the weights' columns the concatenation would reshard
    them, so GRPO enables it on a CPU mesh without a model axis only. `unroll` (no cache, no remat) unrolls the layer
    scan into straight-line code, as `generate` runs its layers on a CPU: the loop's per-layer slices of the stacked
    weights and of the saved activations go, and the program grows with depth. Refused with remat: unrolled, XLA could
    merge a layer's recomputation with its forward pass (the checkpoints are traced with prevent_cse=False) and undo
    the memory the remat saves.

    With `return_hidden`, the final-normed hidden states [B, T, D] (model dtype) instead of the logits: a caller
    that needs only some positions' logits (`esroll.sampling.sequence_logprobs`) applies `head` to those, in chunks,
    and never holds the [B, T, V] float32 buffer. `remat` (no cache only; a name in REMAT_POLICIES, None = "none")
    rematerialises each scanned layer for the backward pass, so that what is saved per layer is the residual stream
    ("full") or it and the weight matmuls' outputs ("dots"), never the attention scores.

    mask_BxT marks real tokens (False for padding); positions default to the count of real tokens before each one,
    which is right for left-padded prompts and for decoding after them. With a cache, the T new tokens are written at
    slots [index, index + T) and attend to every valid earlier slot.

    Without a cache the layers run under `lax.scan` (compile time independent of depth). With a per-layer cache they
    run as a Python loop, each layer writing its own cache buffer in place: a decode step then copies neither weights
    nor keys. `params[STACKED]` (and the perturbation's layer deltas) may then already be a per-layer list
    (`unstack_layers`), as `esroll.sampling.generate` passes them. With a stacked cache they run under `lax.scan`
    over the layer index, the cache in the carry: layer i writes its new slots into the stacked buffers in place and
    reads its own keys and values back with a dynamic slice. The cache is deliberately not scanned over as xs / ys,
    which would hold the input and the output cache side by side (two copies). `params[STACKED]` must then be
    layer-stacked.
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
    x_BxTxD = params["embed"][tokens_BxT]
    cos_sin = rope_tables(positions_BxT, cfg.inv_freq(), num_positions, x_BxTxD.dtype)

    def block(x_BxTxD, p, d, kv):
        h_BxTxD = rms_norm(x_BxTxD, row_vector(p["attn_norm"], d.get("attn_norm"), member_B), cfg.rms_norm_eps)
        h_BxTxD, kv = _attention(cfg, p, d, member_B, h_BxTxD, cos_sin, visible_BxTxS, kv)
        x_BxTxD = x_BxTxD + h_BxTxD
        h_BxTxD = rms_norm(x_BxTxD, row_vector(p["mlp_norm"], d.get("mlp_norm"), member_B), cfg.rms_norm_eps)
        gate_BxTxF, up_BxTxF = linears(h_BxTxD, p, d, ("gate", "up"), member_B)
        return x_BxTxD + linears(jax.nn.silu(gate_BxTxF) * up_BxTxF, p, d, ("down",), member_B)[0], kv

    layer_deltas = deltas.get(STACKED) or {}
    if remat not in (None, "none") and cache is not None:
        raise ValueError("forward: remat applies to the cache-free (training) path only")
    if fuse and cache is not None:
        raise ValueError("forward: fuse applies to the cache-free (training) path only (generate fuses its own)")
    if unroll and (cache is not None or remat not in (None, "none")):
        raise ValueError("forward: unroll applies to the cache-free path without remat only")
    if cache is None:
        gather = layer_params or (lambda p: p)  # e.g. FSDP: gather this layer's weights only, as it runs
        prepare = (lambda p: fuse_matmuls(gather(p))) if fuse else gather
        x_BxTxD, _ = jax.lax.scan(
            _remat(lambda x, pd: (block(x, prepare(pd[0]), pd[1], None)[0], None), remat),
            x_BxTxD,
            (params[STACKED], layer_deltas),
            unroll=True if unroll else 1,
        )
    elif cache.stacked:
        if isinstance(params[STACKED], (list, tuple)) or isinstance(layer_deltas, (list, tuple)):
            raise TypeError("a layer-stacked KV cache needs layer-stacked params[STACKED] and perturbation deltas")

        def layer(carry, xs):
            x_BxTxD, k_LxBxKxHxS, v_LxBxKxSxH = carry
            i, p, d = xs
            x_BxTxD, (k_LxBxKxHxS, v_LxBxKxSxH) = block(x_BxTxD, p, d, (k_LxBxKxHxS, v_LxBxKxSxH, cache.index, i))
            return (x_BxTxD, k_LxBxKxHxS, v_LxBxKxSxH), None

        layer_L = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (x_BxTxD, new_k, new_v), _ = jax.lax.scan(
            layer, (x_BxTxD, cache.k, cache.v), (layer_L, params[STACKED], layer_deltas)
        )
    else:
        layers = unstack_layers(params[STACKED], cfg.num_layers)
        per_layer_deltas = unstack_layers(layer_deltas, cfg.num_layers)
        new_k, new_v = [], []
        for p, d, k, v in zip(layers, per_layer_deltas, cache.k, cache.v, strict=True):
            x_BxTxD, (k, v) = block(x_BxTxD, p, d, (k, v, cache.index, None))
            new_k.append(k)
            new_v.append(v)
    final_norm = row_vector(params["final_norm"], deltas.get("final_norm"), member_B)
    x_BxTxD = rms_norm(x_BxTxD, final_norm, cfg.rms_norm_eps)
    if return_hidden:
        if cache is not None:
            raise ValueError("forward: return_hidden applies to the cache-free path only")
        return x_BxTxD, None
    logits_BxTxV = head(cfg, params, x_BxTxD, perturb)

    if cache is None:
        return logits_BxTxV, None
    if not cache.stacked:
        new_k, new_v = tuple(new_k), tuple(new_v)
    return logits_BxTxV, KVCache(new_k, new_v, valid_BxS=key_valid_BxS, index=cache.index + T)


def head(cfg: ModelConfig, params: dict, x_BxTxD: Array, perturb: Perturbation | None = None) -> Array:
    """Logits [B, T, V] in float32 of final-normed hidden states: x·embedᵀ when the embedding is tied, else
    x·lm_head (with the perturbation's head deltas, if any). T may be any slice of positions."""
    if cfg.tie_word_embeddings:
        logits_BxTxV = jnp.einsum("btd,vd->btv", x_BxTxD, params["embed"])
    else:
        deltas = {} if perturb is None else perturb.deltas
        member_B = None if perturb is None else perturb.member_B
        logits_BxTxV = linears(x_BxTxD, params, deltas, ("lm_head",), member_B)[0]
    return logits_BxTxV.astype(jnp.float32)


def _attention(cfg, p, d, member_B, h_BxTxD, cos_sin, visible_BxTxS, kv):
    """Grouped-query attention; `kv` is None (attend to these T tokens: S = T), (k, v, index, None) of one layer's
    cache buffers, or (k, v, index, layer) of the layer-stacked buffers and this layer's index in them.

    Returns [B, T, D] and the updated cache buffers (None without a cache): the layer's, or the whole stacked ones.
    """
    B, T, _ = h_BxTxD.shape
    H, Q, K = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    G = Q // K

    qkv = linears(h_BxTxD, p, d, ("q", "k", "v"), member_B)  # [B, T, Q·H], [B, T, K·H], [B, T, K·H]
    if "q_bias" in p:
        qkv = [y + row_vector(p[f"{n}_bias"], d.get(f"{n}_bias"), member_B) for y, n in zip(qkv, "qkv")]
    q_BxTxQH, k_BxTxKH, v_BxTxKH = qkv
    q_BxTxQxH = q_BxTxQH.reshape(B, T, Q, H)
    k_BxTxKxH = k_BxTxKH.reshape(B, T, K, H)
    v_BxTxKxH = v_BxTxKH.reshape(B, T, K, H)
    if cfg.qk_norm:
        q_norm_Bx1x1xH = row_vector(p["q_norm"], d.get("q_norm"), member_B)[:, :, None]
        k_norm_Bx1x1xH = row_vector(p["k_norm"], d.get("k_norm"), member_B)[:, :, None]
        q_BxTxQxH = rms_norm(q_BxTxQxH, q_norm_Bx1x1xH, cfg.rms_norm_eps)
        k_BxTxKxH = rms_norm(k_BxTxKxH, k_norm_Bx1x1xH, cfg.rms_norm_eps)
    q_BxTxQxH = rope(q_BxTxQxH, cos_sin)
    k_BxKxHxT = rope(k_BxTxKxH, cos_sin).transpose(0, 2, 3, 1)
    v_BxKxTxH = v_BxTxKxH.transpose(0, 2, 1, 3)

    if kv is None:
        k_BxKxHxS, v_BxKxSxH = k_BxKxHxT, v_BxKxTxH
    else:
        cache_k, cache_v, index, layer = kv  # [(L,) B, K, H, S], [(L,) B, K, S, H]
        # Only the T new slots are written (of this layer's part of the stacked buffers), in place.
        new_k, new_v = k_BxKxHxT.astype(cache_k.dtype), v_BxKxTxH.astype(cache_v.dtype)
        lead = ()
        if layer is not None:
            new_k, new_v, lead = new_k[None], new_v[None], (layer,)
        cache_k = jax.lax.dynamic_update_slice(cache_k, new_k, (*lead, 0, 0, 0, index))
        cache_v = jax.lax.dynamic_update_slice(cache_v, new_v, (*lead, 0, 0, index, 0))
        kv = (cache_k, cache_v)
        if layer is not None:  # this layer's keys and values, the new slots included
            cache_k = jax.lax.dynamic_index_in_dim(cache_k, layer, 0, keepdims=False)
            cache_v = jax.lax.dynamic_index_in_dim(cache_v, layer, 0, keepdims=False)
        k_BxKxHxS = cache_k.astype(q_BxTxQxH.dtype)
        v_BxKxSxH = cache_v.astype(q_BxTxQxH.dtype)

    # Batched (rows x kv heads) products with the kv head's query rows (G heads x T positions, one axis G·T) as the
    # GEMM's rows and the cache slots as its long, contiguous output dimension of q·kᵀ. Written as plain
    # dot_generals so that XLA keeps this operand order; from einsums it picked one with a 2-wide output dimension,
    # several times slower on a CPU.
    q_BxKxGTxH = q_BxTxQxH.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)
    scores_BxKxGTxS = jax.lax.dot_general(q_BxKxGTxH, k_BxKxHxS, (((3,), (2,)), ((0, 1), (0, 1))))
    scores_BxKxGxTxS = scores_BxKxGTxS.reshape(B, K, G, T, -1)
    scores_BxKxGxTxS = jnp.where(visible_BxTxS[:, None, None], scores_BxKxGxTxS.astype(jnp.float32) / np.sqrt(H), _NEG)
    probs_BxKxGTxS = jax.nn.softmax(scores_BxKxGxTxS, axis=-1).astype(v_BxKxSxH.dtype).reshape(B, K, G * T, -1)
    out_BxKxGTxH = jax.lax.dot_general(probs_BxKxGTxS, v_BxKxSxH, (((3,), (2,)), ((0, 1), (0, 1))))
    out_BxTxQH = out_BxKxGTxH.reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, Q * H)
    out_BxTxD = linears(out_BxTxQH, p, d, ("o",), member_B)[0]
    if "o_bias" in p:
        out_BxTxD = out_BxTxD + row_vector(p["o_bias"], d.get("o_bias"), member_B)
    return out_BxTxD, kv
