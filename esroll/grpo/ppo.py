"""The critic of a GRPO run whose advantage estimator reads "values" (PPO: `grpo.advantage = "gae"`): its values over
a rollout, and its updates on the estimator's returns.

The critic (`esroll.critic`) starts as the policy's trunk with a zero value head (or, with `shared_trunk`, is a value
head alone on the policy's own trunk), lives in `GRPOState.critic` (with its own Adam, `critic_opt`) and is
checkpointed, restored and sharded with the rest of the state. Each step reads the critic's value before every
generated token in one forward over prompt and completion (what GAE uses, "the values the rollout saw"), then, after
the policy's updates, takes one critic update per minibatch per pass (`grpo.minibatches` × `grpo.inner_iterations`,
the policy's schedule) on PPO's clipped value loss against the estimator's returns.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from esroll import parallel, sharding
from esroll.config import ConfigError, GRPOConfig
from esroll.errors import InputError
from esroll.critic import HEAD, critic_params, make_value_update, on_trunk, trunk_of, values
from esroll.grpo import advantages
from esroll.models import ModelConfig, forward, load_hf
from esroll.models.hf import abstract_params, resolve
from esroll.models.transformer import head

CRITIC_MAX_GRAD_NORM = 1.0


def keeps_critic(g: GRPOConfig) -> bool:
    """Whether the run trains a critic: its advantage estimator reads "values"."""
    return "values" in advantages.ESTIMATORS.lookup(g.advantage).needs


def critic_optimizer(g: GRPOConfig) -> optax.GradientTransformation:
    """Adam at the estimator's `critic_lr`, after clipping the gradient at global norm 1."""
    lr = advantages.options_of(g).critic_lr
    return optax.chain(optax.clip_by_global_norm(CRITIC_MAX_GRAD_NORM), optax.adam(lr))


def shares_trunk(g: GRPOConfig) -> bool:
    """Whether the critic is a value head on the policy's trunk (`shared_trunk` of the estimator's options)."""
    return keeps_critic(g) and bool(getattr(advantages.options_of(g), "shared_trunk", False))


def init_critic(g: GRPOConfig, params: dict) -> tuple[dict, optax.OptState]:
    """(critic parameters, their optimizer state) from the policy's masters: its trunk and a zero value head (of the
    estimator's `critic_outputs` outputs, 1 unless it says otherwise), or the head alone on a shared trunk
    (`shares_trunk`)."""
    critic = critic_params(params, getattr(advantages.options_of(g), "critic_outputs", 1))
    if shares_trunk(g):
        critic = {k: critic[k] for k in HEAD}
    return critic, critic_optimizer(g).init(critic)


def load_critic(g: GRPOConfig, model_cfg: ModelConfig, mesh: Mesh, dtype) -> dict | None:
    """The critic's starting parameters from `grpo.adv.<estimator>.critic_path`, in `dtype` and the masters' layout
    (each device reads its shards), or None when the path is empty (`init_critic`'s trunk of the policy stands). The
    checkpoint is a value model (transformers' token classification with one label) or a causal LM, whose trunk is
    taken with a zero value head; either must have the policy's architecture, since the critic is read with it. Any
    other checkpoint is refused (an InputError: one line at the command line) naming the key."""
    path = getattr(advantages.options_of(g), "critic_path", "")
    if not path:
        return None
    key = f"grpo.adv.{g.advantage}.critic_path"
    try:
        folder = resolve(path)
        cfg, critic = load_hf(
            folder, dtype=dtype, shardings=lambda c: sharding.master_shardings(mesh, abstract_params(c))
        )
    except (OSError, ValueError, KeyError) as e:
        raise InputError(f"config: '{key}': {e}") from None
    same = {"head": "lm", "tie_word_embeddings": False, "attention": model_cfg.attention}
    if dataclasses.replace(cfg, **same) != dataclasses.replace(model_cfg, **same):
        raise InputError(
            f"config: '{key}': {folder} is not of the policy's architecture (critic {_shape(cfg)}, policy "
            f"{_shape(model_cfg)}); the critic is read with the policy's"
        )
    return critic if cfg.head == "value" else critic_params(critic)


def _shape(cfg: ModelConfig) -> str:
    return f"{cfg.family} {cfg.num_layers}×{cfg.hidden_size}, vocabulary {cfg.vocab_size}"


def critic_shardings(g: GRPOConfig, mesh: Mesh, critic: dict):
    """(the critic's shardings, its optimizer state's): the masters' rules."""
    return sharding.master_shardings(mesh, critic), sharding.state_shardings(mesh, critic_optimizer(g), critic)


@functools.lru_cache(maxsize=8)
def read_values(model_cfg: ModelConfig):
    """The compiled critic forward `values` of the policy's architecture: read(critic, tokens_BxT, mask_BxT=…)."""
    return jax.jit(functools.partial(values, dataclasses.replace(model_cfg, head="value")))


class ActionSet(NamedTuple):
    """DAE's action classes (`action_tokens`): the token that starts each of the environment's actions, and the
    sampling temperature at which the policy's probabilities of them are read (those it sampled the actions with)."""

    ids: tuple[int, ...]
    temperature: float = 1.0


def rollout_values(
    model_cfg: ModelConfig, critic: dict, out, mesh: Mesh, params: dict | None = None, actions: ActionSet | None = None
) -> np.ndarray:
    """[B, N]: the critic's value before each generated token of `out` (position P−1+n for token n, as its
    log-probability), 0 past each completion's length; [B, N, K] for a head of K outputs. A value head alone reads
    the trunk of the policy's `params` (`esroll.critic.on_trunk`). The rows are split over the mesh's data axis, as
    the policy's (a replicated batch would have every device compute every row). With `actions` (`action_tokens`),
    DAE's readings instead: the critic's K outputs, then the policy's log π over the action slots at each turn's
    start, then the slot each turn's action took (`dae_readings`)."""
    P, N = out.prompt_BxP.shape[1], out.tokens_BxN.shape[1]
    tokens, mask, completion_BxN = sequences(out)
    B = len(tokens)
    tokens, mask = _rows(mesh, tokens), _rows(mesh, mask)
    v = np.asarray(read_values(model_cfg)(on_trunk(critic, params), tokens, mask_BxT=mask))[:B, P - 1 : P - 1 + N]
    if v.ndim == 2:
        return np.where(completion_BxN, v, 0.0)
    v = np.where(completion_BxN[..., None], v, 0.0)
    if actions is None:
        return v
    at_BxW = P - 1 + np.asarray(out.turns.start_BxW, np.int32)  # each turn's first action token's logits
    logp_BxWxA1 = np.asarray(read_action_logp(model_cfg, actions)(params, tokens, mask, _rows(mesh, at_BxW)))[:B]
    return dae_readings(v, logp_BxWxA1, out, actions.ids)


@functools.lru_cache(maxsize=8)
def read_action_logp(model_cfg: ModelConfig, actions: ActionSet):
    """The compiled policy forward of the log-probabilities, at the sampling temperature, of the A tokens that start
    the actions and of any other token, at W positions per row: read(params, tokens_BxT, mask_BxT, at_BxW) ->
    [B, W, A + 1] float32 (the last: log Σ over the vocabulary's other tokens, from log-sum-exps, so it stays finite
    where the A take almost all the mass). The head runs at those positions alone, not at every position."""
    ids = np.asarray(actions.ids)

    def read(params, tokens_BxT, mask_BxT, at_BxW):
        h_BxTxD, _ = forward(model_cfg, params, tokens_BxT, mask_BxT=mask_BxT, return_hidden=True)
        h_BxWxD = jnp.take_along_axis(h_BxTxD, at_BxW[..., None], axis=1)
        logits_BxWxV = head(model_cfg, params, h_BxWxD) / actions.temperature
        total_BxW = jax.nn.logsumexp(logits_BxWxV, -1)
        other = jnp.ones(logits_BxWxV.shape[-1], bool).at[ids].set(False)
        other_BxW = jax.nn.logsumexp(jnp.where(other, logits_BxWxV, -jnp.inf), -1)
        logp_BxWxA = logits_BxWxV[..., ids] - total_BxW[..., None]
        return jnp.concatenate([logp_BxWxA, (other_BxW - total_BxW)[..., None]], -1)

    return jax.jit(read)


def dae_readings(out_BxNxK: np.ndarray, logp_BxWxA1: np.ndarray, out, ids: tuple[int, ...]) -> np.ndarray:
    """[B, N, K + S + 1], S = K − 1 action slots: the critic's outputs; at each turn's first action token the policy's
    log π (`logp_BxWxA1`, turn w of row b) over the A actions that start with tokens `ids` (slots 0 .. A − 1) and over
    "anything else" (slot A), slots past A −1e9 (probability 0), −1e9 everywhere off a turn start (never read); and
    the slot of the action each turn took, at its first action token (−2 off a turn start). An action is identified
    by its first token; the A + 1 classes cover every token, so π sums to 1 over them."""
    B, N, K = out_BxNxK.shape
    S, A = K - 1, len(ids)
    logp = np.full((B, N, S), -1e9, np.float32)
    taken = np.full((B, N), -2.0, np.float32)
    for b in range(B):
        for w, start, _, _ in out.turns.spans(b):
            token = int(out.tokens_BxN[b, start])
            taken[b, start] = ids.index(token) if token in ids else A
            logp[b, start, : A + 1] = np.maximum(logp_BxWxA1[b, w], -1e9)
    return np.concatenate([out_BxNxK, logp, taken[..., None]], -1)


def action_tokens(g: GRPOConfig, task) -> ActionSet | None:
    """DAE's action classes: the token that starts each of the environment's actions and the run's sampling
    temperature (DAE's critic reads π over them), or None when the estimator's critic has a single output. Refused (a
    ConfigError naming grpo.advantage) where two actions start with one token or the environment's actions and
    "anything else" need more than the critic's action slots."""
    outputs = getattr(advantages.options_of(g), "critic_outputs", 1)
    if outputs == 1:
        return None
    actions = task.env.make().actions
    ids = tuple(task.tokenizer.encode(a, add_special_tokens=False)[0] for a in actions)
    if len(set(ids)) < len(ids) or len(ids) + 1 > outputs - 1:
        expected = f"an environment of at most {outputs - 2} actions that start with distinct tokens; "
        expected += f"{task.env.name!r} has {', '.join(actions)}, starting with tokens {ids}"
        raise ConfigError("grpo.advantage", g.advantage, expected)
    return ActionSet(ids, g.temperature)


def _rows(mesh: Mesh, x: np.ndarray):
    """`x` with zero (masked) rows appended to a multiple of the data axis, split over it."""
    padded = parallel.padded_rows(len(x), mesh)
    return parallel.put_rows(mesh, np.pad(x, [(0, padded - len(x))] + [(0, 0)] * (x.ndim - 1)))


def make_critic_update(model_cfg: ModelConfig, g: GRPOConfig, mesh: Mesh):
    """update(critic, critic_opt, tokens, mask, at, old, returns) -> (critic, critic_opt, loss): one step of the
    clipped value loss (`value_clip`), or of the estimator's `critic_loss` ("logistic": a success head), with the
    critic's optimizer, at the policy's `grpo.remat`, its gradient summed over `grpo.microbatches` as the policy's,
    out in the master layout (`esroll.critic.make_value_update`)."""
    cfg = dataclasses.replace(model_cfg, head="value")
    o = advantages.options_of(g)
    loss = getattr(o, "critic_loss", "clipped")
    clip = getattr(o, "value_clip", None)
    gamma = getattr(o, "gamma", 1.0)
    return make_value_update(cfg, critic_optimizer(g), clip, remat=g.remat, mesh=mesh, loss=loss, gamma=gamma)


def _pad_rows(x_Uxbx: np.ndarray, extra: int) -> np.ndarray:
    """`x` with `extra` rows appended to each microbatch: zeros (masked), and DAE's readings −2 (no turn start)."""
    pad = np.zeros((x_Uxbx.shape[0], extra) + x_Uxbx.shape[2:], x_Uxbx.dtype)
    if x_Uxbx.ndim == 4:
        pad[..., -1] = -2
    return np.concatenate([x_Uxbx, pad], 1)


def sequences(out) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens [B, P+N], mask [B, P+N], completion mask [B, N]) of a rollout: prompt and completion side by side,
    what the critic reads."""
    N = out.tokens_BxN.shape[1]
    completion_BxN = np.arange(N)[None] < out.length_B[:, None]
    tokens_BxT = np.concatenate([out.prompt_BxP, out.tokens_BxN], 1)
    return tokens_BxT, np.concatenate([out.prompt_mask_BxP, completion_BxN], 1), completion_BxN


def train_critic(
    update, critic, critic_opt, out, loss_mask_BxN, old_BxN, returns_BxN, g: GRPOConfig, mesh: Mesh, params=None
):
    """The critic's updates of one step: `grpo.inner_iterations` passes over `grpo.minibatches` contiguous row blocks,
    each an update at the positions before the generated tokens that get loss, split into `grpo.microbatches` of b
    rows, b padded to a multiple of the data axis and split over it (padding rows read no value, so they add nothing
    to the loss). A value head alone trains on the trunk of the policy's `params` (after the policy's updates), which
    it leaves as it is. Returns the critic, its optimizer state and the mean value loss."""
    trunk = trunk_of(critic, params)
    P, N = out.prompt_BxP.shape[1], out.tokens_BxN.shape[1]
    B = len(out.length_B)
    tokens, mask, _ = sequences(out)

    def placed(x_BxN, dtype):  # [B, N, ...] -> [B, P + N, ...]; DAE's readings: −2 (no turn start) off the completion
        full = np.zeros((B, P + N) + x_BxN.shape[2:], dtype)
        if x_BxN.ndim == 3:
            full[..., -1] = -2
        full[:, P - 1 : P - 1 + N] = x_BxN
        return full

    at = placed(loss_mask_BxN, bool)
    old, ret = placed(old_BxN, np.float32), placed(returns_BxN, np.float32)
    U = g.microbatches
    b = B // (g.minibatches * U)
    padded = parallel.padded_rows(b, mesh)
    micro_rows = NamedSharding(mesh, PartitionSpec(None, parallel.AXIS))
    losses = []
    for _ in range(g.inner_iterations):
        for m in range(g.minibatches):
            rows = slice(m * U * b, (m + 1) * U * b)
            batch = (
                parallel.put(micro_rows, _pad_rows(x[rows].reshape(U, b, *x.shape[1:]), padded - b))
                for x in (tokens, mask, at, old, ret)
            )
            critic, critic_opt, loss = update(critic, critic_opt, *batch, trunk=trunk)
            losses.append(loss)
    return critic, critic_opt, float(np.mean(jax.device_get(losses)))
