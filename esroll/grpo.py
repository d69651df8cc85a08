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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from esroll import advantages, parallel, sharding
from esroll.config import (
    AdvantageConfig,
    ConfigError,
    ExperimentConfig,
    GRPOConfig,
    OptimConfig,
    check_fields,
    make_optimizer,
)
from esroll.data import Example, cluster_key
from esroll.models import STACKED
from esroll.models.transformer import REMAT_POLICIES
from esroll.rollout import Sampling, rollout
from esroll.sampling import sequence_logprobs
from esroll.task import Method, Task

Array = jax.Array
AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "constant_length")


def check_names(g: GRPOConfig) -> None:
    """Raise the one-line ConfigError of the first name in `g` that names no implementation (its advantage estimator,
    `esroll.advantages.ESTIMATORS`; its aggregation, `AGGREGATIONS`; its remat policy,
    `esroll.models.transformer.REMAT_POLICIES`), or of a group size the estimator cannot use (>= 2, but for the
    single-rollout estimators, `esroll.advantages.SINGLE_ROLLOUT`). `GRPOConfig` (in `esroll.config`) checks
    everything else when it is built but cannot see these registries; `make_update` and `make_grpo_method` run this,
    so that a config built by hand is refused before anything runs."""
    single = g.advantage in advantages.SINGLE_ROLLOUT
    checks = [
        ("advantage", g.advantage in advantages.ESTIMATORS, f"one of {', '.join(advantages.ESTIMATORS)}"),
        ("group_size", single or g.group_size >= 2, ">= 2"),
        ("aggregation", g.aggregation in AGGREGATIONS, f"one of {', '.join(AGGREGATIONS)}"),
        ("remat", isinstance(g.remat, str) and g.remat in REMAT_POLICIES, f"one of {', '.join(REMAT_POLICIES)}"),
    ]
    check_fields(g, checks, "GRPOConfig")


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
    advantage_B: Array,
    mask_BxN: Array,
    *,
    eps_low: float,
    eps_high: float,
    beta: float,
    aggregation: str,
    weights_BxN: Array | None = None,
    progress_coef: float = 0.0,
    eps_BxN: Array | None = None,
) -> tuple[Array, dict]:
    """Clipped surrogate −min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A) + β·(exp(d) − d − 1), d = log π_ref − log π_θ,
    aggregated by `aggregation` (or by explicit `weights_BxN`, see `token_weights`). The clip is active (its branch
    constant, gradient zero) only where ρ is strictly outside [1−ε_low, 1+ε_high] on the side A's sign makes binding
    (ρ < 1−ε_low with A < 0, ρ > 1+ε_high with A > 0); at ρ = 1 the gradient is the unclipped one for any ε ≥ 0.

    logp_ref None means no KL term (β must then be 0). Metrics are token means over this call's tokens: `kl` (the
    k3 estimate), `clip_fraction` (tokens whose clipped branch is active, so their gradient is zero).
    """
    if logp_ref_BxN is None and beta:
        raise ValueError("grpo_loss: beta > 0 needs the reference log-probabilities")
    mask = jnp.asarray(mask_BxN, bool)
    w_BxN = token_weights(mask, aggregation) if weights_BxN is None else weights_BxN
    adv_BxN = jnp.asarray(advantage_B, jnp.float32)[:, None]
    if progress_coef:  # the progress advantage: + η·(log π_θ − log π_ref), no gradient through it
        if logp_ref_BxN is None:
            raise ValueError("grpo_loss: progress_coef > 0 needs the reference log-probabilities")
        adv_BxN = adv_BxN + progress_coef * jax.lax.stop_gradient(logp_new_BxN - logp_ref_BxN)
    ratio_BxN = jnp.exp(logp_new_BxN - logp_old_BxN)
    if eps_BxN is not None:  # per-token clip ranges (ACPO)
        eps_low, eps_high = eps_BxN, eps_BxN
    # min(ρA, clip(ρ)A) written as a selection: the clipped (constant) branch only where ρ is strictly outside the
    # range on the side A's sign makes binding, so a tie (ρ = 1 at ε = 0) takes the unclipped branch and its full
    # gradient; jnp.minimum / jnp.clip would split the gradient there.
    clipped_BxN = ((ratio_BxN < 1 - eps_low) & (adv_BxN < 0)) | ((ratio_BxN > 1 + eps_high) & (adv_BxN > 0))
    bound_BxN = jax.lax.stop_gradient(jnp.where(adv_BxN < 0, 1 - eps_low, 1 + eps_high))
    surrogate_BxN = jnp.where(clipped_BxN, bound_BxN * adv_BxN, ratio_BxN * adv_BxN)
    loss_BxN = -surrogate_BxN
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
    if logp_ref_BxN is not None:  # where training has moved the policy, token by token (0 at the reference)
        progress_BxN = jax.lax.stop_gradient(logp_new_BxN - logp_ref_BxN)
        metrics["progress_mean"] = jnp.where(mask, progress_BxN, 0.0).sum() / n_tokens
    return jnp.where(mask, w_BxN * loss_BxN, 0.0).sum(), metrics


PROGRESS_BUCKETS = 8


def progress_by_position(sum_N: Array, tokens_N: Array, buckets: int = PROGRESS_BUCKETS) -> dict[str, Array]:
    """Where training has moved the policy along the completion: `progress_pos_k` is the mean of log π_θ − log π_ref
    over the completion tokens at positions [k·N/K, (k+1)·N/K) (K = min(buckets, N) equal spans of the N completion
    positions; NaN where no completion reached). From per-position sums and token counts over a step's rows."""
    N = sum_N.shape[0]
    edges = np.linspace(0, N, min(buckets, N) + 1).round().astype(int)
    out = {}
    for k, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        n = tokens_N[lo:hi].sum()
        out[f"progress_pos_{k}"] = jnp.where(n > 0, sum_N[lo:hi].sum() / jnp.maximum(n, 1.0), jnp.nan)
    return out


def acpo_bounds(
    ratio_BxN: Array,
    logp_old_BxN: Array,
    mask_BxN: Array,
    edges: tuple[float, ...],
    scale: float,
    low: float,
    high: float,
) -> tuple[Array, Array]:
    """ACPO's clip half-widths: (ε per token [B, N], ε per group [K]). Tokens are grouped by their old probability
    π_old at `edges` (K = len(edges) + 1 groups, lowest probabilities first); a group's ε_k is scale × the sample std
    of its tokens' ratios, clipped to [low, high] (a group with fewer than 2 tokens gets `low`). No gradient flows
    through the bounds."""
    ratio = jax.lax.stop_gradient(ratio_BxN)
    mask = jnp.asarray(mask_BxN, bool)
    group_BxN = jnp.searchsorted(jnp.asarray(edges, jnp.float32), jnp.exp(logp_old_BxN), side="right")
    K = len(edges) + 1
    member_KxBxN = (group_BxN[None] == jnp.arange(K)[:, None, None]) & mask[None]
    n_K = member_KxBxN.sum((1, 2))
    mean_K = jnp.where(member_KxBxN, ratio[None], 0.0).sum((1, 2)) / jnp.maximum(n_K, 1)
    var_K = jnp.where(member_KxBxN, (ratio[None] - mean_K[:, None, None]) ** 2, 0.0).sum((1, 2)) / jnp.maximum(
        n_K - 1, 1
    )
    eps_K = jnp.where(n_K >= 2, jnp.clip(scale * jnp.sqrt(var_K), low, high), low)
    return eps_K[group_BxN], eps_K


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
    adv: dict | None = None  # the host-side methods' running state (`host_state`), replicated


def host_state(grpo: GRPOConfig) -> dict | None:
    """The running state of the host-side methods: the advantage estimator's (`esroll.advantages.init_state`) and
    STARE's gate ("stare_open", 0 or 1); None when there is none."""
    state = dict(advantages.init_state(grpo.advantage, grpo.adv) or {})
    if grpo.stare_quantile > 0:
        state["stare_open"] = np.zeros((), np.float32)
    return state or None


def keeps_reference(grpo: GRPOConfig) -> bool:
    """Whether the initial policy is kept: the KL term (β > 0) or the progress advantage (η > 0) reads it."""
    return grpo.beta > 0 or grpo.progress_coef > 0


def init_state(grpo: GRPOConfig, optimizer, params) -> GRPOState:
    """The optimizer state, the parameters as the frozen reference policy when the KL term or the progress advantage
    needs one, and the host-side methods' running state when they keep one (`host_state`)."""
    adv = host_state(grpo)
    adv = None if adv is None else {k: jnp.asarray(v) for k, v in adv.items()}
    return GRPOState(optimizer.init(params), params if keeps_reference(grpo) else None, adv)


def state_shardings(grpo: GRPOConfig, optim: OptimConfig, mesh: Mesh, params) -> GRPOState:
    """Where a GRPO state lives: the optimizer moments like the master weights they mirror, the reference policy like
    the masters, step counts replicated."""
    optimizer = make_optimizer(optim)
    masters = sharding.master_shardings(mesh, params)
    abstract = jax.eval_shape(optimizer.init, params)
    adv = host_state(grpo)
    replicated = NamedSharding(mesh, PartitionSpec())
    return GRPOState(
        sharding.state_shardings(mesh, optimizer, abstract, masters),
        masters if keeps_reference(grpo) else None,
        None if adv is None else {k: replicated for k in adv},
    )


class Rollouts(NamedTuple):
    """Sampled rows of one minibatch, split into microbatches: every field is [U, b, ...] (U microbatches of b rows)."""

    prompt: Array  # [U, b, P] int32, left-padded
    prompt_mask: Array  # [U, b, P] bool
    completion: Array  # [U, b, N] int32
    completion_mask: Array  # [U, b, N] bool: up to and including EOS
    logp_old: Array  # [U, b, N] float32: π_old from generate
    advantage: Array  # [U, b] float32
    weight: Array  # [U, b, N] float32: token_weights over the whole minibatch

    @classmethod
    def abstract(cls, microbatches: int, rows: int, prompt_len: int, new_tokens: int, sharding) -> Rollouts:
        """`jax.ShapeDtypeStruct`s of a batch of U = `microbatches` × `rows` rows with `sharding`, for lowering
        `make_update` ahead of time (`esroll.plan`, the `tpu_cost` benchmark)."""

        def field(shape, dtype):
            return jax.ShapeDtypeStruct((microbatches, rows, *shape), dtype, sharding=sharding)

        return cls(
            prompt=field((prompt_len,), jnp.int32),
            prompt_mask=field((prompt_len,), bool),
            completion=field((new_tokens,), jnp.int32),
            completion_mask=field((new_tokens,), bool),
            logp_old=field((new_tokens,), jnp.float32),
            advantage=field((), jnp.float32),
            weight=field((new_tokens,), jnp.float32),
        )


@functools.cache
def make_update(model_cfg, grpo: GRPOConfig, optim: OptimConfig, mesh: Mesh, compute_dtype: str | None = None):
    """The jitted optimizer step on one minibatch, its gradient summed over microbatches (a `lax.scan`):
    update(params, state, batch, on_policy) -> (params, state, metrics).

    `on_policy` (traced bool) marks the update whose parameters sampled the batch: π_old := stop_gradient(π_θ).
    With `compute_dtype`, the loss runs on the gathered parameters cast to it (the masters keep their dtype, and the
    gradient arrives in it).
    Parameters and state come out FSDP-sharded, whatever their input sharding. One per (model, GRPO config,
    optimizer config, mesh) in a process, so that runs of one process share their compilation. A name in `grpo`
    that no module implements is refused first (`check_names`).
    """
    check_names(grpo)
    optimizer = make_optimizer(optim)

    def micro_loss(params, ref_params, micro: Rollouts, on_policy):
        def logprobs(p, with_entropy):
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
                with_entropy=with_entropy,
                layer_params=functools.partial(_gather_layer, mesh),
            )

        # The policy's per-token entropy comes from the same forward (a metric: no gradient).
        logp_BxN, entropy_BxN = logprobs(params, True)
        # With the progress advantage, the reference is scored by the very same computation as the policy, so that
        # log π_θ − log π_ref is exactly 0 at the reference parameters.
        same_path = grpo.progress_coef > 0
        logp_ref_BxN = None
        if ref_params is not None:
            ref = logprobs(ref_params, same_path)
            logp_ref_BxN = jax.lax.stop_gradient(ref[0] if same_path else ref)
        logp_old_BxN = jnp.where(on_policy, jax.lax.stop_gradient(logp_BxN), micro.logp_old)
        eps_BxN, acpo_metrics = None, {}
        if grpo.acpo:
            eps_BxN, eps_K = acpo_bounds(
                jnp.exp(logp_BxN - logp_old_BxN),
                micro.logp_old,
                micro.completion_mask,
                grpo.acpo_edges,
                grpo.acpo_scale,
                grpo.acpo_min,
                grpo.acpo_max,
            )
            acpo_metrics = {f"acpo_eps_{k}": eps_K[k] for k in range(len(grpo.acpo_edges) + 1)}
        loss, metrics = grpo_loss(
            logp_BxN,
            logp_old_BxN,
            logp_ref_BxN,
            micro.advantage,
            micro.completion_mask,
            eps_low=grpo.epsilon_low,
            eps_high=grpo.epsilon_high,
            beta=grpo.beta,
            aggregation=grpo.aggregation,
            weights_BxN=micro.weight,
            progress_coef=grpo.progress_coef,
            eps_BxN=eps_BxN,
        )
        metrics.update(acpo_metrics)
        if logp_ref_BxN is not None:  # the progress signal by completion position: sums here, means in `update`
            progress_BxN = jnp.where(micro.completion_mask, jax.lax.stop_gradient(logp_BxN) - logp_ref_BxN, 0.0)
            metrics["progress_pos_sum"] = progress_BxN.sum(0)
            metrics["progress_pos_tokens"] = jnp.asarray(micro.completion_mask, jnp.float32).sum(0)
        # Sums, so that the minibatch's entropy is a mean over its tokens whatever the microbatches hold (padding).
        metrics["entropy_sum"] = jnp.where(micro.completion_mask, jax.lax.stop_gradient(entropy_BxN), 0.0).sum()
        metrics["tokens"] = jnp.asarray(micro.completion_mask, jnp.float32).sum()
        return loss, metrics

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    # Not donated: on the 1.7B plan (v5e:2x2) donating params and state raised the update's temporaries from 4.7 to
    # 11.2 GiB per chip (copies XLA inserts so that the scan over microbatches still reads the old masters).
    @jax.jit
    def update(params, state: GRPOState, batch: Rollouts, on_policy: Array):
        def accumulate(grads, micro: Rollouts):
            micro = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, parallel.rows(mesh)), micro)
            (loss, metrics), g = grad_fn(params, state.ref_params, micro, on_policy)
            return jax.tree.map(jnp.add, grads, g), {"loss": loss, **metrics}

        grads, metrics_U = jax.lax.scan(accumulate, jax.tree.map(jnp.zeros_like, params), batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, params)
        params = optax.apply_updates(params, updates)
        masters = sharding.master_shardings(mesh, params)  # out in the layout they came in: one compilation
        params = jax.lax.with_sharding_constraint(params, masters)
        opt_state = jax.lax.with_sharding_constraint(
            opt_state, sharding.state_shardings(mesh, optimizer, opt_state, masters)
        )
        metrics = {
            "loss": metrics_U["loss"].sum(),
            "kl": metrics_U["kl"].mean(),
            "clip_fraction": metrics_U["clip_fraction"].mean(),
            "entropy": metrics_U["entropy_sum"].sum() / jnp.maximum(metrics_U["tokens"].sum(), 1.0),
            "grad_norm": optax.tree.norm(grads),
        }
        for key in metrics_U:
            if key == "progress_mean" or key.startswith("acpo_eps_"):
                metrics[key] = metrics_U[key].mean()
        if "progress_pos_sum" in metrics_U:
            metrics.update(
                progress_by_position(metrics_U["progress_pos_sum"].sum(0), metrics_U["progress_pos_tokens"].sum(0))
            )
        return params, state._replace(opt_state=opt_state), metrics

    return update


# ---- the method: sample, score, update


def pad_rows(x_Uxb: np.ndarray, rows: int) -> np.ndarray:
    """[U, b, ...] -> [U, rows, ...] with zero (False) rows appended: no prompt or completion token, advantage 0,
    token weight 0. `grpo_loss` masks every term of such a row out, so it adds exactly 0 to the loss and gradient;
    it only makes a microbatch split evenly over the data axis."""
    widths = [(0, 0), (0, rows - x_Uxb.shape[1])] + [(0, 0)] * (x_Uxb.ndim - 2)
    return np.pad(x_Uxb, widths)


def update_config(g: GRPOConfig) -> GRPOConfig:
    """`g` without what acts only on the host (the estimator, STARE, the group size): runs that differ only there
    share one compiled update, and the planner compiles the trainer's program."""
    return dataclasses.replace(
        g, advantage="grpo", adv=AdvantageConfig(), group_size=2, stare_quantile=0.0, stare_alpha=0.5
    )


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
    X, M = cfg.train.prompts_per_step, g.group_size
    n_mini, n_micro = g.minibatches, g.microbatches
    b = X * M // (n_mini * n_micro)  # rows per microbatch
    data = parallel.data_size(mesh)
    b_padded = -(-b // data) * data  # masked rows make each microbatch split evenly over the data axis
    label_free = cfg.data.reward == "majority"  # rewards from the group's majority answer, not the gold one
    to_compute = sharding.caster(mesh, cfg.model.dtype)  # the decoding copy (model.dtype) of the masters
    micro_rows = NamedSharding(mesh, PartitionSpec(None, parallel.AXIS))
    sample_key = jax.random.key(cfg.seed + 1)
    rows_per_device = rows_per_device or cfg.parallel.rows_per_device
    sampling = Sampling.of(cfg.train.max_new_tokens, g.temperature, cfg.parallel, rows_per_device)
    step_update = make_update(task.cfg, update_config(g), cfg.optimizer, mesh, cfg.model.dtype)
    optimizer = make_optimizer(cfg.optimizer)

    def init(params, key):
        del key  # sampling keys are fold_in(seed, step); nothing else is random

        make = functools.partial(init_state, g, optimizer)
        return jax.jit(make, out_shardings=state_shardings(g, cfg.optimizer, mesh, params))(params)

    def clusters(examples: list[Example]) -> np.ndarray:
        return np.array([advantages.cluster_id(cluster_key(e, g.adv.cluster_key), g.adv.bv_clusters) for e in examples])

    def step(params, state: GRPOState, examples: list[Example], step_index: int):
        # M completions per prompt; rows are prompt-major (row x·M + j answers prompt x).
        out = rollout(
            task,
            mesh,
            to_compute(params),
            examples,
            np.repeat(np.arange(X), M),
            jax.random.fold_in(sample_key, step_index),
            sampling,
            completions=True,
            answers=label_free,
        )
        N = sampling.max_new_tokens
        completion_mask_BxN = np.arange(N)[None, :] < out.length_B[:, None]
        gold_XxM = out.reward_B.reshape(X, M)
        rewards_XxM = advantages.majority_rewards(out.answer_B.reshape(X, M)) if label_free else gold_XxM
        lengths = np.maximum(out.length_B, 1)
        group = advantages.Group(
            rewards_XxM,
            step=step_index,
            seed=cfg.seed,
            seq_logp=(np.where(completion_mask_BxN, out.logprobs_BxN, 0.0).sum(1) / lengths).reshape(X, M),
            token_logp=out.logprobs_BxN.reshape(X, M, N),
            token_mask=completion_mask_BxN.reshape(X, M, N),
            cluster=clusters(examples) if g.advantage == "bv_blend" else None,
            answers=out.answer_B.reshape(X, M) if label_free else None,
        )
        host = {} if state.adv is None else {k: np.asarray(v) for k, v in state.adv.items()}
        own = {k: v for k, v in host.items() if not k.startswith("stare_")} or None  # the estimator's state
        estimate = advantages.estimate(g.advantage, group, g.adv, own)
        advantage_B = estimate.advantage.reshape(-1)
        token_weight_BxN = None if estimate.token_weight is None else estimate.token_weight.reshape(X * M, N)
        stare_metrics = {}
        if g.stare_quantile > 0:
            stare_open = bool(host["stare_open"])
            if stare_open:
                stare_w, selected = advantages.stare_token_weights(
                    out.logprobs_BxN, completion_mask_BxN, advantage_B, g.stare_quantile, g.stare_alpha
                )
                token_weight_BxN = stare_w if token_weight_BxN is None else token_weight_BxN * stare_w
                stare_metrics["stare_tokens"] = selected.sum() / max(completion_mask_BxN.sum(), 1)
            stare_metrics["stare_open"] = float(stare_open)

        # Minibatch m is rows [m·B/n_mini, (m+1)·B/n_mini), whole prompt groups when n_mini divides X.
        def minibatch(m: int) -> Rollouts:
            rows = slice(m * n_micro * b, (m + 1) * n_micro * b)
            weight = np.asarray(token_weights(completion_mask_BxN[rows], g.aggregation))
            if token_weight_BxN is not None:  # the estimator's per-token factor (e.g. ntf's filtered tokens: 0)
                weight = weight * token_weight_BxN[rows]
            fields = (  # token weights over the minibatch's real rows, before padding
                out.prompt_BxP[rows],
                out.prompt_mask_BxP[rows],
                out.tokens_BxN[rows],
                completion_mask_BxN[rows],
                out.logprobs_BxN[rows],
                advantage_B[rows].astype(np.float32),
                weight.astype(np.float32),
            )
            return Rollouts(
                *(parallel.put(micro_rows, pad_rows(x.reshape(n_micro, b, *x.shape[1:]), b_padded)) for x in fields)
            )

        minibatches = [minibatch(m) for m in range(n_mini)]
        history = []
        for iteration in range(g.inner_iterations):
            for m, batch in enumerate(minibatches):
                params, state, metrics = step_update(params, state, batch, jnp.asarray(iteration == 0 and m == 0))
                history.append(metrics)
        new_host = dict(estimate.state or {})
        if g.stare_quantile > 0:  # the gate reads this step's measured entropy; the next step uses it
            gate = advantages.stare_gate(
                bool(host["stare_open"]),
                float(np.mean([float(m["entropy"]) for m in history])),
                g.stare_entropy_low,
                g.stare_entropy_high,
            )
            new_host["stare_open"] = np.float32(gate)
        if new_host:
            state = state._replace(adv=parallel.put_replicated(mesh, {k: jnp.asarray(v) for k, v in new_host.items()}))
        metrics = jax.tree.map(lambda *xs: jnp.mean(jnp.stack(xs)), *history)
        metrics.update(
            fitness_mean=rewards_XxM.mean(),
            fitness_std=rewards_XxM.std(),
            advantage_abs=np.abs(advantage_B).mean(),
            prompt_reward=rewards_XxM.mean(1),  # [X]: read (and removed) by the training loop's curriculum
            **(estimate.metrics or {}),
            **stare_metrics,
        )
        if M > 1:  # a group of one is trivially all-equal
            metrics["frac_groups_all_equal"] = np.mean(np.all(rewards_XxM == rewards_XxM[:, :1], axis=1))
        if label_free:  # how often the majority vote agrees with the gold answer's verdict (gold: diagnostics only)
            metrics.update(gold_reward_mean=gold_XxM.mean(), pseudo_label_agreement=np.mean(rewards_XxM == gold_XxM))
        return params, state, metrics, int(out.length_B.sum())

    return Method(init, step)
