"""Monte Carlo step values (VinePPO): each reasoning step credited with how much it changed the chance of reaching a
right answer, measured by continuations sampled from the end of each step. What it computes and what is chosen where
the source leaves it open: docs/step_level.md."""

from __future__ import annotations

import warnings

import numpy as np

from esroll.grpo.advantages import Estimate, Group, per_token, register_advantage, valid_rewards


def step_values(g: Group) -> tuple[np.ndarray, np.ndarray]:
    """(values [X, M, S + 1], step advantages [X, M, S]) of each completion's steps, from `g.steps` and
    `g.branch_rewards`.

    values[x, j, 0] = V(prompt), the mean reward of the prompt's valid completions (the group is M samples from the
    prompt); values[x, j, s + 1] = V(prompt + completion through step s), the mean reward of the K continuations
    sampled from the end of step s, and for the last step the completion's own reward (its outcome: nothing is left
    to sample). A step's advantage is V(after) − V(before), so a completion's step advantages sum to its reward less
    V(prompt). NaN past a completion's steps, and on every step of an invalid completion."""
    r, valid = valid_rewards(g)
    X, M = r.shape
    S = g.branch_rewards.shape[2]
    v0 = r.sum(1) / np.maximum(valid.sum(1), 1)
    counts = np.asarray(g.steps.count_B).reshape(X, M)
    values = np.full((X, M, S + 1), np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices: the steps that have no branches
        after = np.nanmean(g.branch_rewards, axis=-1)  # [X, M, S]
    for x in range(X):
        for j in range(M):
            c = int(counts[x, j])
            if not valid[x, j] or c == 0:
                continue
            values[x, j, 0] = v0[x]
            values[x, j, 1:c] = after[x, j, : c - 1]
            values[x, j, c] = r[x, j]
    return values, values[..., 1:] - values[..., :-1]


def mc_steps(g: Group, o=None, state=None) -> Estimate:
    """Per-token advantages: each token gets the advantage of its step (`step_values`); tokens past a completion's
    end, and the completions that are invalid or empty, get 0. Logs `mc_prompt_value` (V(prompt), mean over
    prompts) and `mc_step_advantage_abs` (mean |advantage| over the steps)."""
    values, adv_XxMxS = step_values(g)
    steps_known = ~np.isnan(adv_XxMxS)
    has_value = np.isfinite(values[..., 0]).any(1)  # the prompts with a valid completion
    metrics = {
        "mc_prompt_value": float(np.nanmax(values[has_value, :, 0], axis=1).mean()) if has_value.any() else 0.0,
        "mc_step_advantage_abs": float(np.abs(adv_XxMxS[steps_known]).mean()) if steps_known.any() else 0.0,
    }
    return Estimate(per_token(g, adv_XxMxS), metrics=metrics)


register_advantage("mc_steps", mc_steps, needs=("steps", "branches"))
