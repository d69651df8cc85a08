"""Fitness shaping (ES) and group advantages (GRPO): one signature, shared by both estimators.

Every function maps rewards [groups, members] (or [members], treated as one group) to an array of the same shape:

    fn(rewards, valid=None) -> shaped

`valid` (bool, same shape) marks the entries that take part: statistics are computed over valid entries of each
group only, and invalid entries come out as 0 whatever their value (NaN included), so a non-finite reward never
leaks into the others. Standard deviations are population ones (ddof = 0).

    raw             r                                   (ES: keeps the estimators unbiased)
    zscore          (r − mean) / (std + 1e-8)           (ES)
    centered_ranks  rank / (n − 1) − 1/2, in [−1/2, 1/2], ties share their mean rank (ES; OpenAI-ES, evosax)
    grpo            (r − mean) / (std + 1e-4)           (GRPO; TRL's eps)
    dr_grpo         r − mean                            (Dr. GRPO: no std division)
    rloo            r_i − mean_{j≠i} r_j                (RLOO: the policy-gradient twin of LOO-ROLL)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

Array = jax.Array
Shaping = Callable[..., Array]


def _grouped(fn: Callable[[Array, Array], Array]) -> Shaping:
    """Lift fn(r_GxM, valid_GxM) to the public signature: 1-D input, default mask, invalid entries zeroed."""

    def shaped(rewards: Array, valid: Array | None = None) -> Array:
        r = jnp.asarray(rewards, jnp.float32)
        valid = jnp.ones(r.shape, bool) if valid is None else jnp.asarray(valid, bool)
        valid = valid & jnp.isfinite(r)
        squeeze = r.ndim == 1
        r_GxM, valid_GxM = (r[None], valid[None]) if squeeze else (r, valid)
        out = jnp.where(valid_GxM, fn(jnp.where(valid_GxM, r_GxM, 0.0), valid_GxM), 0.0)
        return out[0] if squeeze else out

    shaped.__name__, shaped.__doc__ = fn.__name__, fn.__doc__
    return shaped


def _count(valid_GxM: Array) -> Array:
    return valid_GxM.sum(-1, keepdims=True)


def _mean(r_GxM: Array, valid_GxM: Array) -> Array:
    return r_GxM.sum(-1, keepdims=True) / jnp.maximum(_count(valid_GxM), 1)


def _std(r_GxM: Array, valid_GxM: Array) -> Array:
    centered = jnp.where(valid_GxM, r_GxM - _mean(r_GxM, valid_GxM), 0.0)
    return jnp.sqrt((centered**2).sum(-1, keepdims=True) / jnp.maximum(_count(valid_GxM), 1))


@_grouped
def raw(r_GxM: Array, valid_GxM: Array) -> Array:
    """The rewards themselves."""
    return r_GxM


@_grouped
def zscore(r_GxM: Array, valid_GxM: Array) -> Array:
    """(r − mean) / (std + 1e-8): scale-free; a group of equal rewards gives zeros."""
    return (r_GxM - _mean(r_GxM, valid_GxM)) / (_std(r_GxM, valid_GxM) + 1e-8)


@_grouped
def centered_ranks(r_GxM: Array, valid_GxM: Array) -> Array:
    """Ranks scaled to [−1/2, 1/2]; robust to outliers; tied rewards get equal values (so they cancel)."""
    both = valid_GxM[:, :, None] & valid_GxM[:, None, :]
    below = ((r_GxM[:, None, :] < r_GxM[:, :, None]) & both).sum(-1)
    ties = ((r_GxM[:, None, :] == r_GxM[:, :, None]) & both).sum(-1)
    rank = below + (ties - 1) / 2  # mean rank among equal rewards, 0-based
    return rank / jnp.maximum(_count(valid_GxM) - 1, 1) - 0.5


@_grouped
def grpo(r_GxM: Array, valid_GxM: Array) -> Array:
    """(r − mean_g) / (std_g + 1e-4), the GRPO group advantage (eps as in TRL)."""
    return (r_GxM - _mean(r_GxM, valid_GxM)) / (_std(r_GxM, valid_GxM) + 1e-4)


@_grouped
def dr_grpo(r_GxM: Array, valid_GxM: Array) -> Array:
    """r − mean_g (Dr. GRPO drops the std division, which biases towards easy and hard groups)."""
    return r_GxM - _mean(r_GxM, valid_GxM)


@_grouped
def rloo(r_GxM: Array, valid_GxM: Array) -> Array:
    """r_i − mean_{j≠i} r_j: the baseline excludes the sample itself, so it is independent of it."""
    n = _count(valid_GxM)
    others = (r_GxM.sum(-1, keepdims=True) - r_GxM) / jnp.maximum(n - 1, 1)
    return r_GxM - others


SHAPINGS: dict[str, Shaping] = {
    "raw": raw, "zscore": zscore, "centered_ranks": centered_ranks, "grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo,
}  # fmt: skip


def get(name: str) -> Shaping:
    """The shaping / advantage function called `name`."""
    if name not in SHAPINGS:
        raise ValueError(f"unknown fitness shaping / advantage {name!r}; known: {', '.join(SHAPINGS)}")
    return SHAPINGS[name]
