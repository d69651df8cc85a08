"""GRPO's split-half diagnostics: the on-policy gradient from the prompt groups of even index against the one from
the odd ones (`esroll.diagnostics`: signal, noise, their ratio and cosines per leaf group)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from esroll import diagnostics


def split_half_diagnostics(gradient, params, ref_params, batches_of, X: int, M: int) -> dict:
    """The split-half diagnostics (`esroll.diagnostics`) of a GRPO step's on-policy gradient at `params`: the
    gradient from the prompt groups of even index against the one from the odd ones (`batches_of(factor_BxN)`
    builds the step's minibatches with its token weights times that factor: 2 on a half's rows, 0 elsewhere, so
    that each half estimates the full gradient and their mean is it exactly). Groups are independent given the
    parameters, so the halves are too; the noise counted is that of the prompts drawn and of the completions
    sampled."""
    halves = []
    for h in (0, 1):
        keep_B = (np.arange(X * M) // M) % 2 == h
        factor = np.broadcast_to(2.0 * keep_B[:, None], (X * M, 1)).astype(np.float32)
        halves.append([gradient(params, ref_params, batch, jnp.asarray(True))[0] for batch in batches_of(factor)])
    return jax.device_get(_split_half_figures(*halves))


@jax.jit
def _split_half_figures(parts1: list, parts2: list) -> dict:
    """`esroll.diagnostics.as_metrics` of the halves, each the sum of its minibatches' gradients: one program (op by op,
    the reductions of sharded arrays would each be a program of their own)."""
    g1, g2 = (functools.reduce(lambda a, b: jax.tree.map(jnp.add, a, b), parts) for parts in (parts1, parts2))
    return diagnostics.as_metrics(diagnostics.split_half_by_group(g1, g2))
