"""A critic: a value model of the policy's architecture, one scalar per token in place of the vocabulary head.

    critic_cfg, critic = critic_from_policy(cfg, params)      # the policy's trunk, a zero value head
    value_BxT = values(critic_cfg, critic, tokens_BxT, mask_BxT=mask_BxT)

V(prefix) is read at every position in one forward: the value at position t is that of the sequence through token
t, so a completion's values line up with its tokens' log-probabilities (the value before generated token n sits at
the position whose logits sampled it). Its checkpoints are transformers' token-classification models with one label
(`Qwen3ForTokenClassification`, `Qwen2ForTokenClassification`, `LlamaForTokenClassification`): `esroll.models.load_hf`
reads one as a critic (its config's `head` is "value") and `save_hf` writes one, so a critic trained elsewhere is a
starting point and one trained here loads in transformers with the same values.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from jax import Array
from jax.sharding import Mesh

from esroll import sharding
from esroll.models import ModelConfig, forward
from esroll.models.transformer import STACKED


def critic_from_policy(cfg: ModelConfig, params: dict) -> tuple[ModelConfig, dict]:
    """A critic initialised from a policy: its embedding, layers and final norm (shared arrays, not copies: an
    optimizer update makes new ones), and a value head of zeros, so every value starts at 0 and the first updates
    move the head before the trunk (the trunk's gradient is the head's weight times the error). The head is in the
    trunk's dtype."""
    if cfg.head != "lm":
        raise ValueError(f"critic_from_policy: the model is already a {cfg.head} model")
    return dataclasses.replace(cfg, head="value"), critic_params(params)


def critic_params(params: dict) -> dict:
    """The parameters of `critic_from_policy`: the policy's trunk and a zero value head in the trunk's dtype."""
    dtype, D = params["final_norm"].dtype, params["final_norm"].shape[-1]
    critic = {k: params[k] for k in TRUNK}
    critic["value_head"] = jnp.zeros((D, 1), dtype)
    critic["value_bias"] = jnp.zeros((1,), dtype)
    return critic


TRUNK = ("embed", "final_norm", STACKED)  # what a critic shares with its policy's architecture
HEAD = ("value_head", "value_bias")


def trunk_of(critic: dict, params: dict) -> dict | None:
    """The trunk a value head alone (a critic on the policy's shared trunk) reads: that of the policy's `params`;
    None when `critic` has a trunk of its own."""
    return None if "embed" in critic else {k: params[k] for k in TRUNK}


def on_trunk(critic: dict, params: dict) -> dict:
    """A whole critic from `critic`: itself when it has a trunk of its own, else the head on `trunk_of`'s trunk."""
    trunk = trunk_of(critic, params)
    return critic if trunk is None else {**trunk, **critic}


def values(
    cfg: ModelConfig,
    params: dict,
    tokens_BxT: Array,
    *,
    mask_BxT: Array | None = None,
    positions_BxT: Array | None = None,
    remat: str | None = None,
    layer_params=None,
    unroll: int = 1,
) -> Array:
    """[B, T] float32: each position's value, w·h_t + b over the final-normed hidden states h (the trunk in the model's
    dtype, the head's product in float32). The arguments are `forward`'s (cache-free)."""
    if cfg.head != "value":
        raise ValueError("values: the model is not a value model (esroll.critic.critic_from_policy makes one)")
    h_BxTxD, _ = forward(
        cfg,
        params,
        tokens_BxT,
        mask_BxT=mask_BxT,
        positions_BxT=positions_BxT,
        remat=remat,
        return_hidden=True,
        layer_params=layer_params,
        unroll=unroll,
    )
    w_Dx1 = params["value_head"].astype(jnp.float32)
    return (h_BxTxD.astype(jnp.float32) @ w_Dx1)[..., 0] + params["value_bias"].astype(jnp.float32)[0]


def value_loss(value_BxN: Array, old_value_BxN: Array, return_BxN: Array, mask_BxN: Array, clip: float) -> Array:
    """PPO's clipped value loss, ½·max((V − R)², (clip(V, V_old − ε, V_old + ε) − R)²), averaged over the masked
    tokens: a value moves at most ε from the one its rollout saw before the loss stops pulling it."""
    clipped = old_value_BxN + jnp.clip(value_BxN - old_value_BxN, -clip, clip)
    losses = jnp.maximum((value_BxN - return_BxN) ** 2, (clipped - return_BxN) ** 2)
    mask = mask_BxN.astype(losses.dtype)
    return 0.5 * jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def make_value_update(
    cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    clip: float | None,
    remat: str | None = None,
    mesh: Mesh | None = None,
    loss: str = "clipped",
):
    """The compiled critic update of one batch: `update(params, opt_state, tokens, mask, at, old, returns) -> (params,
    opt_state, loss)`, one optimizer step on PPO's clipped value loss (`value_loss`, ε = `clip`) over the positions
    `at` (where a value is read: the position before each generated token), `old` the values the rollout saw there
    and `returns` their targets. With `loss = "logistic"` the values are logits of a success probability and the loss
    is the binary cross-entropy to targets in [0, 1] (a success head, SR-PPO's; `clip` and `old` are not read). Each
    argument is [B, T], or [U, b, T]: U microbatches whose gradients are summed (a `lax.scan`, a memory knob as the
    policy's: the loss is the batch's mean over all U·b rows' positions either way). `remat`
    is the forward's (`esroll.models.forward`). With `mesh`, the critic and its optimizer state come out in the
    masters' layout (`esroll.sharding`), whatever layout they came in, so the update compiles once.

    `update(head, opt_state, *batch, trunk=trunk)`: a value head on a shared trunk (`on_trunk`): the values read the
    trunk's hidden states, and only the head is trained (no gradient reaches the trunk, so no backward runs through
    it)."""

    def loss_sum(params, trunk, count, tokens_BxT, mask_BxT, at_BxT, old_BxT, return_BxT):
        whole = params if trunk is None else {**jax.lax.stop_gradient(trunk), **params}
        value_BxT = values(cfg, whole, tokens_BxT, mask_BxT=mask_BxT, remat=remat)
        if loss == "logistic":
            losses = optax.sigmoid_binary_cross_entropy(value_BxT, return_BxT)
        else:
            clipped = old_BxT + jnp.clip(value_BxT - old_BxT, -clip, clip)
            losses = 0.5 * jnp.maximum((value_BxT - return_BxT) ** 2, (clipped - return_BxT) ** 2)
        return jnp.sum(jnp.where(at_BxT, losses, 0.0)) / count

    @jax.jit
    def update(params, opt_state, *batch, trunk=None):
        if batch[0].ndim == 2:  # one microbatch
            batch = tuple(x[None] for x in batch)
        count = jnp.maximum(jnp.sum(batch[2]), 1).astype(jnp.float32)

        def micro(total, xs):
            loss, grads = jax.value_and_grad(loss_sum)(params, trunk, count, *xs)
            return jax.tree.map(jnp.add, total, (loss, grads)), None

        if batch[0].shape[0] == 1:
            loss, grads = jax.value_and_grad(loss_sum)(params, trunk, count, *(x[0] for x in batch))
        else:
            zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
            (loss, grads), _ = jax.lax.scan(micro, zeros, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if mesh is not None:
            opt_layout = sharding.state_shardings(mesh, optimizer, params)
            params = jax.lax.with_sharding_constraint(params, sharding.master_shardings(mesh, params))
            opt_state = jax.lax.with_sharding_constraint(opt_state, opt_layout)
        return params, opt_state, loss

    return update
