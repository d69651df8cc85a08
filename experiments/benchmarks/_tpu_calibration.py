"""Calibration programs for `experiments.benchmarks.tpu_cost`: only the must-do work of a program, at the shapes and
shardings of a `CaseTarget`'s, so that its cost model's time can be judged against what the model gives that work at
all (`over_calibration` in `tpu_cost`).

`lower_prefill(t, depth)`, `lower_tell(t)` and `lower_update(t, depth, rows)` lower the calibrations of a target
`t`'s `lower_prefill`, `lower_tell` and `lower_update` at the same depth and rows: the layers' weight products and
attention contractions (`_bare_layers`, a `lax.scan` over the stacked layers as `forward` runs them), `tell`'s
estimate and optimizer update, and the update's forward, gradient and optimizer step; each docstring says what is
left out.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from esroll import es, sharding
from esroll.es import estimators
from esroll.config import make_optimizer
from esroll.models import STACKED
from experiments.benchmarks._tpu_programs import DATA, CaseTarget, sds, tree_shardings


def _bare_layers(t: CaseTarget, cfg, x_BxTxD, layers, layer_params=lambda w: w):
    """The layers' weight products and attention contractions on activations x, nothing else (no norm, rotary,
    softmax, mask or bias): per layer q, k, v = x·W_q, x·W_k, x·W_v; s = q·kᵀ (float32), o = s·v; x += o·W_o;
    x += (x·W_gate ⊙ x·W_up)·W_down. A `lax.scan` over the stacked layers as `forward` runs them. Returns the
    activations and each layer's keys and values [L, B, T, K, H] (what a prefill writes into the cache)."""
    c = t.model_cfg
    K, G, H = c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim
    rows = PartitionSpec(DATA) if t.tensor_parallel else PartitionSpec()

    def keep(x):  # activations stay split over the rows, as the model's are
        return jax.lax.with_sharding_constraint(x, NamedSharding(t.mesh, rows)) if t.tensor_parallel else x

    def layer(x, w):
        w = layer_params(w)
        B, T, _ = x.shape
        q = (x @ w["q"]).reshape(B, T, K, G, H)
        k = (x @ w["k"]).reshape(B, T, K, H)
        v = (x @ w["v"]).reshape(B, T, K, H)
        s = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32).astype(x.dtype)
        o = jnp.einsum("bkgts,bskh->btkgh", s, v).reshape(B, T, K * G * H)
        x = keep(x + o @ w["o"])
        x = keep(x + ((x @ w["gate"]) * (x @ w["up"])) @ w["down"])
        return x, (k, v)

    weights = {n: layers[n] for n in ("q", "k", "v", "o", "gate", "up", "down")}
    return jax.lax.scan(layer, keep(x_BxTxD), weights, unroll=t.cfg.parallel.scan_unroll)


def lower_prefill(t: CaseTarget, depth: int):
    """The prefill's must-do work: the prompt's embedding rows, every layer's weight products and attention
    contractions over the prompt - 1 tokens, and the keys and values written out (as many bytes as the cache
    slots the prefill fills). No cache allocated beyond them, no perturbation, no norm or softmax."""
    cfg = t.at_depth(depth)
    params = t.compute(cfg)
    prompt = sds((t.rows, t.case.prompt), jnp.int32, t.mesh, DATA)

    def prefill(params, prompt_BxP):
        x = params["embed"][prompt_BxP[:, :-1]]
        _, (k, v) = _bare_layers(t, cfg, x, params[STACKED])
        return k, v

    kv = PartitionSpec(None, DATA)
    run = t.per_device(prefill, (PartitionSpec(), PartitionSpec(DATA)), (kv, kv))
    out = NamedSharding(t.mesh, kv)
    return jax.jit(run, in_shardings=(tree_shardings(params), prompt.sharding), out_shardings=(out, out)).lower(
        params, prompt
    )


def lower_tell(t: CaseTarget):
    """`tell`'s must-do work: each perturbed leaf's estimate Σ_k w_k A_k B_kᵀ / √r from the directions' factors
    (given, split as the master leaf is: the noise's regeneration is left out) and the optimizer's update of the
    donated masters and moments with the trainer's optimizer (optax), each read and written once."""
    es_cfg = t.cfg.es_config
    masters = t.masters(t.model_cfg, t.cfg.model.master_dtype)
    state = t.es_state(masters)
    train = es.trainable(es_cfg, masters)
    directions, rank = estimators.num_directions(es_cfg.method, es_cfg.population), es_cfg.rank
    optimizer = make_optimizer(t.cfg.optimizer)

    def factor(x, side):  # [L, E, n, r] (stacked) or [E, n, r]: n the master's in (side 0) or out (1) axis
        spec = list(x.sharding.spec) + [None] * (x.ndim - len(x.sharding.spec))
        lead, n = spec[:-2], spec[x.ndim - 2 + side]
        shape = (*x.shape[:-2], directions, x.shape[x.ndim - 2 + side], rank)
        return sds(shape, jnp.float32, t.mesh, *lead, None, n, None)

    a = jax.tree.map(lambda x: factor(x, 0), train)
    b = jax.tree.map(lambda x: factor(x, 1), train)
    w = sds((directions,), jnp.float32, t.mesh)
    splits = tree_shardings(train)

    def tell(train, opt_state, a, b, w_E):
        def estimate(a, b, x, split):
            spec = "...eir,...eor->...io"
            g = jnp.einsum(spec, a * (w_E[:, None, None] / math.sqrt(rank)), b)
            return jax.lax.with_sharding_constraint(g.astype(x.dtype), split)

        grad = jax.tree.map(estimate, a, b, train, splits)
        updates, opt_state = optimizer.update(jax.tree.map(jnp.negative, grad), opt_state, train)
        return optax.apply_updates(train, updates), opt_state

    return jax.jit(
        tell, donate_argnums=(0, 1), out_shardings=(tree_shardings(train), tree_shardings(state.opt_state))
    ).lower(train, state.opt_state, a, b, w)


def lower_update(t: CaseTarget, depth: int, rows: int):
    """The GRPO update's must-do work on `rows` rows of prompt + completion: the masters cast to the compute
    dtype and gathered layer by layer as the update does, the forward's weight products and attention
    contractions (`_bare_layers`) and the head over the completion tokens, their log-softmax at the tokens
    weighted by the advantages, its gradient (`jax.grad`: the backward's products, no rematerialisation), and
    the optimizer's update of the masters and moments (read and written once)."""
    c = t.grpo_cfg
    cfg = t.at_depth(depth)
    masters, state = t.grpo_state(cfg)
    P, N = t.case.prompt, c.train.max_new_tokens
    tokens = sds((rows, P + N), jnp.int32, t.mesh, DATA)
    advantage = sds((rows,), jnp.float32, t.mesh, DATA)
    optimizer = make_optimizer(c.optimizer)
    mesh, dtype = t.mesh, jnp.dtype(c.model.dtype)

    def gather_layer(w):
        w = jax.lax.with_sharding_constraint(w, sharding.master_shardings(mesh, w, layer=True))
        return jax.lax.with_sharding_constraint(w, sharding.compute_shardings(mesh, w, layer=True))

    def loss(masters, tokens_BxT, advantage_B):
        p = jax.tree.map(lambda x: x.astype(dtype), masters)
        top = {k: v for k, v in p.items() if k != STACKED}
        top = jax.lax.with_sharding_constraint(top, sharding.compute_shardings(mesh, top))
        x = top["embed"][tokens_BxT[:, :-1]]
        x, _ = _bare_layers(t, cfg, x, p[STACKED], gather_layer)
        head = top["embed"].T if cfg.tie_word_embeddings else top["lm_head"]
        logits = jnp.einsum("bnd,dv->bnv", x[:, P - 1 :], head, preferred_element_type=jnp.float32)
        chosen = jnp.take_along_axis(logits, tokens_BxT[:, P:, None], axis=-1)[..., 0]
        logp = chosen - jax.nn.logsumexp(logits, axis=-1)
        return -(logp * advantage_B[:, None]).sum()

    def update(masters, opt_state, tokens_BxT, advantage_B):
        grads = jax.grad(loss)(masters, tokens_BxT, advantage_B)
        grads = jax.lax.with_sharding_constraint(grads, sharding.master_shardings(mesh, grads))
        updates, opt_state = optimizer.update(grads, opt_state, masters)
        return optax.apply_updates(masters, updates), opt_state

    return jax.jit(update, out_shardings=(tree_shardings(masters), tree_shardings(state.opt_state))).lower(
        masters, state.opt_state, tokens, advantage
    )
