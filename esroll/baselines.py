"""Group-relative transforms of rewards, shared by ES's fitness shapings (`esroll.es.shaping`) and GRPO's group
advantages (`esroll.grpo.advantages`), which register them under the same names.

Every function maps rewards [X groups, M members] (or [members], treated as one group) to an array of the same shape:

    fn(rewards, valid=None) -> shaped

`valid` (bool, same shape) marks the entries that take part: statistics are computed over valid entries of each
group only, and invalid entries come out as 0 whatever their value (NaN included), so a non-finite reward never
leaks into the others. std is the population standard deviation (ddof 0) and std₁ the sample one (ddof 1, taken as
0 for a group of one). A group with fewer than 2 valid entries has nothing to compare: every transform but `raw`
gives it 0.

    raw                  r                               (ES: keeps the estimators unbiased)
    zscore               (r − mean) / (std + 1e-8)       (ES; evosax divides by √(var + 1e-8) instead)
    centered_ranks       rank / (n − 1) − 1/2, in [−1/2, 1/2], ties share their mean rank (ES; OpenAI-ES, evosax)
    grpo                 (r − mean) / (std₁ + 1e-4)      (GRPO as TRL computes it: scale_rewards="group")
    grpo_population_std  (r − mean) / (std + 1e-4)       (GRPO with the population std: √(M/(M−1)) × grpo)
    dr_grpo              r − mean                        (Dr. GRPO: no std division)
    rloo                 r_i − mean_{j≠i} r_j            (RLOO: the policy-gradient twin of LOO-ROLL)

Written with jax.numpy: ES applies `es.shaping` inside its jitted update; `es.prompt_shaping` and GRPO apply them to
host arrays. `lift` turns a function of (r_XxM, valid_XxM) with invalid entries already zeroed into the public
signature; `BUILTIN` lists the lifted transforms by name.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
Shaping = Callable[..., Array]


def lift(fn: Callable[[Array, Array], Array]) -> Shaping:
    """Lift fn(r_XxM, valid_XxM) to the public signature: 1-D input, default mask, invalid entries zeroed."""

    def shaped(rewards: Array, valid: Array | None = None) -> Array:
        r = jnp.asarray(rewards, jnp.float32)
        valid = jnp.ones(r.shape, bool) if valid is None else jnp.asarray(valid, bool)
        valid = valid & jnp.isfinite(r)
        squeeze = r.ndim == 1
        r_XxM, valid_XxM = (r[None], valid[None]) if squeeze else (r, valid)
        out = jnp.where(valid_XxM, fn(jnp.where(valid_XxM, r_XxM, 0.0), valid_XxM), 0.0)
        return out[0] if squeeze else out

    shaped.__name__, shaped.__doc__ = fn.__name__, fn.__doc__
    return shaped


def _count(valid_XxM: Array) -> Array:
    return valid_XxM.sum(-1, keepdims=True)


def _mean(r_XxM: Array, valid_XxM: Array) -> Array:
    return r_XxM.sum(-1, keepdims=True) / jnp.maximum(_count(valid_XxM), 1)


def _std(r_XxM: Array, valid_XxM: Array, ddof: int = 0) -> Array:
    centered = jnp.where(valid_XxM, r_XxM - _mean(r_XxM, valid_XxM), 0.0)
    return jnp.sqrt((centered**2).sum(-1, keepdims=True) / jnp.maximum(_count(valid_XxM) - ddof, 1))


@lift
def raw(r_XxM: Array, valid_XxM: Array) -> Array:
    """The rewards themselves."""
    return r_XxM


@lift
def zscore(r_XxM: Array, valid_XxM: Array) -> Array:
    """(r − mean) / (std + 1e-8): scale-free; a group of equal rewards gives zeros."""
    return (r_XxM - _mean(r_XxM, valid_XxM)) / (_std(r_XxM, valid_XxM) + 1e-8)


@lift
def centered_ranks(r_XxM: Array, valid_XxM: Array) -> Array:
    """Ranks scaled to [−1/2, 1/2]; robust to outliers; tied rewards get equal values (so they cancel); 0 in a
    group of fewer than 2 valid entries."""
    both = valid_XxM[:, :, None] & valid_XxM[:, None, :]
    below = ((r_XxM[:, None, :] < r_XxM[:, :, None]) & both).sum(-1)
    ties = ((r_XxM[:, None, :] == r_XxM[:, :, None]) & both).sum(-1)
    rank = below + (ties - 1) / 2  # mean rank among equal rewards, 0-based
    n = _count(valid_XxM)
    return jnp.where(n >= 2, rank / jnp.maximum(n - 1, 1) - 0.5, 0.0)  # a lone entry has no rank to speak of


@lift
def grpo(r_XxM: Array, valid_XxM: Array) -> Array:
    """(r − mean_g) / (std₁_g + 1e-4), the GRPO group advantage as TRL computes it (sample std, eps 1e-4)."""
    return (r_XxM - _mean(r_XxM, valid_XxM)) / (_std(r_XxM, valid_XxM, ddof=1) + 1e-4)


@lift
def grpo_population_std(r_XxM: Array, valid_XxM: Array) -> Array:
    """(r − mean_g) / (std_g + 1e-4) with the population std (ddof 0), as some GRPO implementations divide."""
    return (r_XxM - _mean(r_XxM, valid_XxM)) / (_std(r_XxM, valid_XxM) + 1e-4)


@lift
def dr_grpo(r_XxM: Array, valid_XxM: Array) -> Array:
    """r − mean_g (Dr. GRPO drops the std division, which biases towards easy and hard groups)."""
    return r_XxM - _mean(r_XxM, valid_XxM)


@lift
def rloo(r_XxM: Array, valid_XxM: Array) -> Array:
    """r_i − mean_{j≠i} r_j: the baseline excludes the sample itself, so it is independent of it; 0 in a group of
    fewer than 2 valid entries (no other sample to form a baseline from)."""
    n = _count(valid_XxM)
    others = (r_XxM.sum(-1, keepdims=True) - r_XxM) / jnp.maximum(n - 1, 1)
    return jnp.where(n >= 2, r_XxM - others, 0.0)


BUILTIN: dict[str, Shaping] = {
    f.__name__: f for f in (raw, zscore, centered_ranks, grpo, grpo_population_std, dr_grpo, rloo)
}


def equal_groups(rewards_XxM: np.ndarray, weight_B: np.ndarray) -> dict[str, float]:
    """What a step does with the groups whose rewards are all equal (rows group-major, [X·M]): their fraction
    (`frac_groups_all_equal`) and, when there are any, the fraction of them that still carry a learning signal, some
    row of the group with a non-zero weight `weight_B` (`frac_all_equal_signal`; GRPO: the largest |advantage ×
    token factor| on the row's tokens)."""
    X = rewards_XxM.shape[0]
    equal_X = np.all(rewards_XxM == rewards_XxM[:, :1], axis=1)
    out = {"frac_groups_all_equal": float(equal_X.mean())}
    if equal_X.any():
        signal_X = np.abs(np.asarray(weight_B, np.float64)).reshape(X, -1).max(1) > 1e-9
        out["frac_all_equal_signal"] = float(signal_X[equal_X].mean())
    return out
