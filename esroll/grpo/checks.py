"""The check of a GRPO config's names against the registries of the modules that implement them."""

from __future__ import annotations

from esroll.config import GRPOConfig, check_fields
from esroll.grpo import advantages
from esroll.grpo import variants as grpo_variants
from esroll.grpo.loss import AGGREGATIONS
from esroll.models.transformer import REMAT_POLICIES


def check_grpo_names(g: GRPOConfig) -> None:
    """Raise the one-line ConfigError of the first name in `g` that names no implementation (its advantage estimator,
    `esroll.grpo.advantages.ESTIMATORS`; its variants, `esroll.grpo.variants.VARIANTS`; its aggregation, `AGGREGATIONS`;
    its remat policy, `esroll.models.transformer.REMAT_POLICIES`), of a group size the estimator cannot use (>= 2, but
    for the single-rollout estimators, `EstimatorSpec.single_rollout`), of options the estimator or a variant refuses
    (its options dataclass, and its `check`), or of settings a variant refuses (`Variant.check`). `GRPOConfig` (in
    `esroll.config`) checks everything else when it is built but cannot see these registries; `make_update` and
    `make_grpo_method` run this, so that a config built by hand is refused before anything runs."""
    spec = advantages.ESTIMATORS.get(g.advantage)
    single = spec is not None and spec.single_rollout
    unknown = [v for v in g.variants if v not in grpo_variants.VARIANTS]
    checks = [
        ("advantage", g.advantage in advantages.ESTIMATORS, advantages.ESTIMATORS.expected()),
        ("group_size", single or g.group_size >= 2, ">= 2"),
        ("variants", not unknown, f"names among {', '.join(grpo_variants.VARIANTS)}"),
        ("aggregation", g.aggregation in AGGREGATIONS, f"one of {', '.join(AGGREGATIONS)}"),
        ("remat", isinstance(g.remat, str) and g.remat in REMAT_POLICIES, f"one of {', '.join(REMAT_POLICIES)}"),
    ]
    check_fields(g, checks, "GRPOConfig")
    options = [advantages.ESTIMATORS.options_of(g.adv, g.advantage)]
    options += [grpo_variants.VARIANTS.options_of(g.variant_options, name) for name in g.variants]
    for o in options:
        if hasattr(o, "check"):
            o.check(g)
    for _, variant in grpo_variants.active(g):
        variant.check(g)
