"""LOO-ROLL: one evaluation per direction, member i = θ + σE_i (E = M), with a leave-one-out baseline:
w_i = (f_i − f̄) / ((M'−1)σ) over the M' members kept, which equals Σ_i (f_i − mean of the others) E_i / (M'σ).
Predicted error under the affine model: E‖ĝ − G‖² = V/M + V_dense/(M(M−1)) (docs/theory.md)."""

from __future__ import annotations

import jax.numpy as jnp

from esroll.es.estimators.base import Estimator, register_estimator


def _weights(f_M, keep_M, kept, sigma):
    mean = f_M.sum() / jnp.maximum(kept, 1)
    return jnp.where(keep_M, f_M - mean, 0.0) / (sigma * jnp.maximum(kept - 1, 1))


ESTIMATOR = register_estimator(
    "looroll",
    Estimator(
        members_per_direction=1,
        signs=lambda k: jnp.ones(1),
        weights=_weights,
        min_directions=2,
        mse=lambda population, v, v_dense: v / population + v_dense / (population * (population - 1)),
    ),
)
