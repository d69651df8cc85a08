"""Success Visitation Matching: a dense reward for episodes from the difference between the state–actions that
successful episodes visit and those that failed ones visit, with no reward model to train.

The discriminator is fitted on each level's finished episodes (a step's episodes of one seed, refitted every step):
a state–action is the observation an action answered (`Turns.states`, its exact text) and the action's word
(`action_word`: what the environment reads). Its logit is the balanced cross-entropy minimiser over the two classes'
visitation distributions, counted exactly,

    f̂(s, a) = log d_succ(s, a) − log d_fail(s, a),   d_c(s, a) = n_c(s, a) / N_c,

n_c the visits in class c's episodes and N_c all of that class's visits; balanced, so that a batch that mostly fails
does not read every state–action as a failure's. Clipped to [−β, β] (a state–action only one class visits has an
infinite logit: it gets ±β); 0 on a level where either class has no episode, or for a state–action neither visits.
Each turn's reward becomes r_t + λ·clip_β(f̂(s_t, a_t)); an episode's return gains λ·Σ_t clip_β(f̂).

An observation holds the whole level (FrozenLake's map, Sokoban's room), so state–actions recur only among the
episodes of one level: a GRPO group, or an ES population's members on one seed. Fitting each level apart keeps a
level where every episode failed at 0 (fitted with the batch's other levels, its every state–action would read as a
failure's, −β, and a shorter failure would then score better than a longer one). Counts carried over from earlier
steps would be read by no later episode of a new level, and none are kept. The discriminator reads
the environment's texts and the action words; nothing of it is evaluated.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from esroll.agents.base import action_word

CLIP = 2.0  # β: the logit's bound


def _pairs(turns, b: int) -> list[tuple[str, str]]:
    """(state, action word) of each turn row b played."""
    count = int(turns.count_B[b])
    return [(turns.states[b][t], action_word(turns.actions[b][t])) for t in range(count)]


def discriminator_logits(
    turns, rows, beta: float = CLIP, weight_B: np.ndarray | None = None, level_B: np.ndarray | None = None
) -> np.ndarray:
    """[B, W] the clipped discriminator logit clip_β(f̂(s_t, a_t)) of each turn of each row (see the module
    docstring), fitted on the episodes of `rows` (an iterable of row indices, or a [B] bool mask: the valid ones) by
    their `turns.solved_B`, one fit per level (`level_B[b]`, e.g. the row's prompt; None: one fit over all rows),
    each row's visits counted `weight_B[b]` times (None: once; a probability gives the expected counts of a
    distribution of episodes); 0 past a row's turns, on rows outside `rows` and on a level of one class."""
    if turns.actions is None or turns.solved_B is None:
        raise ValueError("Success Visitation Matching reads the turns' action texts and solved flags (Turns.actions)")
    B, W = np.asarray(turns.reward_BxW).shape
    rows = np.flatnonzero(rows) if np.asarray(rows).dtype == bool else np.asarray(list(rows), np.int64)
    levels = np.zeros(B, np.int64) if level_B is None else np.asarray(level_B)
    out = np.zeros((B, W))
    for level in np.unique(levels[rows]):
        _fit(turns, rows[levels[rows] == level], beta, np.ones(B) if weight_B is None else weight_B, out)
    return out


def _fit(turns, rows: np.ndarray, beta: float, weight_B, out: np.ndarray) -> None:
    """The discriminator of one level's `rows`, its logits written into `out`."""
    visits: dict[bool, Counter] = {True: Counter(), False: Counter()}
    for b in rows:
        for pair in _pairs(turns, b):
            visits[bool(turns.solved_B[b])][pair] += float(weight_B[b])
    totals = {c: sum(v.values()) for c, v in visits.items()}
    if not totals[True] or not totals[False]:
        return
    for b in rows:
        for t, pair in enumerate(_pairs(turns, b)):
            succ, fail = visits[True][pair] / totals[True], visits[False][pair] / totals[False]
            if succ and fail:
                out[b, t] = np.clip(np.log(succ) - np.log(fail), -beta, beta)
            else:
                out[b, t] = beta if succ else -beta  # one class alone visits it (and this row visited it)


def shaped_rewards(turns, rows, lam: float, beta: float = CLIP, level_B=None) -> tuple[np.ndarray, np.ndarray]:
    """([B, W] each turn's reward r_t + λ·clip_β(f̂(s_t, a_t)), [B, W] the clipped logits): `discriminator_logits`
    fitted on `rows` per level; the rewards past a row's turns are its own (0)."""
    logits = discriminator_logits(turns, rows, beta, level_B=level_B)
    return np.asarray(turns.reward_BxW, np.float64) + lam * logits, logits
