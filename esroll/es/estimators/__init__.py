"""The ES estimators: the registry, the weights → update machinery (`base`), and the built-ins, one module each.
A new estimator is one module registering an `Estimator` (and, inside the library, one import line here)."""

from esroll.es.estimators import eggroll, looroll  # noqa: F401 — the built-ins register themselves
from esroll.es.estimators.base import (
    ESTIMATORS,
    Estimator,
    Weights,
    check_population,
    direction_weights,
    member_directions,
    num_directions,
    register_estimator,
    weighted_sum,
)

__all__ = [
    "ESTIMATORS",
    "Estimator",
    "Weights",
    "check_population",
    "direction_weights",
    "member_directions",
    "num_directions",
    "register_estimator",
    "weighted_sum",
]
