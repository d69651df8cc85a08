"""GRPO's optimizer step on one minibatch: the state, its layout on the mesh, the gradient summed over
microbatches with one layer gathered at a time, and the compiled update.

Sharding: the ("data", "model") mesh and layout of ES (`esroll.sharding`). The `model.master_dtype` masters, the
optimizer state and the reference parameters are split over "data" (FSDP / ZeRO-3) and over "model" (heads, MLP
columns, vocabulary). The loss casts the shards to `model.dtype` and gathers them over "data" one layer at a time,
inside the model's scan (`_gather_layer`), into the tensor-parallel compute layout, so that the forward and backward
passes are split over "model" as decoding is; each layer's gradient comes back reduce-scattered to the master shards.
The rows of each microbatch are split over "data", padded up to a multiple of its size with masked rows (no
completion or prompt token, zero advantage and token weight), which add exactly nothing to the loss or the gradient:
any device count takes any batch.

Memory (the update's temporaries): each layer of the policy's forward is rematerialised (`remat`), so the backward
pass keeps O(L·b·T·D) activations in the model dtype rather than every layer's float32 attention scores, and the
log-probabilities come from the completion positions only, `logprob_chunk` at a time (`sequence_logprobs`), so no
[b, T, V] float32 logits buffer exists.
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

from esroll import parallel, sharding
from esroll.config import GRPOConfig, OptimConfig, Options, make_optimizer
from esroll.grpo import advantages, ppo
from esroll.grpo import variants as grpo_variants
from esroll.grpo.checks import check_grpo_names
from esroll.grpo.loss import grpo_loss
from esroll.grpo.variants import LossTerms
from esroll.models import STACKED
from esroll.scoring import Divergence, sequence_logprobs

Array = jax.Array


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
    critic: dict | None = None  # a critic's parameters (`esroll.grpo.ppo`: an estimator that reads values); else None
    critic_opt: Any = None  # its optimizer state


def host_state(g: GRPOConfig) -> dict | None:
    """The running state kept on the host between steps, nested by owner: {"advantage": the estimator's
    (`esroll.grpo.advantages.init_estimator_state`), "variants": {name: each variant's (`Variant.init_state`)}}, each
    part only when it holds something; None when nothing does."""
    return join_host(
        advantages.init_estimator_state(g.advantage, advantages.options_of(g)),
        {name: variant.init_state(g) for name, variant in grpo_variants.active(g)},
    )


def join_host(advantage: dict | None, variants: dict[str, dict]) -> dict | None:
    """The host state from its parts (`host_state`'s layout): empty parts left out."""
    host = {}
    if advantage:
        host["advantage"] = dict(advantage)
    if any(variants.values()):
        host["variants"] = {name: dict(state) for name, state in variants.items() if state}
    return host or None


def split_host(g: GRPOConfig, host: dict | None) -> tuple[dict | None, dict[str, dict]]:
    """The host state as (the estimator's state or None, {variant: its state}), in host arrays."""
    host = {} if host is None else jax.tree.map(np.asarray, host)
    variants = host.get("variants", {})
    return host.get("advantage"), {name: variants.get(name, {}) for name in g.variants}


def loss_reads_reference(g: GRPOConfig) -> bool:
    """Whether the loss scores the initial policy: the KL term (β > 0) or a variant (`Variant.needs_reference`)
    reads it."""
    return g.beta > 0 or any(v.needs_reference(g) for _, v in grpo_variants.active(g))


def keeps_reference(g: GRPOConfig) -> bool:
    """Whether the initial policy is kept: the loss reads it (`loss_reads_reference`), or the estimator reads the
    sampled tokens' log-ratio to it ("token_branches", `esroll.grpo.advantages`)."""
    needs = advantages.ESTIMATORS[g.advantage].needs if g.advantage in advantages.ESTIMATORS else ()
    return loss_reads_reference(g) or "token_branches" in needs


def init_state(g: GRPOConfig, optimizer, params) -> GRPOState:
    """The optimizer state, the parameters as the frozen reference policy when one is kept (`keeps_reference`), and
    the host-side running state when there is one (`host_state`)."""
    host = host_state(g)
    host = None if host is None else jax.tree.map(jnp.asarray, host)
    critic, critic_opt = ppo.init_critic(g, params) if ppo.keeps_critic(g) else (None, None)
    return GRPOState(optimizer.init(params), params if keeps_reference(g) else None, host, critic, critic_opt)


def state_shardings(g: GRPOConfig, optim: OptimConfig, mesh: Mesh, params) -> GRPOState:
    """Where a GRPO state lives: the optimizer moments like the master weights they mirror, the reference policy like
    the masters, step counts and the host-side state replicated."""
    host = host_state(g)
    replicated = NamedSharding(mesh, PartitionSpec())
    critic = (None, None)
    if ppo.keeps_critic(g):
        critic = ppo.critic_shardings(g, mesh, jax.eval_shape(lambda p: ppo.init_critic(g, p)[0], params))
    return GRPOState(
        sharding.state_shardings(mesh, make_optimizer(optim), params),
        sharding.master_shardings(mesh, params) if keeps_reference(g) else None,
        None if host is None else jax.tree.map(lambda _: replicated, host),
        *critic,
    )


class Rollouts(NamedTuple):
    """Sampled rows of one minibatch, split into microbatches: every field is [U, b, ...] (U microbatches of b rows)."""

    prompt: Array  # [U, b, P] int32, left-padded
    prompt_mask: Array  # [U, b, P] bool
    completion: Array  # [U, b, N] int32
    completion_mask: Array  # [U, b, N] bool: up to and including EOS (what the forward attends to)
    logp_old: Array  # [U, b, N] float32: π_old from generate
    advantage: (
        Array  # [U, b, N] float32: each token's advantage (the trainer broadcasts a sequence-level one); or [U, b]
    )
    weight: Array  # [U, b, N] float32: token_weights over the whole minibatch, times the variants' factors
    # [U, b, N] bool: the tokens that get loss, where they are not every completion token: a multi-turn episode's
    # actions, its environment's answers attended to but never trained on (`esroll.agents`); None: completion_mask.
    loss_mask: Array | None = None
    # [U, b, N, D_T] float32: a teacher's final-normed hidden states at the completion positions, whose head (an
    # argument of the update) gives its distributions, for the estimators whose loss adds GKD's divergence to it
    # ("teacher_distributions"); None: no teacher in the loss.
    teacher_hidden: Array | None = None

    @property
    def trained(self) -> Array:
        """[U, b, N] bool: the tokens that get loss."""
        return self.completion_mask if self.loss_mask is None else self.loss_mask

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


def _minibatch_gradient(model_cfg, grpo: GRPOConfig, mesh: Mesh, compute_dtype: str | None, teacher_cfg=None):
    """gradient(params, ref_params, batch, on_policy, teacher_head=None) -> (grads, metrics): the loss's gradient on
    one minibatch, summed over its microbatches (a `lax.scan`), and its metrics; traceable, for `make_update` and
    `make_gradient`. The variants with loss hooks (`Variant.in_loss`) change the per-token advantages and clip ranges
    and add metrics. GKD (`teacher_cfg`, and the batch's `teacher_hidden`): the teacher's head weights
    `teacher_head` give its distributions."""
    variants = [v for _, v in grpo_variants.active(grpo) if v.in_loss]
    gkd_beta = divergence_beta(grpo)
    reads_reference = loss_reads_reference(grpo)  # a kept reference the loss does not read is never scored

    def logprobs(p, micro: Rollouts, divergence=None):
        """(log π [b, N], entropy [b, N]) of the microbatch's completions under parameters `p`, and with `divergence`
        (`esroll.scoring.Divergence`) the generalised JSD to the teacher's distribution at each position."""
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
            divergence=divergence,
        )

    def micro_loss(params, ref_params, micro: Rollouts, on_policy, teacher_head):
        # The entropy (a metric) and GKD's divergence to the teacher come from the same forward.
        divergence = None
        if micro.teacher_hidden is not None:
            divergence = Divergence(teacher_cfg, teacher_head, micro.teacher_hidden, gkd_beta)
        logp, entropy, *jsd = logprobs(params, micro, divergence)
        # The reference is scored by the very computation that scores the policy, so log π_θ − log π_ref is exactly
        # 0 at the reference parameters.
        logp_ref = None
        if ref_params is not None and reads_reference:
            logp_ref = jax.lax.stop_gradient(logprobs(ref_params, micro)[0])
        logp_old = jnp.where(on_policy, jax.lax.stop_gradient(logp), micro.logp_old)
        advantage = micro.advantage[:, None] if micro.advantage.ndim == 1 else micro.advantage  # [b, 1] or [b, N]
        terms = LossTerms(logp, logp_old, logp_ref, micro.trained, advantage, grpo.epsilon_low, grpo.epsilon_high)
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
        if jsd:  # GKD: the divergence's token weights are the surrogate's (the aggregation's, times the factors)
            gkd_loss = jnp.where(micro.trained, micro.weight * jsd[0], 0.0).sum()
            loss = loss + gkd_loss
            metrics["divergence_sum"] = jnp.where(micro.trained, jax.lax.stop_gradient(jsd[0]), 0.0).sum()
        # Sums, so that the minibatch's entropy is a mean over its tokens whatever the microbatches hold (padding).
        metrics["entropy_sum"] = jnp.where(micro.trained, jax.lax.stop_gradient(entropy), 0.0).sum()
        metrics["tokens"] = jnp.asarray(micro.trained, jnp.float32).sum()
        return loss, (metrics, extra)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def gradient(params, ref_params, batch: Rollouts, on_policy: Array, teacher_head: dict | None = None):
        if (batch.teacher_hidden is None) != (teacher_head is None) or (teacher_head is not None and not teacher_cfg):
            raise ValueError("GKD's loss needs the batch's teacher_hidden, the teacher's head and its config together")

        def accumulate(grads, micro: Rollouts):
            micro = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, parallel.rows(mesh)), micro)
            (loss, (metrics, extra)), g = grad_fn(params, ref_params, micro, on_policy, teacher_head)
            return jax.tree.map(jnp.add, grads, g), ({"loss": loss, **metrics}, extra)

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, (metrics_U, extra_U) = jax.lax.scan(accumulate, zeros, batch)
        metrics = {
            "loss": metrics_U["loss"].sum(),
            "kl": metrics_U["kl"].mean(),
            "clip_fraction": metrics_U["clip_fraction"].mean(),
            "entropy": metrics_U["entropy_sum"].sum() / jnp.maximum(metrics_U["tokens"].sum(), 1.0),
        }
        if "divergence_sum" in metrics_U:
            metrics["gkd_divergence"] = metrics_U["divergence_sum"].sum() / jnp.maximum(metrics_U["tokens"].sum(), 1.0)
        for v, m_U in zip(variants, extra_U):
            metrics.update(v.reduce_metrics(grpo, m_U))
        return grads, metrics

    return gradient


def divergence_beta(g: GRPOConfig) -> float | None:
    """GKD's β when `g`'s estimator puts the teacher's whole distributions in the loss (it needs
    "teacher_distributions" and its options hold `beta`); None otherwise."""
    if "teacher_distributions" not in advantages.ESTIMATORS.lookup(g.advantage).needs:
        return None
    return float(advantages.options_of(g).beta)


@functools.cache
def make_update(
    model_cfg, grpo: GRPOConfig, optim: OptimConfig, mesh: Mesh, compute_dtype: str | None = None, teacher_cfg=None
):
    """The jitted optimizer step on one minibatch, its gradient summed over microbatches (a `lax.scan`):
    update(params, state, batch, on_policy, teacher_head=None) -> (params, state, metrics).

    `on_policy` (traced bool) marks the update whose parameters sampled the batch: π_old := stop_gradient(π_θ).
    With `compute_dtype`, the loss runs on the gathered parameters cast to it (the masters keep their dtype, and the
    gradient arrives in it). The variants with loss hooks (`Variant.in_loss`) change the per-token advantages and
    clip ranges and add metrics. Parameters and state come out FSDP-sharded, whatever their input sharding. One per
    (model, GRPO config, optimizer config, mesh) in a process, so that runs of one process share their compilation.
    A name in `grpo` that no module implements is refused first (`check_grpo_names`). GKD: `teacher_cfg` is the
    teacher's model config, `teacher_head` its head's weights (`esroll.teacher.teacher_head`) and the batch carries
    its hidden states.
    """
    check_grpo_names(grpo)
    optimizer = make_optimizer(optim)
    gradient = _minibatch_gradient(model_cfg, grpo, mesh, compute_dtype, teacher_cfg)

    # Not donated: on the 1.7B plan (v5e:2x2) donating params and state raised the update's temporaries from 4.7 to
    # 11.2 GiB per chip (copies XLA inserts so that the scan over microbatches still reads the old masters).
    @jax.jit
    def update(params, state: GRPOState, batch: Rollouts, on_policy: Array, teacher_head: dict | None = None):
        grads, metrics = gradient(params, state.ref_params, batch, on_policy, teacher_head)
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
def make_gradient(model_cfg, grpo: GRPOConfig, mesh: Mesh, compute_dtype: str | None = None, teacher_cfg=None):
    """The jitted gradient of the loss on one minibatch, no optimizer step: gradient(params, ref_params, batch,
    on_policy, teacher_head=None) -> (grads, metrics), grads in the masters' layout (what the estimator diagnostics
    compare); GKD's teacher as `make_update`'s."""
    check_grpo_names(grpo)
    gradient = _minibatch_gradient(model_cfg, grpo, mesh, compute_dtype, teacher_cfg)

    @jax.jit
    def run(params, ref_params, batch: Rollouts, on_policy: Array, teacher_head: dict | None = None):
        grads, metrics = gradient(params, ref_params, batch, on_policy, teacher_head)
        return jax.lax.with_sharding_constraint(grads, sharding.master_shardings(mesh, grads)), metrics

    return run


def pad_rows(x_Uxb: np.ndarray, rows: int) -> np.ndarray:
    """[U, b, ...] -> [U, rows, ...] with zero (False) rows appended: no prompt or completion token, advantage 0,
    token weight 0. `grpo_loss` masks every term of such a row out, so it adds exactly 0 to the loss and gradient;
    it only makes a microbatch split evenly over the data axis."""
    widths = [(0, 0), (0, rows - x_Uxb.shape[1])] + [(0, 0)] * (x_Uxb.ndim - 2)
    return np.pad(x_Uxb, widths)


def update_config(g: GRPOConfig) -> GRPOConfig:
    """`g` without what acts only on the host (the estimator unless its options shape the loss, the group size, the
    variants without loss hooks and their options): runs that differ only there share one compiled update, and the
    planner compiles the trainer's program."""
    kept = tuple(name for name, v in grpo_variants.active(g) if v.in_loss)
    options = Options({name: o for name, o in g.variant_options.items() if name in kept})
    if divergence_beta(g) is not None:  # the estimator's β shapes the loss (GKD): it stays, with its options
        estimator = dict(advantage=g.advantage, adv=Options({k: o for k, o in g.adv.items() if k == g.advantage}))
    else:
        estimator = dict(advantage="grpo", adv=Options())
    return dataclasses.replace(g, **estimator, group_size=2, variants=kept, variant_options=options)
