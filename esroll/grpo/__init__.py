"""GRPO, the gradient-based baseline, and the group-advantage estimators of recent papers (docs/grpo.md).

    loss         the clipped surrogate, the KL to the initial policy, the aggregation modes' token weights
    update       the state, its layout, one minibatch's gradient and the compiled optimizer step
    method       one training step: sample, reward, advantages, the variants' token weights, μ passes of updates
    advantages   the estimator registry (`register_advantage`), `Group` / `Estimate`, the group-relative built-ins
    estimators   the estimators of recent papers, one module each (listed there; docs/advantages.md, docs/step_level.md)
    variants     modifications of the step and loss (`register_variant`): STARE, ACPO, the progress advantage
    diagnostics  split-half figures of a step's gradient
    checks       a GRPO config's names against these registries

`GRPOConfig` lives in `esroll.config` with every other config.
"""

from esroll.config import GRPOConfig
from esroll.grpo import estimators  # noqa: F401 — registers the built-in estimators
from esroll.grpo.advantages import STEP_NEEDS, Estimate, Group, register_advantage
from esroll.grpo.checks import check_grpo_names
from esroll.grpo.loss import AGGREGATIONS, grpo_loss, token_weights
from esroll.grpo.method import make_batches, make_grpo_method, make_policy_gradient
from esroll.grpo.update import (
    GRPOState,
    Rollouts,
    host_state,
    init_state,
    keeps_reference,
    make_gradient,
    make_update,
    pad_rows,
    state_shardings,
    update_config,
)
from esroll.grpo.variants import Variant, register_variant

__all__ = [
    "AGGREGATIONS",
    "STEP_NEEDS",
    "Estimate",
    "GRPOConfig",
    "GRPOState",
    "Group",
    "Rollouts",
    "Variant",
    "check_grpo_names",
    "grpo_loss",
    "host_state",
    "init_state",
    "keeps_reference",
    "make_batches",
    "make_gradient",
    "make_grpo_method",
    "make_policy_gradient",
    "make_update",
    "pad_rows",
    "register_advantage",
    "register_variant",
    "state_shardings",
    "token_weights",
    "update_config",
]
