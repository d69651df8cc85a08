"""Monte Carlo step values (VinePPO): each reasoning step credited with how much it changed the chance of reaching a
right answer, measured by continuations sampled from the end of each step. What it computes and what is chosen where
the source leaves it open: docs/step_level.md."""

from __future__ import annotations

import warnings

import numpy as np

from esroll.grpo.advantages import Estimate, Group, per_token, register_advantage, valid_rewards


def leave_one_out_means(g: Group) -> np.ndarray:
    """[X, M]: for each completion, the mean reward of the other valid completions of its prompt; NaN where it has no
    other valid completion. Independent of the completion's own reward, so an unbiased estimate of V(prompt) for it."""
    r, valid = valid_rewards(g)
    total, n = r.sum(1, keepdims=True), valid.sum(1, keepdims=True)
    others = n - valid
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(others > 0, (total - r) / others, np.nan)


def step_values(g: Group, prompt_values: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(values [X, M, J + 1], step advantages [X, M, J]) of each completion's steps, from `g.steps` and
    `g.branch_rewards`.

    values[x, j, 0] = V(prompt): `prompt_values[x]` when given (an estimate independent of the group, e.g. the mean
    reward of fresh rollouts of the prompt), else the leave-one-out mean of the prompt's other valid completions
    (`leave_one_out_means`; NaN without one). Not the mean of the whole group: that includes the completion's own
    reward, which shrinks the expected first-step advantage to (M − 1)/M of the true one (docs/step_level.md).
    values[x, j, s + 1] = V(prompt + completion through step s), the mean reward of the A continuations sampled from
    the end of step s, and for the last step the completion's own reward (its outcome: nothing is left to sample). A
    step's advantage is V(after) − V(before), so a completion's step advantages sum to its reward less V(prompt).
    NaN past a completion's steps, and on every step of an invalid completion."""
    r, valid = valid_rewards(g)
    X, M = r.shape
    J = g.branch_rewards.shape[2]
    if prompt_values is None:
        v0 = leave_one_out_means(g)
    else:
        v0 = np.broadcast_to(np.asarray(prompt_values, np.float64).reshape(X, 1), (X, M))
    counts = np.asarray(g.steps.count_B).reshape(X, M)
    values = np.full((X, M, J + 1), np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices: the steps that have no branches
        after = np.nanmean(g.branch_rewards, axis=-1)  # [X, M, J]
    for x in range(X):
        for j in range(M):
            c = int(counts[x, j])
            if not valid[x, j] or c == 0:
                continue
            values[x, j, 0] = v0[x, j]
            values[x, j, 1:c] = after[x, j, : c - 1]
            values[x, j, c] = r[x, j]
    return values, values[..., 1:] - values[..., :-1]


def mc_steps(g: Group, o=None, state=None) -> Estimate:
    """Per-token advantages: each token gets the advantage of its step (`step_values`, V(prompt) leave-one-out);
    tokens past a completion's end, the completions that are invalid or empty, and the first step of a completion
    with no other valid completion in its group (no estimate of V(prompt) apart from its own reward) get 0. Logs
    `mc_prompt_value` (V(prompt): the mean over a group's completions of their leave-one-out means, i.e. the group's
    mean reward, averaged over the prompts that have one) and `mc_step_advantage_abs` (mean |advantage| over the
    steps that have one)."""
    values, adv_XxMxJ = step_values(g)
    steps_known = ~np.isnan(adv_XxMxJ)
    has_value = np.isfinite(values[..., 0]).any(1)  # the prompts with two valid completions or more
    metrics = {
        "mc_prompt_value": float(np.nanmean(values[has_value, :, 0], axis=1).mean()) if has_value.any() else 0.0,
        "mc_step_advantage_abs": float(np.abs(adv_XxMxJ[steps_known]).mean()) if steps_known.any() else 0.0,
    }
    return Estimate(per_token(g, adv_XxMxJ), metrics=metrics)


register_advantage("mc_steps", mc_steps, needs=("steps", "branches"))
