"""Branches at the token positions an estimator chooses ("token_branches", `esroll.grpo.advantages`): what the GRPO
step and the credit measure both do to give such an estimator its group."""

from __future__ import annotations

import numpy as np

from esroll.grpo import advantages
from esroll.grpo.advantages import Group
from esroll.scoring import rollout_logprobs
from esroll.steps import branch_at
from esroll.steps.branch import branch_rewards


def token_branches(task, mesh, params, ref_params, examples, out, group: Group, name: str, options, key, sampling,
                   chunk: int = 0):  # fmt: skip
    """(`group` with `entropy`, `ref_logratio`, `branch_positions` and `branch_rewards` filled, the branched rollout,
    its origin [R, 2]): the sampled tokens scored by `params` (the entropy; with `ref_params`, the log-ratio to them,
    else 0: the reference is the sampling model itself), estimator `name`'s `branch_points(options, group)` asked
    where to branch, and its A continuations sampled there (`branch_at`, keyed by `key`). `chunk`: the head's
    positions at a time in the scoring forwards."""
    X, M, N = group.token_mask.shape
    logp_BxN, entropy_BxN = rollout_logprobs(task.cfg, params, out, True, chunk)
    ratio_BxN = np.zeros_like(logp_BxN)
    if ref_params is not None:
        ratio_BxN = logp_BxN - rollout_logprobs(task.cfg, ref_params, out, False, chunk)
    group = group._replace(entropy=entropy_BxN.reshape(X, M, N), ref_logratio=ratio_BxN.reshape(X, M, N))
    at, A = advantages.ESTIMATORS[name].branch_points(options, group)
    branched, origin = branch_at(task, mesh, params, examples, out, at.reshape(X * M, -1), key, sampling, A)
    group = group._replace(branch_positions=at, branch_rewards=branch_rewards(branched, origin, at.shape, A))
    return group, branched, origin
