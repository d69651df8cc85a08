"""What the state-based step estimators (IBPO, GRAFT) share: each step's transition between states. Not an
estimator itself."""

from __future__ import annotations

import numpy as np

from esroll.grpo.advantages import Group

ROOT = -2  # the state before a completion's first step: the prompt (state ids are >= 0, and -1 marks no step)


def transitions(g: Group) -> tuple[np.ndarray, np.ndarray]:
    """(before [X, M, J], after [X, M, J]): the state each step starts from (`ROOT` for the first) and reaches
    (`Group.states`); both -1 past a completion's steps."""
    after = np.asarray(g.states, np.int64)
    before = np.concatenate([np.full(after.shape[:2] + (1,), ROOT, np.int64), after[..., :-1]], axis=2)
    return np.where(after >= 0, before, -1), after
