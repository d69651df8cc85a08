"""GRPO, the gradient-based baseline: same model, prompts, sampler and rewards as ES; only the estimator differs.

One step: G completions per prompt from `generate` (which also returns π_old per token) → rewards → group
advantages (`esroll.advantages`) → `inner_iterations` passes over `minibatches` minibatches, one optimizer step each,
on the clipped surrogate plus β·KL to the initial policy (`grpo_loss`).

π_old. The first minibatch of the first pass is scored by the parameters that sampled it, so its ratio is computed as
exp(logp − stop_gradient(logp)): exactly 1, with the policy gradient as its gradient. Every later update uses the
log-probabilities `generate` returned (KV-cache path; they may differ from a full forward by ~1e-6, far inside any
clip range), so no extra forward pass is spent on π_old.

Sharding: the ("data", "model") mesh and layout of ES (`esroll.sharding`). The `model.master_dtype` masters, the
optimizer state and the reference parameters are split over "data" (FSDP / ZeRO-3) and over "model" (heads, MLP
columns, vocabulary). The loss casts the shards to `model.dtype` and gathers them over "data" one layer at a time,
inside the model's scan (`_gather_layer`), into the tensor-parallel compute layout, so that the forward and backward
passes are split over "model" as decoding is; each layer's gradient comes back reduce-scattered to the master shards.
The rows of each microbatch are split over "data", padded up to a multiple of its size with masked rows (no
completion or prompt token, zero advantage and token weight), which add exactly nothing to the loss or the gradient:
any device count takes any batch. Sampling (`esroll.rollout`) decodes from the same cast of the masters that ES
decodes from, tensor-parallel over "model", rows split over "data".

Shapes (the legend in `esroll/__init__.py`): X prompts per step, M completions per prompt (`group_size`), B = X·M rows,
P padded prompt length, N = max_new_tokens, U microbatches of b rows per minibatch.

Memory (the update's temporaries): each layer of the policy's forward is rematerialised (`remat`), so the backward
pass keeps O(L·b·T·D) activations in the model dtype rather than every layer's float32 attention scores, and the
log-probabilities come from the completion positions only, `logprob_chunk` at a time (`sequence_logprobs`), so no
[b, T, V] float32 logits buffer exists.

The settings, `GRPOConfig`, live in `esroll.config` with every other config (importable from here); the names they
hold are checked against the registries by `check_names`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from esroll import advantages, diagnostics, grpo_variants, ledger, parallel, sharding
from esroll.config import (
    AdvantageConfig,
    ConfigError,
    ExperimentConfig,
    GRPOConfig,
    OptimConfig,
    check_fields,
    make_optimizer,
)
from esroll.data import Example
from esroll.grpo_variants import LossTerms, Sampled
from esroll.models import STACKED
from esroll.models.transformer import REMAT_POLICIES
from esroll.rollout import Sampling, prompt_means, rollout, training_rewards
from esroll.sampling import sequence_logprobs
from esroll.task import Method, StepOutput, Task

Array = jax.Array
AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "constant_length")


def check_names(g: GRPOConfig) -> None:
    """Raise the one-line ConfigError of the first name in `g` that names no implementation (its advantage estimator,
    `esroll.advantages.ESTIMATORS`; its variants, `esroll.grpo_variants.VARIANTS`; its aggregation, `AGGREGATIONS`;
    its remat policy, `esroll.models.transformer.REMAT_POLICIES`), of a group size the estimator cannot use (>= 2,
    but for the single-rollout estimators, `esroll.advantages.SINGLE_ROLLOUT`), or of settings a variant refuses
    (`Variant.check`). `GRPOConfig` (in `esroll.config`) checks everything else when it is built but cannot see these
    registries; `make_update` and `make_grpo_method` run this, so that a config built by hand is refused before
    anything runs."""
    single = g.advantage in advantages.SINGLE_ROLLOUT
    unknown = [v for v in g.variants if v not in grpo_variants.VARIANTS]
    checks = [
        ("advantage", g.advantage in advantages.ESTIMATORS, advantages.ESTIMATORS.expected()),
        ("group_size", single or g.group_size >= 2, ">= 2"),
        ("variants", not unknown, f"names among {', '.join(grpo_variants.VARIANTS)}"),
        ("aggregation", g.aggregation in AGGREGATIONS, f"one of {', '.join(AGGREGATIONS)}"),
        ("remat", isinstance(g.remat, str) and g.remat in REMAT_POLICIES, f"one of {', '.join(REMAT_POLICIES)}"),
    ]
    check_fields(g, checks, "GRPOConfig")
    for _, variant in grpo_variants.active(g):
        variant.check(g)


# ---- the loss: a pure function of log-probabilities


def token_weights(mask_BxN: Array, aggregation: str) -> Array:
    """Weights w [B, N] with loss = Σ w·loss_t for each aggregation mode (0 on padding).

    seq_mean_token_mean (GRPO): 1 / (len_i · B);  token_mean (DAPO): 1 / Σ len;  constant_length (Dr. GRPO):
    1 / (B · N), N = max_new_tokens. Computed over a whole minibatch and then split, they make the sum of its
    microbatch losses equal the minibatch loss in every mode.
    """
    mask = jnp.asarray(mask_BxN, jnp.float32)
    B, N = mask.shape
    if aggregation == "seq_mean_token_mean":
        return mask / (jnp.maximum(mask.sum(1, keepdims=True), 1.0) * B)
    if aggregation == "token_mean":
        return mask / jnp.maximum(mask.sum(), 1.0)
    if aggregation == "constant_length":
        return mask / (B * N)
    raise ValueError(f"unknown GRPO aggregation {aggregation!r}; known: {', '.join(AGGREGATIONS)}")


def grpo_loss(
    logp_new_BxN: Array,
    logp_old_BxN: Array,
    logp_ref_BxN: Array | None,
    advantage: Array,
    mask_BxN: Array,
    *,
    eps_low: float | Array,
    eps_high: float | Array,
    beta: float,
    aggregation: str,
    weights_BxN: Array | None = None,
) -> tuple[Array, dict]:
    """Clipped surrogate −min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A) + β·(exp(d) − d − 1), d = log π_ref − log π_θ,
    aggregated by `aggregation` (or by explicit `weights_BxN`, see `token_weights`). `advantage` is one per
    completion [B] or one per token [B, N]; the half-widths are floats or per token [B, N]. The clip is active (its
    branch constant, gradient zero) only where ρ is strictly outside [1−ε_low, 1+ε_high] on the side A's sign makes
    binding (ρ < 1−ε_low with A < 0, ρ > 1+ε_high with A > 0); at ρ = 1 the gradient is the unclipped one for any
    ε ≥ 0.

    logp_ref None means no KL term (β must then be 0). Metrics are token means over this call's tokens: `kl` (the
    k3 estimate), `clip_fraction` (tokens whose clipped branch is active, so their gradient is zero).
    """
    if logp_ref_BxN is None and beta:
        raise ValueError("grpo_loss: beta > 0 needs the reference log-probabilities")
    mask = jnp.asarray(mask_BxN, bool)
    w_BxN = token_weights(mask, aggregation) if weights_BxN is None else weights_BxN
    adv_BxN = jnp.asarray(advantage, jnp.float32)
    adv_BxN = adv_BxN[:, None] if adv_BxN.ndim == 1 else adv_BxN
    ratio_BxN = jnp.exp(logp_new_BxN - logp_old_BxN)
    # min(ρA, clip(ρ)A) written as a selection: the clipped (constant) branch only where ρ is strictly outside the
    # range on the side A's sign makes binding, so a tie (ρ = 1 at ε = 0) takes the unclipped branch and its full
    # gradient; jnp.minimum / jnp.clip would split the gradient there.
    clipped_BxN = ((ratio_BxN < 1 - eps_low) & (adv_BxN < 0)) | ((ratio_BxN > 1 + eps_high) & (adv_BxN > 0))
    bound_BxN = jax.lax.stop_gradient(jnp.where(adv_BxN < 0, 1 - eps_low, 1 + eps_high))
    loss_BxN = -jnp.where(clipped_BxN, bound_BxN * adv_BxN, ratio_BxN * adv_BxN)
    kl_BxN = jnp.zeros_like(loss_BxN)
    if logp_ref_BxN is not None:
        d_BxN = logp_ref_BxN - logp_new_BxN
        kl_BxN = jnp.exp(d_BxN) - d_BxN - 1
        loss_BxN = loss_BxN + beta * kl_BxN
    n_tokens = jnp.maximum(mask.sum(), 1)
    metrics = {
        "kl": jnp.where(mask, kl_BxN, 0.0).sum() / n_tokens,
        "clip_fraction": (clipped_BxN & mask).sum() / n_tokens,
    }
    return jnp.where(mask, w_BxN * loss_BxN, 0.0).sum(), metrics


# ---- sharding: the ES layout (`esroll.sharding`), one layer gathered at a time


def _gather(mesh: Mesh, tree: dict) -> dict:
    """The top-level leaves (embedding, head, final norm) as a forward pass uses them: laid out by the compute rules
    (FSDP's all-gather over "data"; still split over "model")."""
    return jax.lax.with_sharding_constraint(tree, sharding.compute_shardings(mesh, tree))


def _gather_layer(mesh: Mesh, layer: dict) -> dict:
    """One layer's weights (inside the model's scan over layers) pinned to their master shards, then gathered over
    "data" into the compute layout. The first constraint's transpose is what matters in the backward pass: it returns
    the layer's gradient reduce-scattered to the master shards, so the scan never builds a full gradient of every
    layer."""
    layer = jax.lax.with_sharding_constraint(layer, sharding.master_shardings(mesh, layer, layer=True))
    return jax.lax.with_sharding_constraint(layer, sharding.compute_shardings(mesh, layer, layer=True))


# ---- one optimizer step on one minibatch


class GRPOState(NamedTuple):
    opt_state: Any
    ref_params: dict | None  # the frozen initial policy; None unless `keeps_reference` (no reference forward at all)
    host: dict | None = None  # the host-side running state (`host_state`), replicated


def host_state(g: GRPOConfig) -> dict | None:
    """The running state kept on the host between steps: the advantage estimator's (`esroll.advantages.init_state`)
    under its own keys, each variant's (`Variant.init_state`) under "<variant>_<key>"; None when there is none."""
    state = dict(advantages.init_state(g.advantage, g.adv) or {})
    for name, variant in grpo_variants.active(g):
        state.update({f"{name}_{k}": v for k, v in variant.init_state(g).items()})
    return state or None


def _split_host(g: GRPOConfig, host: dict | None) -> tuple[dict | None, dict[str, dict]]:
    """`host_state`'s dict as (the estimator's state or None, {variant: its state})."""
    host = {} if host is None else {k: np.asarray(v) for k, v in host.items()}
    mine = {name: {k[len(name) + 1 :]: v for k, v in host.items() if k.startswith(name + "_")} for name in g.variants}
    theirs = {k for name in g.variants for k in host if k.startswith(name + "_")}
    return {k: v for k, v in host.items() if k not in theirs} or None, mine


def keeps_reference(g: GRPOConfig) -> bool:
    """Whether the initial policy is kept: the KL term (β > 0) or a variant (`Variant.needs_reference`) reads it."""
    return g.beta > 0 or any(v.needs_reference(g) for _, v in grpo_variants.active(g))


def init_state(g: GRPOConfig, optimizer, params) -> GRPOState:
    """The optimizer state, the parameters as the frozen reference policy when one is kept (`keeps_reference`), and
    the host-side running state when there is one (`host_state`)."""
    host = host_state(g)
    host = None if host is None else {k: jnp.asarray(v) for k, v in host.items()}
    return GRPOState(optimizer.init(params), params if keeps_reference(g) else None, host)


def state_shardings(g: GRPOConfig, optim: OptimConfig, mesh: Mesh, params) -> GRPOState:
    """Where a GRPO state lives: the optimizer moments like the master weights they mirror, the reference policy like
    the masters, step counts and the host-side state replicated."""
    host = host_state(g)
    replicated = NamedSharding(mesh, PartitionSpec())
    return GRPOState(
        sharding.state_shardings(mesh, make_optimizer(optim), params),
        sharding.master_shardings(mesh, params) if keeps_reference(g) else None,
        None if host is None else {k: replicated for k in host},
    )


class Rollouts(NamedTuple):
    """Sampled rows of one minibatch, split into microbatches: every field is [U, b, ...] (U microbatches of b rows)."""

    prompt: Array  # [U, b, P] int32, left-padded
    prompt_mask: Array  # [U, b, P] bool
    completion: Array  # [U, b, N] int32
    completion_mask: Array  # [U, b, N] bool: up to and including EOS
    logp_old: Array  # [U, b, N] float32: π_old from generate
    advantage: (
        Array  # [U, b, N] float32: each token's advantage (the trainer broadcasts a sequence-level one); or [U, b]
    )
    weight: Array  # [U, b, N] float32: token_weights over the whole minibatch, times the variants' factors

    @classmethod
    def abstract(cls, microbatches: int, rows: int, prompt_len: int, new_tokens: int, sharding) -> Rollouts:
        """`jax.ShapeDtypeStruct`s of a batch of U = `microbatches` × `rows` rows with `sharding`, for lowering
        `make_update` ahead of time (`esroll.plan`, the `tpu_cost` benchmark)."""

        def field(shape, dtype):
            return jax.ShapeDtypeStruct((microbatches, rows, *shape), dtype, sharding=sharding)

        tokens = (new_tokens,)
        return cls(
            prompt=field((prompt_len,), jnp.int32),
            prompt_mask=field((prompt_len,), bool),
            completion=field(tokens, jnp.int32),
            completion_mask=field(tokens, bool),
            logp_old=field(tokens, jnp.float32),
            advantage=field(tokens, jnp.float32),
            weight=field(tokens, jnp.float32),
        )


def _minibatch_gradient(model_cfg, grpo: GRPOConfig, mesh: Mesh, compute_dtype: str | None):
    """gradient(params, ref_params, batch, on_policy) -> (grads, metrics): the loss's gradient on one minibatch,
    summed over its microbatches (a `lax.scan`), and its metrics; traceable, for `make_update` and `make_gradient`.
    The variants with loss hooks (`Variant.in_loss`) change the per-token advantages and clip ranges and add
    metrics."""
    variants = [v for _, v in grpo_variants.active(grpo) if v.in_loss]

    def logprobs(p, micro: Rollouts):
        """(log π [b, N], entropy [b, N]) of the microbatch's completions under parameters `p`."""
        if compute_dtype is not None:  # cast the shards: the gathers then move model-dtype bytes
            p = jax.tree.map(lambda x: x.astype(compute_dtype), p)
        # The top-level leaves (embedding, head, final norm) are gathered here; each layer's weights inside the
        # model's scan, one layer at a time (`_gather_layer`).
        p = {**_gather(mesh, {k: v for k, v in p.items() if k != STACKED}), STACKED: p[STACKED]}
        return sequence_logprobs(
            model_cfg,
            p,
            micro.prompt,
            micro.prompt_mask,
            micro.completion,
            micro.completion_mask,
            remat=grpo.remat,
            chunk=grpo.logprob_chunk,
            with_entropy=True,
            layer_params=functools.partial(_gather_layer, mesh),
        )

    def micro_loss(params, ref_params, micro: Rollouts, on_policy):
        logp, entropy = logprobs(params, micro)  # the entropy: a metric, from the same forward
        # The reference is scored by the very computation that scores the policy, so log π_θ − log π_ref is exactly
        # 0 at the reference parameters.
        logp_ref = None if ref_params is None else jax.lax.stop_gradient(logprobs(ref_params, micro)[0])
        logp_old = jnp.where(on_policy, jax.lax.stop_gradient(logp), micro.logp_old)
        advantage = micro.advantage[:, None] if micro.advantage.ndim == 1 else micro.advantage  # [b, 1] or [b, N]
        terms = LossTerms(
            logp, logp_old, logp_ref, micro.completion_mask, advantage, grpo.epsilon_low, grpo.epsilon_high
        )
        extra = [v.loss_metrics(grpo, terms) for v in variants]
        for v in variants:
            terms = v.loss_terms(grpo, terms)
        loss, metrics = grpo_loss(
            *terms[:3],
            terms.advantage,
            terms.mask,
            eps_low=terms.eps_low,
            eps_high=terms.eps_high,
            beta=grpo.beta,
            aggregation=grpo.aggregation,
            weights_BxN=micro.weight,
        )
        # Sums, so that the minibatch's entropy is a mean over its tokens whatever the microbatches hold (padding).
        metrics["entropy_sum"] = jnp.where(micro.completion_mask, jax.lax.stop_gradient(entropy), 0.0).sum()
        metrics["tokens"] = jnp.asarray(micro.completion_mask, jnp.float32).sum()
        return loss, (metrics, extra)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def gradient(params, ref_params, batch: Rollouts, on_policy: Array):
        def accumulate(grads, micro: Rollouts):
            micro = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, parallel.rows(mesh)), micro)
            (loss, (metrics, extra)), g = grad_fn(params, ref_params, micro, on_policy)
            return jax.tree.map(jnp.add, grads, g), ({"loss": loss, **metrics}, extra)

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, (metrics_U, extra_U) = jax.lax.scan(accumulate, zeros, batch)
        metrics = {
            "loss": metrics_U["loss"].sum(),
            "kl": metrics_U["kl"].mean(),
            "clip_fraction": metrics_U["clip_fraction"].mean(),
            "entropy": metrics_U["entropy_sum"].sum() / jnp.maximum(metrics_U["tokens"].sum(), 1.0),
        }
        for v, m_U in zip(variants, extra_U):
            metrics.update(v.reduce_metrics(grpo, m_U))
        return grads, metrics

    return gradient


@functools.cache
def make_update(model_cfg, grpo: GRPOConfig, optim: OptimConfig, mesh: Mesh, compute_dtype: str | None = None):
    """The jitted optimizer step on one minibatch, its gradient summed over microbatches (a `lax.scan`):
    update(params, state, batch, on_policy) -> (params, state, metrics).

    `on_policy` (traced bool) marks the update whose parameters sampled the batch: π_old := stop_gradient(π_θ).
    With `compute_dtype`, the loss runs on the gathered parameters cast to it (the masters keep their dtype, and the
    gradient arrives in it). The variants with loss hooks (`Variant.in_loss`) change the per-token advantages and
    clip ranges and add metrics. Parameters and state come out FSDP-sharded, whatever their input sharding. One per
    (model, GRPO config, optimizer config, mesh) in a process, so that runs of one process share their compilation.
    A name in `grpo` that no module implements is refused first (`check_names`).
    """
    check_names(grpo)
    optimizer = make_optimizer(optim)
    gradient = _minibatch_gradient(model_cfg, grpo, mesh, compute_dtype)

    # Not donated: on the 1.7B plan (v5e:2x2) donating params and state raised the update's temporaries from 4.7 to
    # 11.2 GiB per chip (copies XLA inserts so that the scan over microbatches still reads the old masters).
    @jax.jit
    def update(params, state: GRPOState, batch: Rollouts, on_policy: Array):
        grads, metrics = gradient(params, state.ref_params, batch, on_policy)
        updates, opt_state = optimizer.update(grads, state.opt_state, params)
        params = optax.apply_updates(params, updates)
        masters = sharding.master_shardings(mesh, params)  # out in the layout they came in: one compilation
        params = jax.lax.with_sharding_constraint(params, masters)
        opt_state = jax.lax.with_sharding_constraint(
            opt_state, sharding.state_shardings(mesh, optimizer, params, opt_state)
        )
        metrics["grad_norm"] = optax.tree.norm(grads)
        return params, state._replace(opt_state=opt_state), metrics

    return update


@functools.cache
def make_gradient(model_cfg, grpo: GRPOConfig, mesh: Mesh, compute_dtype: str | None = None):
    """The jitted gradient of the loss on one minibatch, no optimizer step: gradient(params, ref_params, batch,
    on_policy) -> (grads, metrics), grads in the masters' layout (what the estimator diagnostics compare)."""
    check_names(grpo)
    gradient = _minibatch_gradient(model_cfg, grpo, mesh, compute_dtype)

    @jax.jit
    def run(params, ref_params, batch: Rollouts, on_policy: Array):
        grads, metrics = gradient(params, ref_params, batch, on_policy)
        return jax.lax.with_sharding_constraint(grads, sharding.master_shardings(mesh, grads)), metrics

    return run


# ---- the method: sample, score, update


def pad_rows(x_Uxb: np.ndarray, rows: int) -> np.ndarray:
    """[U, b, ...] -> [U, rows, ...] with zero (False) rows appended: no prompt or completion token, advantage 0,
    token weight 0. `grpo_loss` masks every term of such a row out, so it adds exactly 0 to the loss and gradient;
    it only makes a microbatch split evenly over the data axis."""
    widths = [(0, 0), (0, rows - x_Uxb.shape[1])] + [(0, 0)] * (x_Uxb.ndim - 2)
    return np.pad(x_Uxb, widths)


def update_config(g: GRPOConfig) -> GRPOConfig:
    """`g` without what acts only on the host (the estimator, the group size, the variants without loss hooks and
    their options): runs that differ only there share one compiled update, and the planner compiles the trainer's
    program."""
    host_only = [(name, v) for name, v in grpo_variants.active(g) if not v.in_loss]
    defaults = {v.options: type(getattr(g, v.options))() for _, v in host_only if v.options}
    kept = tuple(name for name in g.variants if name not in dict(host_only))
    return dataclasses.replace(g, advantage="grpo", adv=AdvantageConfig(), group_size=2, variants=kept, **defaults)


def make_batches(
    out, mask_BxN, advantage_BxN, factor_BxN, aggregation: str, minibatches: int, microbatches: int, mesh: Mesh
) -> list[Rollouts]:
    """A step's B sampled rows as `minibatches` `Rollouts` on `mesh`, each split into `microbatches` of b rows (b
    padded to a multiple of the data axis with masked rows). Minibatch m is rows [m·B/n_mini, (m+1)·B/n_mini), whole
    prompt groups when n_mini divides X; its token weights (`token_weights`, times `factor_BxN`) are computed over
    its real rows, before the padding."""
    B = mask_BxN.shape[0]
    b = B // (minibatches * microbatches)  # rows per microbatch
    data = parallel.data_size(mesh)
    b_padded = -(-b // data) * data
    micro_rows = NamedSharding(mesh, PartitionSpec(None, parallel.AXIS))
    batches = []
    for m in range(minibatches):
        rows = slice(m * microbatches * b, (m + 1) * microbatches * b)
        weight = (
            np.asarray(token_weights(mask_BxN[rows], aggregation)) * np.broadcast_to(factor_BxN, mask_BxN.shape)[rows]
        )
        fields = (
            out.prompt_BxP[rows],
            out.prompt_mask_BxP[rows],
            out.tokens_BxN[rows],
            mask_BxN[rows],
            out.logprobs_BxN[rows],
            advantage_BxN[rows],
            weight.astype(np.float32),
        )
        split = (pad_rows(x.reshape(microbatches, b, *x.shape[1:]), b_padded) for x in fields)
        batches.append(Rollouts(*(parallel.put(micro_rows, x) for x in split)))
    return batches


def _completion_mask(out) -> np.ndarray:
    return np.arange(out.tokens_BxN.shape[1])[None, :] < out.length_B[:, None]


def _group(out, rewards_XxM, mask_BxN, examples, step_index: int, seed: int, label_free: bool) -> advantages.Group:
    """What the advantage estimators read of a step's X × M sampled rows (`esroll.advantages.Group`)."""
    X, M = rewards_XxM.shape
    N = mask_BxN.shape[1]
    seq_logp = np.where(mask_BxN, out.logprobs_BxN, 0.0).sum(1) / np.maximum(out.length_B, 1)
    return advantages.Group(
        rewards_XxM,
        step=step_index,
        seed=seed,
        seq_logp=seq_logp.reshape(X, M),
        token_logp=out.logprobs_BxN.reshape(X, M, N),
        token_mask=mask_BxN.reshape(X, M, N),
        answers=out.answer_B.reshape(X, M) if label_free else None,
        examples=examples,
    )


def split_half_diagnostics(gradient, params, ref_params, batches_of, X: int, M: int) -> dict:
    """The split-half diagnostics (`esroll.diagnostics`) of a GRPO step's on-policy gradient at `params`: the
    gradient from the prompt groups of even index against the one from the odd ones (`batches_of(factor_BxN)`
    builds the step's minibatches with its token weights times that factor: 2 on a half's rows, 0 elsewhere, so
    that each half estimates the full gradient and their mean is it exactly). Groups are independent given the
    parameters, so the halves are too; the noise counted is that of the prompts drawn and of the completions
    sampled."""
    halves = []
    for h in (0, 1):
        keep_B = (np.arange(X * M) // M) % 2 == h
        factor = np.broadcast_to(2.0 * keep_B[:, None], (X * M, 1)).astype(np.float32)
        halves.append([gradient(params, ref_params, batch, jnp.asarray(True))[0] for batch in batches_of(factor)])
    return jax.device_get(_split_half_figures(*halves))


@jax.jit
def _split_half_figures(parts1: list, parts2: list) -> dict:
    """`esroll.diagnostics.as_metrics` of the halves, each the sum of its minibatches' gradients: one program (op by op,
    the reductions of sharded arrays would each be a program of their own)."""
    g1, g2 = (functools.reduce(lambda a, b: jax.tree.map(jnp.add, a, b), parts) for parts in (parts1, parts2))
    return diagnostics.as_metrics(diagnostics.split_half_by_group(g1, g2))


def make_grpo_method(cfg: ExperimentConfig, task: Task, mesh: Mesh, rows_per_device: int | None = None) -> Method:
    """The GRPO method; sampling decodes `rows_per_device` rows per device at once (as `esroll.plan` chose them),
    else `parallel.rows_per_device` (0: all of a device's share). `step` expects the masters as `esroll.task.load_task`
    places them on `mesh` and the state as `init` (or a restore into its layout) leaves it; the update returns both in
    that layout, so it compiles once. A name in `cfg.grpo` that no module implements is refused first
    (`check_names`, naming the key as a config file spells it)."""
    g = cfg.grpo
    try:
        check_names(g)
    except ConfigError as e:
        raise e.under("grpo.") from None
    X, M, N = cfg.train.prompts_per_step, g.group_size, cfg.train.max_new_tokens
    label_free = cfg.data.reward == "majority"  # rewards from the group's majority answer, not the gold one
    to_compute = sharding.caster(mesh, cfg.model.dtype)  # the decoding copy (model.dtype) of the masters
    sample_key = jax.random.key(cfg.seed + 1)
    sampling = Sampling.of(N, g.temperature, cfg.parallel, rows_per_device or cfg.parallel.rows_per_device)
    compiled = update_config(g)
    step_update = make_update(task.cfg, compiled, cfg.optimizer, mesh, cfg.model.dtype)
    optimizer = make_optimizer(cfg.optimizer)
    variants = grpo_variants.active(g)
    example_B = np.repeat(np.arange(X), M)  # rows prompt-major: row x·M + j answers prompt x
    every = cfg.train.diagnostics_every
    # FLOPs of the update (`esroll.ledger`): μ passes of forward + backward over every row, and the reference's
    # forward when one is kept.
    passes = g.inner_iterations
    update_flops = passes * ledger.train_flops(task.cfg, X * M, task.prompt_multiple, N, remat=g.remat)
    if keeps_reference(g):
        update_flops += passes * ledger.forward_flops(task.cfg, X * M, task.prompt_multiple + N, head_positions=N)

    def init(params, key):
        del key  # sampling keys are fold_in(seed, step); nothing else is random

        make = functools.partial(init_state, g, optimizer)
        return jax.jit(make, out_shardings=state_shardings(g, cfg.optimizer, mesh, params))(params)

    def step(params, state: GRPOState, examples: list[Example], step_index: int) -> StepOutput:
        # ---- sample M completions per prompt and score them
        key = jax.random.fold_in(sample_key, step_index)
        out = rollout(
            task, mesh, to_compute(params), examples, example_B, key, sampling, completions=True, answers=label_free
        )
        reward_B, metrics = training_rewards(out, label_free)
        rewards_XxM = reward_B.reshape(X, M)
        mask_BxN = _completion_mask(out)

        # ---- advantages, then the variants' token weights
        own, variant_state = _split_host(g, state.host)
        group = _group(out, rewards_XxM, mask_BxN, examples, step_index, cfg.seed, label_free)
        estimate = advantages.estimate(g.advantage, group, g.adv, own)
        advantage_BxN = np.broadcast_to(estimate.advantage.reshape(-1, 1), (X * M, N)).astype(np.float32)
        factor_BxN = np.ones((X * M, N), np.float32)
        if estimate.token_weight is not None:  # the estimator's per-token factor (e.g. ntf's filtered tokens: 0)
            factor_BxN = factor_BxN * estimate.token_weight.reshape(X * M, N)
        sampled = Sampled(out.logprobs_BxN, mask_BxN, advantage_BxN, rewards_XxM, step_index)
        for name, variant in variants:
            factor, more = variant.token_weight(g, variant_state[name], sampled)
            factor_BxN = factor_BxN if factor is None else factor_BxN * factor
            metrics.update(more)

        def batches_of(factor):
            return make_batches(
                out, mask_BxN, advantage_BxN, factor_BxN * factor, g.aggregation, g.minibatches, g.microbatches, mesh
            )

        # ---- on diagnostic steps, the split-half figures of the step's gradient at its start (never fed back)
        start = time.perf_counter()
        if every and (step_index + 1) % every == 0:
            gradient = make_gradient(task.cfg, compiled, mesh, cfg.model.dtype)
            metrics.update(split_half_diagnostics(gradient, params, state.ref_params, batches_of, X, M))
            metrics["s_diagnostics"] = time.perf_counter() - start
            start = time.perf_counter()

        # ---- μ passes over the minibatches, the first update on-policy
        batches = batches_of(np.float32(1.0))
        history = []
        for iteration in range(g.inner_iterations):
            for m, batch in enumerate(batches):
                params, state, update_metrics = step_update(
                    params, state, batch, jnp.asarray(iteration == 0 and m == 0)
                )
                history.append(update_metrics)
        update_metrics = jax.tree.map(lambda *xs: jnp.mean(jnp.stack(xs)), *history)
        jax.block_until_ready(params)
        metrics["s_update"] = time.perf_counter() - start

        # ---- the host-side state for the next step
        host = dict(estimate.state or {})
        for name, variant in variants:
            new = variant.update_state(g, variant_state[name], update_metrics)
            host.update({f"{name}_{k}": v for k, v in new.items()})
        if host:
            state = state._replace(host=parallel.put_replicated(mesh, {k: jnp.asarray(v) for k, v in host.items()}))
        generate_flops = ledger.rollout_flops(task.cfg, out.prompt_BxP.shape[1], out.length_B)
        metrics.update(
            update_metrics,
            fitness_mean=rewards_XxM.mean(),
            fitness_std=rewards_XxM.std(),
            advantage_abs=np.abs(estimate.advantage).mean(),
            s_rollout=out.seconds["generate"],
            s_scoring=out.seconds["score"],
            flops_generate=float(generate_flops),
            flops_update=float(update_flops),
            **(estimate.metrics or {}),
        )
        if M > 1:  # a group of one is trivially all-equal
            metrics["frac_groups_all_equal"] = np.mean(np.all(rewards_XxM == rewards_XxM[:, :1], axis=1))
        prompt_reward = prompt_means(example_B, reward_B, X)
        flops = generate_flops + update_flops
        return StepOutput(params, state, metrics, int(out.length_B.sum()), prompt_reward, flops)

    return Method(init, step)


def make_policy_gradient(cfg: ExperimentConfig, task: Task, mesh: Mesh):
    """pg(params, examples, step_index) -> the plain on-policy GRPO gradient, as an ascent direction in the masters'
    tree: `grpo.group_size` completions per prompt sampled from `params` at `grpo.temperature` (keys from
    seed + 2, apart from every other draw of a run), rewarded as the run's reward, group advantages (`grpo`), the
    plain loss (no variant, no KL). What an ES run's diagnostics compare its estimate with on the same prompts
    (`esroll.es.diagnostics.step_diagnostics`)."""
    g = dataclasses.replace(update_config(cfg.grpo), beta=0.0, variants=(), minibatches=1, microbatches=1)
    X, G, N = cfg.train.prompts_per_step, cfg.grpo.group_size, cfg.train.max_new_tokens
    label_free = cfg.data.reward == "majority"
    to_compute = sharding.caster(mesh, cfg.model.dtype)
    sampling = Sampling.of(N, cfg.grpo.temperature, cfg.parallel, cfg.parallel.rows_per_device)
    gradient = make_gradient(task.cfg, g, mesh, cfg.model.dtype)
    key = jax.random.key(cfg.seed + 2)
    example_B = np.repeat(np.arange(X), G)

    def pg(params, examples: list[Example], step_index: int):
        step_key = jax.random.fold_in(key, step_index)
        out = rollout(
            task,
            mesh,
            to_compute(params),
            examples,
            example_B,
            step_key,
            sampling,
            completions=True,
            answers=label_free,
        )
        reward_B, _ = training_rewards(out, label_free)
        advantage_B = advantages.estimate("grpo", advantages.Group(reward_B.reshape(X, G)), AdvantageConfig()).advantage
        mask_BxN = _completion_mask(out)
        advantage_BxN = np.broadcast_to(advantage_B.reshape(-1, 1), mask_BxN.shape).astype(np.float32)
        (batch,) = make_batches(out, mask_BxN, advantage_BxN, np.float32(1.0), g.aggregation, 1, 1, mesh)
        grads, _ = gradient(params, None, batch, jnp.asarray(True))
        return jax.tree.map(jnp.negative, grads)

    return pg
