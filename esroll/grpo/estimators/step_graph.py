"""What the state-based step estimators (IBPO, GRAFT) share: each step's transition between states, its
log-probability, and per-token advantages from per-step ones. Not an estimator itself."""

from __future__ import annotations

import numpy as np

from esroll.grpo.advantages import Group

ROOT = -2  # the state before a completion's first step: the prompt (state ids are >= 0, and -1 marks no step)


def transitions(g: Group) -> tuple[np.ndarray, np.ndarray]:
    """(before [X, M, S], after [X, M, S]): the state each step starts from (`ROOT` for the first) and reaches
    (`Group.states`); both -1 past a completion's steps."""
    after = np.asarray(g.states, np.int64)
    before = np.concatenate([np.full(after.shape[:2] + (1,), ROOT, np.int64), after[..., :-1]], axis=2)
    return np.where(after >= 0, before, -1), after


def step_logprob(g: Group, S: int) -> np.ndarray:
    """[X, M, S]: the log-probability the sampling policy gave each step (the sum over its tokens); 0 past a
    completion's steps."""
    X, M, N = g.token_mask.shape
    step = np.where(np.asarray(g.token_mask, bool), np.asarray(g.steps.step_BxN).reshape(X, M, N), -1)
    logp = np.asarray(g.token_logp, np.float64)
    return np.stack([np.where(step == s, logp, 0.0).sum(2) for s in range(S)], axis=2)


def per_token(g: Group, step_adv_XxMxS: np.ndarray, plus_XxM: np.ndarray | float = 0.0) -> np.ndarray:
    """[X, M, N] float32: each completion token gets its step's advantage (NaN counts as 0) plus the completion's
    `plus`; tokens past a completion's end get 0."""
    X, M, N = g.token_mask.shape
    step = np.asarray(g.steps.step_BxN).reshape(X, M, N)
    adv = np.nan_to_num(np.asarray(step_adv_XxMxS, np.float64))
    taken = np.take_along_axis(adv, np.clip(step, 0, adv.shape[2] - 1), axis=2)
    total = taken + np.broadcast_to(np.asarray(plus_XxM, np.float64), (X, M))[..., None]
    keep = np.asarray(g.token_mask, bool) & (step >= 0)
    return np.where(keep, total, 0.0).astype(np.float32)
