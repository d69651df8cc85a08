"""Generalised advantage estimation over generated tokens, batch whitening and a critic's explained variance (PPO's
pieces; its clipped value loss is the critic's own, `esroll.critic.value_loss`).

A row's generated tokens are the positions of its `mask` (a completion's tokens; in an episode, the model's actions
only). GAE runs over those positions in order and skips every other one, so in an episode the last action token of
a turn bootstraps from the value at the first action token of the next turn, across the environment's answer (as
verl's multi-turn GAE does). With rewards r, values V at the generated positions p_1 < … < p_K of a row:

    δ_k = r_k + γ·V_{k+1} − V_k          (V_{K+1} = 0: the episode ends after its last generated token)
    A_k = δ_k + γ·λ·A_{k+1}              (A_{K+1} = 0)
    R_k = A_k + V_k                      (the critic's target)

An outcome reward sits on the completion's last generated token; a turn's reward on the turn's last action token. At
γ = λ = 1, A_k = Σ_{j≥k} r_j − V_k: the return minus the value. docs/critics.md works an example by hand.
"""

from __future__ import annotations

import numpy as np

WHITEN_EPS = 1e-8  # inside the square root, as verl's and TRL's `masked_whiten`


def gae(
    reward_BxN: np.ndarray, value_BxN: np.ndarray, mask_BxN: np.ndarray, gamma: float, lam: float
) -> tuple[np.ndarray, np.ndarray]:
    """(advantages [B, N], returns [B, N]) over each row's generated positions (`mask_BxN`), 0 elsewhere. A reward
    or value at a position outside the mask is never read."""
    mask = np.asarray(mask_BxN, bool)
    reward = np.where(mask, np.asarray(reward_BxN, np.float64), 0.0)
    value = np.where(mask, np.asarray(value_BxN, np.float64), 0.0)
    B, N = mask.shape
    advantage = np.zeros((B, N))
    next_value, later = np.zeros(B), np.zeros(B)
    for t in range(N - 1, -1, -1):
        m = mask[:, t]
        here = reward[:, t] + gamma * next_value - value[:, t] + gamma * lam * later
        advantage[:, t] = np.where(m, here, 0.0)
        later = np.where(m, here, later)
        next_value = np.where(m, value[:, t], next_value)
    return advantage, np.where(mask, advantage + value, 0.0)


def whiten(x_BxN: np.ndarray, mask_BxN: np.ndarray, eps: float = WHITEN_EPS) -> np.ndarray:
    """(x − mean) / √(var + eps) over the masked entries of the whole batch (var with Bessel's correction), 0 elsewhere;
    0 everywhere when fewer than two entries are masked."""
    mask = np.asarray(mask_BxN, bool)
    x = np.asarray(x_BxN, np.float64)
    n = int(mask.sum())
    if n < 2:
        return np.zeros_like(x)
    mean = x[mask].mean()
    var = ((x[mask] - mean) ** 2).sum() / (n - 1)
    return np.where(mask, (x - mean) / np.sqrt(var + eps), 0.0)


def explained_variance(value_BxN: np.ndarray, return_BxN: np.ndarray, mask_BxN: np.ndarray) -> float:
    """1 − Var(R − V) / Var(R) over the masked tokens: 1 for a perfect critic, 0 for one that predicts the mean,
    negative for a worse one; NaN when the returns do not vary."""
    mask = np.asarray(mask_BxN, bool)
    r = np.asarray(return_BxN, np.float64)[mask]
    v = np.asarray(value_BxN, np.float64)[mask]
    var = r.var()
    return float(1.0 - (r - v).var() / var) if var > 0 else float("nan")
