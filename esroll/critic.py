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


def critic_params(params: dict, outputs: int = 1) -> dict:
    """The parameters of `critic_from_policy`: the policy's trunk and a zero value head in the trunk's dtype, of
    `outputs` outputs per position (1: a value; DAE's critic: a value and an advantage per action slot)."""
    dtype, D = params["final_norm"].dtype, params["final_norm"].shape[-1]
    critic = {k: params[k] for k in TRUNK}
    critic["value_head"] = jnp.zeros((D, outputs), dtype)
    critic["value_bias"] = jnp.zeros((outputs,), dtype)
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
    dtype, the head's product in float32); [B, T, K] for a head of K > 1 outputs (`critic_params`). The arguments are
    `forward`'s (cache-free)."""
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
    w_DxK = params["value_head"].astype(jnp.float32)
    out_BxTxK = h_BxTxD.astype(jnp.float32) @ w_DxK + params["value_bias"].astype(jnp.float32)
    return out_BxTxK[..., 0] if w_DxK.shape[1] == 1 else out_BxTxK


def value_loss(value_BxN: Array, old_value_BxN: Array, return_BxN: Array, mask_BxN: Array, clip: float) -> Array:
    """PPO's clipped value loss, ½·max((V − R)², (clip(V, V_old − ε, V_old + ε) − R)²), averaged over the masked
    tokens: a value moves at most ε from the one its rollout saw before the loss stops pulling it."""
    clipped = old_value_BxN + jnp.clip(value_BxN - old_value_BxN, -clip, clip)
    losses = jnp.maximum((value_BxN - return_BxN) ** 2, (clipped - return_BxN) ** 2)
    mask = mask_BxN.astype(losses.dtype)
    return 0.5 * jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def dae_terms(out_BxTxK: Array, readings_BxTxC: Array, return_BxT: Array, gamma: float) -> Array:
    """[B, T]: Direct Advantage Estimation's squared errors, one per turn start, 0 elsewhere. `out` is a DAE critic's
    outputs (`critic_params` with K = 1 + S: the value V and an advantage score f(s, a) per action slot); `readings`
    what the rollout saw (`esroll.grpo.ppo.dae_readings`: the K outputs, then log π over the S slots, then the slot of
    the action taken, −2 off a turn start); `return` the discounted return G_i from turn i, at its start. With
    Â(s, a) = f(s, a) − Σ_a' π(a'|s)·f(s, a') and C_i = Σ_{j≥i} γ^{j−i}·Â(s_j, a_j) over the row's later turns,
    turn i's error is (G_i − C_i − V(s_i))², the episode ending at its last turn (V after it is 0)."""
    K = out_BxTxK.shape[-1]
    S = K - 1
    value_BxT, f_BxTxS = out_BxTxK[..., 0], out_BxTxK[..., 1:]
    pi_BxTxS = jax.nn.softmax(readings_BxTxC[..., K : K + S], axis=-1)
    taken_BxT = readings_BxTxC[..., K + S].astype(jnp.int32)
    start_BxT = taken_BxT >= 0
    chosen_BxT = jnp.sum(jax.nn.one_hot(taken_BxT, S) * f_BxTxS, -1)
    adv_BxT = jnp.where(start_BxT, chosen_BxT - jnp.sum(pi_BxTxS * f_BxTxS, -1), 0.0)

    def later(c_B, xs):
        adv_B, start_B = xs
        c_B = jnp.where(start_B, adv_B + gamma * c_B, c_B)
        return c_B, c_B

    _, c_TxB = jax.lax.scan(later, jnp.zeros(adv_BxT.shape[:1]), (adv_BxT.T, start_BxT.T), reverse=True)
    return jnp.where(start_BxT, (return_BxT - c_TxB.T - value_BxT) ** 2, 0.0)


def make_value_update(
    cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    clip: float | None,
    remat: str | None = None,
    mesh: Mesh | None = None,
    loss: str = "clipped",
    gamma: float = 1.0,
):
    """The compiled critic update of one batch: `update(params, opt_state, tokens, mask, at, old, returns) -> (params,
    opt_state, loss)`, one optimizer step on PPO's clipped value loss (`value_loss`, ε = `clip`) over the positions
    `at` (where a value is read: the position before each generated token), `old` the values the rollout saw there
    and `returns` their targets. With `loss = "logistic"` the values are logits of a success probability and the loss
    is the binary cross-entropy to targets in [0, 1] (a success head, SR-PPO's; `clip` and `old` are not read); with
    `loss = "dae"` the critic is DAE's, `old` [.., T, C] its readings and the loss `dae_terms` at discount `gamma`,
    averaged over the turn starts among `at`. Each
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
        elif loss == "dae":
            losses = dae_terms(value_BxT, old_BxT, return_BxT, gamma)
        else:
            clipped = old_BxT + jnp.clip(value_BxT - old_BxT, -clip, clip)
            losses = 0.5 * jnp.maximum((value_BxT - return_BxT) ** 2, (clipped - return_BxT) ** 2)
        return jnp.sum(jnp.where(at_BxT, losses, 0.0)) / count

    dae = loss == "dae"

    @jax.jit
    def update(params, opt_state, *batch, trunk=None):
        if batch[0].ndim == 2:  # one microbatch
            batch = tuple(x[None] for x in batch)
        at = batch[2] & (batch[3][..., -1] >= 0) if dae else batch[2]  # DAE's: the turn starts
        count = jnp.maximum(jnp.sum(at), 1).astype(jnp.float32)

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
