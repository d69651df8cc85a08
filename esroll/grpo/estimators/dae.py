"""DAE (Direct Advantage Estimation) on agent episodes: a learned advantage model over the environment's actions,
read at each turn's start with the whole episode so far in context (`grpo.advantage = "dae"`; agent runs only, where
a turn is an action chosen from a known set; on the step task there is no action set and DAE is not defined).

The critic (`esroll.critic`, trained as PPO's) has 1 + S outputs at every position: a value V(s) and a score f(s, a)
for each of S action slots: the environment's A actions in the first ones, then "anything else" (a first token that
starts none of them, which the environment reads as a malformed action). At turn i's first action token, with π the
policy's probabilities of those A + 1 classes of first token (`esroll.grpo.ppo.dae_readings`; they sum to 1):

    Â(s_i, a) = f(s_i, a) − Σ_a' π(a'|s_i)·f(s_i, a')                    (so Σ_a π(a|s_i)·Â(s_i, a) = 0)
    loss      = Σ_i (Σ_{j≥i} γ^{j−i}·(r_j − Â(s_j, a_j)) − V(s_i))²     (`esroll.critic.dae_terms`)

the episode ending after its last turn (V = 0 there: the turn limit is in the context, so a timed-out state is
terminal). Minimised in expectation over the policy's episodes, Â is the policy's advantage Q^π − V^π and V its value.
Every action token of turn i gets Â(s_i, a_i) of the action taken (whitened over the step's action tokens with
`whiten`), a malformed action that of "anything else", which learns what the malformed-action penalty costs.
Formulas, a worked example and what is our reading: docs/critics.md.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from esroll.config import check_fields
from esroll.grpo.advantages import Estimate, Group, register_advantage, valid_rewards
from esroll.grpo.gae import explained_variance, whiten

ACTION_SLOTS = 8  # the advantage model's action outputs: room for a shipped environment's actions and "anything else"


@dataclasses.dataclass(frozen=True)
class DaeOptions:
    """`grpo.adv.dae.*`. gamma: the discount per turn; whiten: whiten the advantages over the step's action tokens;
    critic_lr: the critic's Adam learning rate (clipped at norm 1, as PPO's); shared_trunk: the value and advantage
    heads alone on the policy's trunk (as PPO's `shared_trunk`)."""

    gamma: float = 0.99
    whiten: bool = True
    critic_lr: float = 1e-4
    shared_trunk: bool = False
    critic_loss: ClassVar[str] = "dae"  # the critic's loss: `esroll.critic.dae_terms`
    critic_outputs: ClassVar[int] = 1 + ACTION_SLOTS  # V and f(s, a) per action slot

    def __post_init__(self):
        checks = [("gamma", 0 <= self.gamma <= 1, "in [0, 1]"), ("critic_lr", self.critic_lr > 0, "> 0")]
        check_fields(self, checks, "DaeOptions")


def readings_parts(readings_BxNxC: np.ndarray):
    """(V [B, N], f [B, N, S], π [B, N, S], the slot taken [B, N] int, −2 off a turn start) of DAE's readings
    (`esroll.grpo.ppo.dae_readings`: C = 2·(1 + S))."""
    K = readings_BxNxC.shape[-1] // 2
    r = np.asarray(readings_BxNxC, np.float64)
    return r[..., 0], r[..., 1:K], np.exp(r[..., K : 2 * K - 1]), r[..., -1].astype(np.int64)


def advantage_model(f_BxNxS: np.ndarray, pi_BxNxS: np.ndarray) -> np.ndarray:
    """[B, N, S]: Â(s, a) = f(s, a) − Σ_a' π(a'|s)·f(s, a') at every position."""
    return f_BxNxS - np.sum(pi_BxNxS * f_BxNxS, -1, keepdims=True)


def dae_advantage(g: Group, o: DaeOptions, state=None) -> Estimate:
    """Per-token Â(s_i, a_i) of each turn's action on the turn's action tokens (whitened with `whiten`) and the
    critic's targets: the discounted return G_i = Σ_{j≥i} γ^{j−i}·r_j at each turn's first action token, 0 elsewhere
    (the loss subtracts the later turns' Â itself). An invalid episode gets 0. Logs `explained_variance` of V(s_i)
    against G_i, `value_prompt` (the mean V before the first action), `advantage_model_abs` (the mean |Â(s_i, a_i)|)
    and `advantage_constraint` (the largest |Σ_a π·Â| over the turn starts: 0 up to rounding)."""
    r, valid = valid_rewards(g)
    mask = np.asarray(g.token_mask, bool) & valid[..., None]
    X, M, N = mask.shape
    flat = mask.reshape(X * M, N)
    V, f, pi, taken = readings_parts(np.asarray(g.values).reshape(X * M, N, -1))
    a_hat = advantage_model(f, pi)
    chosen = np.take_along_axis(a_hat, np.maximum(taken, 0)[..., None], -1)[..., 0]
    chosen = np.where(taken >= 0, chosen, 0.0)
    advantage, returns = np.zeros((X * M, N)), np.zeros((X * M, N))
    starts = np.zeros((X * M, N), bool)
    turns = g.turns
    for b in np.flatnonzero(valid.reshape(-1)):
        later = 0.0
        for _, start, end, reward in reversed(turns.spans(b)):
            later = reward + o.gamma * later
            returns[b, start] = later
            advantage[b, start:end] = chosen[b, start]
            starts[b, start] = True
    first = np.argmax(flat, axis=1)
    rows = np.flatnonzero(flat.any(1))
    metrics = {
        "explained_variance": explained_variance(np.where(starts, V, 0.0), returns, starts),
        "value_prompt": float(V[rows, first[rows]].mean()) if len(rows) else 0.0,
    }
    if starts.any():
        metrics["advantage_model_abs"] = float(np.abs(chosen[starts]).mean())
        metrics["advantage_constraint"] = float(np.abs(np.sum(pi * a_hat, -1)[starts]).max())
    advantage = whiten(advantage, flat) if o.whiten else np.where(flat, advantage, 0.0)
    return Estimate(advantage.reshape(X, M, N).astype(np.float32), metrics=metrics, returns=returns.reshape(X, M, N))


register_advantage("dae", dae_advantage, options=DaeOptions, needs=("values", "turns"), single_rollout=True)
