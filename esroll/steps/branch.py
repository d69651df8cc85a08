"""Reasoning steps of a rollout's completions: cut and scored (`with_steps`), and branched rollouts that continue
each completion from the end of each of its steps (`branch`: the Monte Carlo step values' and the credit
reference's samples) or from chosen token positions (`branch_at`: APPO's)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from esroll.config import StepsConfig
from esroll.data import Example
from esroll.rollout import PAD, Rollout, Sampling, rollout
from esroll.steps.segment import segment
from esroll.steps.verify import STEP_VERIFIERS


def with_steps(out: Rollout, task, examples, cfg: StepsConfig, scored: bool = False) -> Rollout:
    """`out` (a rollout with its completions) with each completion cut into reasoning steps by the config section
    (`segment`: `Rollout.steps`) and, when `scored`, each step scored by its verifier (`esroll.steps.verify`:
    `Rollout.step_scores_BxJ`, NaN past a completion's steps). Computed on the host from the exchanged tokens, so
    every process gets the same."""
    if out.tokens_BxN is None:
        raise ValueError("with_steps: the rollout carries no completions (rollout(..., completions=True))")
    found = segment(
        task.tokenizer,
        out.tokens_BxN,
        out.length_B,
        eos_ids=task.eos_ids,
        boundary=cfg.boundary,
        max_steps=cfg.max_steps,
    )
    scores = score_steps(out.example_B, found, examples, cfg.verifier, cfg.max_steps) if scored else None
    return out._replace(steps=found, step_scores_BxJ=scores)


def score_steps(example_B: np.ndarray, steps, examples, verifier: str, max_steps: int) -> np.ndarray:
    """[B, max_steps] float32: each step of each row (`steps`, `segment`'s) scored by the registered step verifier
    `verifier`; NaN past a row's steps and on padding rows."""
    fn = STEP_VERIFIERS.lookup(verifier)
    scores = np.full((len(example_B), max_steps), np.nan, np.float32)
    for b, e in enumerate(example_B):
        if e != PAD and steps.count_B[b]:
            scores[b, : steps.count_B[b]] = fn(examples[e], steps.text[b])
    return scores


def branch(
    task: Any,
    mesh: Mesh,
    params: dict,
    examples: Sequence[Example],
    out: Rollout,
    key: jax.Array,
    sampling: Sampling,
    branches: int,
) -> tuple[Rollout, np.ndarray]:
    """Branched rollouts: `branches` continuations from the end of each step but the last of each completion of `out`
    (which carries its steps, `with_steps`), each a `rollout` with the completion through that step as
    its prefix. Returns the branches (rows in order of (row, step, branch); their rewards score prefix +
    continuation) and their origin [R, 2] (row of `out`, step). Every process must pass the same arguments; keyed
    by `key` and each branch's row, so the result does not depend on the mesh."""
    if out.steps is None:
        raise ValueError("branch: the rollout carries no steps (with_steps)")
    origin = [(b, s) for b in range(len(out.length_B)) for s in range(int(out.steps.count_B[b]) - 1)]
    cut = [out.steps.end[b][s] for b, s in origin]
    return _continue(task, mesh, params, examples, out, origin, cut, key, sampling, branches)


def branch_at(
    task: Any,
    mesh: Mesh,
    params: dict,
    examples: Sequence[Example],
    out: Rollout,
    positions_BxK: np.ndarray,
    key: jax.Array,
    sampling: Sampling,
    branches: int,
) -> tuple[Rollout, np.ndarray]:
    """Branched rollouts at token positions: `branches` continuations of each completion of `out` from each of its
    positions t ≥ 1 in `positions_BxK` (-1: none), each a `rollout` given the completion's first t tokens, so that
    token t onward is sampled afresh. Returns the branches (rows in order of (row, k, branch); their rewards score
    prefix + continuation) and their origin [R, 2] (row of `out`, k), as `branch` does."""
    positions_BxK = np.asarray(positions_BxK)
    origin = [(b, k) for b in range(positions_BxK.shape[0]) for k in range(positions_BxK.shape[1])]
    origin = [(b, k) for b, k in origin if positions_BxK[b, k] >= 1]
    bad = [(b, k) for b, k in origin if positions_BxK[b, k] >= out.length_B[b]]
    if bad:
        raise ValueError(f"branch_at: position {positions_BxK[bad[0]]} of row {bad[0][0]} is past its completion")
    cut = [int(positions_BxK[b, k]) for b, k in origin]
    return _continue(task, mesh, params, examples, out, origin, cut, key, sampling, branches)


def _continue(task, mesh, params, examples, out, origin, cut, key, sampling, branches):
    """`branches` continuations of row b of `out` given its first `cut[i]` tokens, for each (b, ·) = origin[i]."""
    origin = [o for o in origin for _ in range(branches)]
    cut = [c for c in cut for _ in range(branches)]
    origin_Bx2 = np.array(origin, np.int64).reshape(-1, 2)
    if not len(origin):
        return None, origin_Bx2
    prefixes = [out.tokens_BxN[b, :c] for (b, _), c in zip(origin, cut)]
    branched = rollout(
        task,
        mesh,
        params,
        examples,
        out.example_B[origin_Bx2[:, 0]],
        key,
        sampling,
        completions=True,
        prefixes=prefixes,
    )
    return branched, origin_Bx2


def branch_rewards(branched, origin_Bx2: np.ndarray, shape: tuple[int, ...], branches: int) -> np.ndarray:
    """[X, M, J, A] the rewards of the A branches from the end of each step (`branch`'s rows and origins), or from
    each of J positions (`branch_at`'s); NaN where none was sampled."""
    X, M, J = shape
    out = np.full((X * M, J, branches), np.nan, np.float64)
    if branched is not None:
        rewards_R = np.asarray(branched.reward_B, np.float64)
        for r, (b, s) in enumerate(origin_Bx2):
            out[b, s, r % branches] = rewards_R[r]
    return out.reshape(X, M, J, branches)
