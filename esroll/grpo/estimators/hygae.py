"""HyGAE: a hybrid of turn-level and token-level GAE for multi-turn episodes, from one critic
(`grpo.advantage = "hygae"`; agent runs, `esroll.agents`).

An episode's turns are the steps of the agent's MDP and its action tokens the steps of the token MDP. With the
critic's value V before each generated token (`Group.values`, as PPO's), e_i the last action token of turn i, L_i
the number of action tokens of turn i and R_i its reward:

    turn level    δ_i = R_i + γ^{L_{i+1}}·V(e_{i+1}) − V(e_i),   A^turn_i = δ_i + γ^{L_{i+1}}·λ·A^turn_{i+1}
                  (V(e_{n+1}) = A^turn_{n+1} = 0 after the last turn), every action token of turn i gets A^turn_i;
                  its return is A^turn_i + V(e_i) at e_i and γ^d times that d action tokens before it
    token level   PPO's GAE over the action tokens (`esroll.grpo.gae.gae`, the turn's reward on its last token)
    hybrid        A = α·A^turn + (1 − α)·A^tok, the critic's target α·R^turn + (1 − α)·R^tok

then whitened over the step's action tokens as PPO's. γ^{L} discounts a turn by its length in tokens, so the turn
level and the token level discount alike and one critic serves both. At α = 0 it is PPO's estimator exactly. What the
paper (HyGAE, Zhang et al.) leaves to its code and how it is read here: docs/critics.md.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from esroll.config import check_fields
from esroll.grpo.advantages import Estimate, Group, register_advantage, valid_rewards
from esroll.grpo.estimators.gae import GaeOptions, critic_metrics, token_rewards
from esroll.grpo.gae import gae, whiten


@dataclasses.dataclass(frozen=True)
class HyGaeOptions(GaeOptions):
    """`grpo.adv.hygae.*`: PPO's options (`grpo.adv.gae`; here γ 0.99 and λ 1, HyGAE's defaults, one λ for both
    levels) and alpha, the turn level's share of the advantage and of the critic's target (0: PPO's GAE)."""

    gamma: float = 0.99
    lam: float = 1.0
    alpha: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        check_fields(self, [("alpha", 0 <= self.alpha <= 1, "in [0, 1]")], "HyGaeOptions")


def turn_gae(turns, value_BxN: np.ndarray, rows_B: np.ndarray, gamma: float, lam: float):
    """(advantages [B, N], returns [B, N]) of the turn level over each row of `rows_B` (others 0): turn i's advantage
    on each of its action tokens, its return at its last one and discounted by γ per action token before it. A turn
    with no action token (the rollout produces none) is skipped."""
    B, N = value_BxN.shape
    advantage, ret = np.zeros((B, N)), np.zeros((B, N))
    for b in np.flatnonzero(rows_B):
        later, next_value, next_length = 0.0, 0.0, 1
        for _, start, end, reward in reversed(turns.spans(b)):
            v = float(value_BxN[b, end - 1])
            discount = gamma**next_length
            later = reward + discount * next_value - v + discount * lam * later
            advantage[b, start:end] = later
            ret[b, start:end] = (later + v) * gamma ** np.arange(end - start - 1, -1, -1)
            next_value, next_length = v, end - start
    return advantage, ret


def hygae_advantage(g: Group, o: HyGaeOptions, state=None) -> Estimate:
    """Per-token hybrid advantages (whitened with `whiten`) and the critic's targets; an invalid episode gets 0 and
    no target. Logs PPO's `critic_metrics` and `turn_token_corr`, the correlation of the two levels' advantages over
    the step's action tokens."""
    r, valid = valid_rewards(g)
    mask = np.asarray(g.token_mask, bool) & valid[..., None]
    X, M, N = mask.shape
    flat = mask.reshape(X * M, N)
    values = np.where(mask, np.asarray(g.values, np.float64), 0.0).reshape(X * M, N)
    rewards = token_rewards(g, r, mask).reshape(X * M, N)
    adv_tok, ret_tok = gae(rewards, values, flat, o.gamma, o.lam)
    adv_turn, ret_turn = turn_gae(g.turns, values, valid.reshape(-1), o.gamma, o.lam)
    adv_turn, ret_turn = np.where(flat, adv_turn, 0.0), np.where(flat, ret_turn, 0.0)
    adv = o.alpha * adv_turn + (1 - o.alpha) * adv_tok
    ret = o.alpha * ret_turn + (1 - o.alpha) * ret_tok
    metrics = critic_metrics(values, ret, flat)
    if flat.sum() > 1 and adv_turn[flat].std() > 0 and adv_tok[flat].std() > 0:
        metrics["turn_token_corr"] = float(np.corrcoef(adv_turn[flat], adv_tok[flat])[0, 1])
    adv = whiten(adv, flat) if o.whiten else adv
    return Estimate(adv.reshape(X, M, N).astype(np.float32), metrics=metrics, returns=ret.reshape(X, M, N))


register_advantage("hygae", hygae_advantage, options=HyGaeOptions, needs=("values", "turns"), single_rollout=True)
