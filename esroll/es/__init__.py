"""Evolution strategies with low-rank noise: antithetic EGGROLL and LOO-ROLL (the mathematics: docs/theory.md).

`strategy` is the entry point (`ESConfig`, `make_strategy` → init / ask / tell); `noise` draws the factors,
`estimators` turns fitness into an update, `theory` holds the variance predictions and Monte-Carlo helpers used by
tests and notebooks. `ESConfig` and `ESSettings` are defined in `esroll.config`, with every other config.
"""

from esroll.config import ESConfig, ESSettings
from esroll.es.strategy import (
    ESState,
    Strategy,
    estimate,
    trainable,
    make_strategy,
    member_deltas,
    step_factors,
)

__all__ = [
    "ESConfig",
    "ESSettings",
    "ESState",
    "Strategy",
    "estimate",
    "trainable",
    "make_strategy",
    "member_deltas",
    "step_factors",
]
