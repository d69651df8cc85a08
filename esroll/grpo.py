"""GRPO, the gradient-based baseline: same model, prompts, sampler and rewards as ES; only the estimator differs.

One step: G completions per prompt from `generate` (which also returns π_old per token) → rewards → group
advantages (`esroll.advantages`) → `inner_iterations` passes over `minibatches` minibatches, one optimizer step each,
on the clipped surrogate plus β·KL to the initial policy (`grpo_loss`).

π_old. The first minibatch of the first pass is scored by the parameters that sampled it, so its ratio is computed as
exp(logp − stop_gradient(logp)): exactly 1, with the policy gradient as its gradient. Every later update uses the
log-probabilities `generate` returned (KV-cache path; they may differ from a full forward by ~1e-6, far inside any
clip range), so no extra forward pass is spent on π_old.

Sharding (FSDP / ZeRO-3 over the mesh's "data" axis): every leaf of the parameters, the optimizer state and the
reference parameters is split along its largest dimension divisible by the mesh size (replicated if none); the
loss gathers the full parameters, and the gradient comes back reduce-scattered. The rows of each microbatch are split
over the same axis. Sampling runs on a replicated copy of the parameters, with the rows split, as ES does.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from esroll import advantages, parallel
from esroll.config import ExperimentConfig, GRPOSection
from esroll.data import Example
from esroll.sampling import generate, pad_prompts, sequence_logprobs
from esroll.task import Method, Task

Array = jax.Array
AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "constant_length")


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
) -> tuple[Array, dict]:
    """Clipped surrogate −min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A) + β·(exp(d) − d − 1), d = log π_ref − log π_θ,
    aggregated by `aggregation` (or by explicit `weights_BxN`, see `token_weights`).

    logp_ref None means no KL term (β must then be 0). Metrics are token means over this call's tokens: `kl` (the
    k3 estimate), `clip_fraction` (tokens whose clipped branch is active, so their gradient is zero).
    """
    if logp_ref_BxN is None and beta:
        raise ValueError("grpo_loss: beta > 0 needs the reference log-probabilities")
    mask = jnp.asarray(mask_BxN, bool)
    w_BxN = token_weights(mask, aggregation) if weights_BxN is None else weights_BxN
    adv_Bx1 = jnp.asarray(advantage_B, jnp.float32)[:, None]
    ratio_BxN = jnp.exp(logp_new_BxN - logp_old_BxN)
    surrogate_BxN = jnp.minimum(ratio_BxN * adv_Bx1, jnp.clip(ratio_BxN, 1 - eps_low, 1 + eps_high) * adv_Bx1)
    loss_BxN = -surrogate_BxN
    kl_BxN = jnp.zeros_like(loss_BxN)
    if logp_ref_BxN is not None:
        d_BxN = logp_ref_BxN - logp_new_BxN
        kl_BxN = jnp.exp(d_BxN) - d_BxN - 1
        loss_BxN = loss_BxN + beta * kl_BxN
    clipped_BxN = ((ratio_BxN < 1 - eps_low) & (adv_Bx1 < 0)) | ((ratio_BxN > 1 + eps_high) & (adv_Bx1 > 0))
    n_tokens = jnp.maximum(mask.sum(), 1)
    metrics = {
        "kl": jnp.where(mask, kl_BxN, 0.0).sum() / n_tokens,
        "clip_fraction": (clipped_BxN & mask).sum() / n_tokens,
    }
    return jnp.where(mask, w_BxN * loss_BxN, 0.0).sum(), metrics


# ---- sharding


def fsdp_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Split the largest dimension divisible by the mesh size over "data"; replicate leaves that have none."""
    dims = [d for d in range(len(shape)) if shape[d] % mesh.size == 0 and shape[d] >= mesh.size]
    if not dims:
        return parallel.replicated(mesh)
    spec = [None] * len(shape)
    spec[max(dims, key=lambda d: shape[d])] = parallel.AXIS
    return NamedSharding(mesh, PartitionSpec(*spec))


def _constrain_fsdp(mesh: Mesh, tree):
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, fsdp_sharding(mesh, x.shape)), tree)


def _gather(mesh: Mesh, tree):
    """The full (replicated) parameters for a forward pass: FSDP's all-gather."""
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, parallel.replicated(mesh)), tree)


# ---- one optimizer step on one minibatch


class GRPOState(NamedTuple):
    opt_state: Any
    ref_params: dict | None  # the frozen initial policy; None when beta = 0 (no reference forward at all)


class Rollouts(NamedTuple):
    """Sampled rows of one minibatch, split into microbatches: every field is [K microbatches, b rows, ...]."""

    prompt: Array  # [K, b, P] int32, left-padded
    prompt_mask: Array  # [K, b, P] bool
    completion: Array  # [K, b, N] int32
    completion_mask: Array  # [K, b, N] bool: up to and including EOS
    logp_old: Array  # [K, b, N] float32: π_old from generate
    advantage: Array  # [K, b] float32
    weight: Array  # [K, b, N] float32: token_weights over the whole minibatch


@functools.partial(jax.jit, static_argnames=("model_cfg", "grpo", "optimizer", "mesh"))
def update(params, state: GRPOState, batch: Rollouts, on_policy: Array, *, model_cfg, grpo: GRPOSection,
           optimizer: optax.GradientTransformation, mesh: Mesh):  # fmt: skip
    """One optimizer step on one minibatch, its gradient summed over microbatches (a `lax.scan`).

    `on_policy` (traced bool) marks the update whose parameters sampled the batch: π_old := stop_gradient(π_θ).
    Returns (params, state, metrics); parameters and state come out FSDP-sharded, whatever their input sharding.
    """

    def micro_loss(params, micro: Rollouts):
        def logprobs(p):
            return sequence_logprobs(model_cfg, _gather(mesh, p), micro.prompt, micro.prompt_mask, micro.completion,
                                     micro.completion_mask)  # fmt: skip

        logp_BxN = logprobs(params)
        logp_ref_BxN = None if state.ref_params is None else jax.lax.stop_gradient(logprobs(state.ref_params))
        logp_old_BxN = jnp.where(on_policy, jax.lax.stop_gradient(logp_BxN), micro.logp_old)
        return grpo_loss(logp_BxN, logp_old_BxN, logp_ref_BxN, micro.advantage, micro.completion_mask,
                         eps_low=grpo.epsilon_low, eps_high=grpo.epsilon_high, beta=grpo.beta,
                         aggregation=grpo.aggregation, weights_BxN=micro.weight)  # fmt: skip

    if grpo.remat:  # keep only the weight matmuls' outputs for the backward pass; recompute norms, softmaxes, ...
        micro_loss = jax.checkpoint(micro_loss, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
    rows = NamedSharding(mesh, PartitionSpec(parallel.AXIS))

    def accumulate(grads, micro: Rollouts):
        micro = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, rows), micro)
        (loss, metrics), g = grad_fn(params, micro)
        return jax.tree.map(jnp.add, grads, g), {"loss": loss, **metrics}

    grads, metrics_K = jax.lax.scan(accumulate, jax.tree.map(jnp.zeros_like, params), batch)
    updates, opt_state = optimizer.update(grads, state.opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = {"loss": metrics_K["loss"].sum(), "kl": metrics_K["kl"].mean(),
               "clip_fraction": metrics_K["clip_fraction"].mean(), "grad_norm": optax.tree.norm(grads)}  # fmt: skip
    return _constrain_fsdp(mesh, params), _constrain_fsdp(mesh, state._replace(opt_state=opt_state)), metrics


# ---- the method: sample, score, update


def make_grpo_method(cfg: ExperimentConfig, task: Task, optimizer: optax.GradientTransformation, mesh: Mesh) -> Method:
    g = cfg.grpo
    P, G, N = cfg.train.prompts_per_step, g.group_size, cfg.train.max_new_tokens
    M, K = g.minibatches, g.microbatches
    b = P * G // (M * K)  # rows per microbatch
    if b % mesh.size:
        raise ValueError(f"config: 'grpo.microbatches' = {K}: a microbatch of {b} rows (prompts × group_size / "
                         f"(minibatches × microbatches)) must be divisible by the {mesh.size} devices")  # fmt: skip
    shape_advantages = advantages.get(g.advantage)
    replicate = jax.jit(lambda tree: tree, out_shardings=parallel.replicated(mesh))
    # The trainer hands over replicated trees after init and restore: shard them first, so `update` compiles once.
    shard = jax.jit(functools.partial(_constrain_fsdp, mesh))
    micro_rows = NamedSharding(mesh, PartitionSpec(None, parallel.AXIS))
    sample_key = jax.random.key(cfg.seed + 1)
    step_update = functools.partial(update, model_cfg=task.cfg, grpo=g, optimizer=optimizer, mesh=mesh)

    def init(params, key):
        del key  # sampling keys are fold_in(seed, step); nothing else is random
        return GRPOState(optimizer.init(params), params if g.beta > 0 else None)

    def step(params, state: GRPOState, examples: list[Example], step_index: int):
        # Sample G completions per prompt; rows are prompt-major (row p·G + g answers prompt p).
        prompt, prompt_mask = pad_prompts(task.prompt_ids(examples), multiple=task.prompt_multiple, rows=P,
                                          pad_id=task.pad_id)  # fmt: skip
        prompt_BxP, prompt_mask_BxP = np.repeat(prompt, G, 0), np.repeat(prompt_mask, G, 0)
        gen = generate(task.cfg, replicate(params), parallel.put_rows(mesh, prompt_BxP),
                       jax.random.fold_in(sample_key, step_index), max_new_tokens=N, temperature=g.temperature,
                       eos_ids=task.eos_ids, prompt_mask=parallel.put_rows(mesh, prompt_mask_BxP),
                       pad_id=task.pad_id)  # fmt: skip
        idx, tokens = parallel.local_rows(gen.tokens)
        _, lengths = parallel.local_rows(gen.lengths)
        _, logprobs = parallel.local_rows(gen.logprobs)
        rewards = task.rewards([examples[i // G] for i in idx], tokens, lengths)
        completion_BxN, length_B, logp_old_BxN, reward_B = (
            parallel.gather_to_all(x, idx, P * G) for x in (tokens, lengths, logprobs, rewards)
        )
        completion_mask_BxN = np.arange(N)[None, :] < length_B[:, None]
        rewards_PxG = reward_B.reshape(P, G)
        advantage_B = np.asarray(shape_advantages(rewards_PxG)).reshape(-1)

        # Minibatch m is rows [m·B/M, (m+1)·B/M), whole prompt groups when M divides P; split into K microbatches.
        def minibatch(m: int) -> Rollouts:
            rows = slice(m * K * b, (m + 1) * K * b)
            fields = (prompt_BxP[rows], prompt_mask_BxP[rows], completion_BxN[rows], completion_mask_BxN[rows],
                      logp_old_BxN[rows], advantage_B[rows].astype(np.float32),
                      np.asarray(token_weights(completion_mask_BxN[rows], g.aggregation)))  # fmt: skip
            return Rollouts(*(_put(micro_rows, x.reshape(K, b, *x.shape[1:])) for x in fields))

        minibatches = [minibatch(m) for m in range(M)]
        params, state = shard((params, state))
        history = []
        for iteration in range(g.inner_iterations):
            for m, batch in enumerate(minibatches):
                params, state, metrics = step_update(params, state, batch, jnp.asarray(iteration == 0 and m == 0))
                history.append(metrics)
        metrics = jax.tree.map(lambda *xs: jnp.mean(jnp.stack(xs)), *history)
        metrics.update(
            fitness_mean=rewards_PxG.mean(), fitness_std=rewards_PxG.std(),
            frac_groups_all_equal=np.mean(np.all(rewards_PxG == rewards_PxG[:, :1], axis=1)),
        )  # fmt: skip
        return params, state, metrics, int(length_B.sum())

    return Method(init, step)


def _put(sharding: NamedSharding, x: np.ndarray) -> Array:
    """A host array known to every process, placed with `sharding`."""
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
