"""Antithetic EGGROLL: members 2k, 2k+1 = θ ± σE_k (E = M/2 directions), w_k = (f⁺_k − f⁻_k) / (M'σ), M' the members
kept (a pair is kept or dropped whole). Predicted error under the affine model: E‖ĝ − G‖² = 2V/M (docs/theory.md)."""

from __future__ import annotations

import jax.numpy as jnp

from esroll.es.estimators.base import Estimator, register_estimator


def _weights(f_M, keep_M, kept, sigma):
    return (f_M[0::2] - f_M[1::2]) / (sigma * jnp.maximum(kept, 2))


ESTIMATOR = register_estimator(
    "eggroll",
    Estimator(
        members_per_direction=2,
        signs=lambda k: jnp.array([1.0, -1.0]),
        weights=_weights,
        min_directions=1,
        mse=lambda population, v, v_dense: 2 * v / population,
    ),
)
