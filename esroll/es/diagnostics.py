"""ES's side of the estimator diagnostics (`esroll.diagnostics`): the two half-estimates of one step, built from
disjoint halves of its directions with antithetic pairs kept together, and the effective rank of a step's update.

For ES the halves are independent given everything the step's members share (the parameters, the step's prompts):
μ is the population field of the fitness on this step's prompts, and the noise counted is that of the directions
(and of the members' own sampling), not of the prompt sample.

Shape letters (see `esroll`): M population members, E directions, L layers, R rank.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from esroll.config import ESConfig
from esroll.diagnostics import as_metrics, lowrank_effective_rank, split_half_by_group
from esroll.es import estimators, noise, strategy
from esroll.models import LowRank

Array = jax.Array


def least_split_directions(method: str) -> int:
    """The fewest directions a split into two halves needs: each half an estimate of its own, so twice the
    estimator's `min_directions` (LOO-ROLL's leave-one-out baseline needs a second direction in each half)."""
    return 2 * estimators.ESTIMATORS.lookup(method).min_directions


def half_of_direction(method: str, population: int) -> np.ndarray:
    """[E] int: the half (0 or 1) of each direction, direction k in half k mod 2.

    Directions are the unit of the split, so an antithetic pair (members 2k, 2k+1 of EGGROLL, which share
    direction k) is never split. Directions are i.i.d. whatever their index, so any fixed split into equal halves
    gives identically distributed halves. Needs an even number of directions, and for LOO-ROLL at least 2 per half
    (the leave-one-out baseline of a half needs another member of that half).
    """
    E = estimators.num_directions(method, population)
    least = least_split_directions(method)
    if E % 2 or E < least:
        raise ValueError(
            f"{method} with population {population} has {E} directions: a split into two halves needs an even "
            f"number of them, at least {least}"
        )
    return np.arange(E) % 2


def _half_members(method: str, population: int, half: int) -> tuple[np.ndarray, np.ndarray]:
    """(directions [E/2], members [M/2]) of `half`, ascending, from the library's member→direction map
    (`estimators.member_directions`); checked to have the layout of a population of M/2 of its own."""
    with jax.ensure_compile_time_eval():
        direction_M, sign_M = (np.asarray(x) for x in estimators.member_directions(method, population))
    directions = np.flatnonzero(half_of_direction(method, population) == half)
    members = np.flatnonzero(np.isin(direction_M, directions))
    with jax.ensure_compile_time_eval():
        sub_direction, sub_sign = (np.asarray(x) for x in estimators.member_directions(method, members.size))
    if not (
        np.array_equal(direction_M[members], directions[sub_direction]) and np.array_equal(sign_M[members], sub_sign)
    ):
        raise AssertionError(f"{method}: the members of half {half} do not form a population of their own")
    return directions, members


def half_weights(
    method: str, fitness_M: Array, sigma, shaping="raw", min_valid_fraction: float = 0.5
) -> tuple[estimators.Weights, estimators.Weights]:
    """The weights of the two half-estimates of one ES step, as [E] vectors over the step's directions.

    Half h holds the directions of `half_of_direction` (k mod 2 = h) and the members evaluated along them (for
    EGGROLL both members 2k, 2k+1 of each of its pairs). Its estimate is exactly the library's estimator
    (`estimators.direction_weights`: the same shaping, non-finite policy and skip rule) applied to that half as a
    population of its own, of M/2 members:
        EGGROLL   w_k = (f⁺_k − f⁻_k) / ((M/2)·σ)                  for k in the half, 0 elsewhere
        LOO-ROLL  w_i = (f_i − f̄_h) / ((M/2 − 1)·σ),  f̄_h the half's mean fitness,  for i in the half, 0 elsewhere
    (M/2 becomes the members kept in the half when some are dropped). Each is an unbiased estimate of the population
    field on its own with raw fitness (LOO-ROLL: the baseline of member i is the mean of the other members of its
    half, independent of E_i). The halves share no direction and no fitness, so they are independent given the
    step's shared inputs.

    How they relate to the full estimate ĝ_full (`estimators.direction_weights` on all M), with raw fitness and
    every member kept:
    - EGGROLL: (w¹ + w²)/2 is the full weight vector exactly, so the split-half figures are those of ĝ_full.
    - LOO-ROLL: (ĝ₁ + ĝ₂)/2 has each half's own baseline, not the full mean, and the factor 1/(M/2 − 1): an unbiased
      estimate with slightly more noise than ĝ_full. Under the local affine model (docs/theory.md, statement 3)
      tr Cov((ĝ₁+ĝ₂)/2) = V/M + 2V_dense/(M(M−2)) against V/M + V_dense/(M(M−1)) for ĝ_full: a ratio at most
      (M−1)/(M−2) (at V_dense = V), so the split-half snr of LOO-ROLL underestimates ĝ_full's by at most that factor.
    A shaping other than raw (zscore, ranks) is computed over each half's members, so neither identity holds exactly
    then. Feeding w¹ (or w²) to `estimators.weighted_sum` with the step's factors gives ĝ₁ (ĝ₂).
    """
    M = fitness_M.shape[0]
    E = estimators.num_directions(method, M)
    out = []
    for h in (0, 1):
        directions, members = _half_members(method, M, h)
        w = estimators.direction_weights(method, fitness_M[members], sigma, shaping, min_valid_fraction)
        out.append(w._replace(w_E=jnp.zeros(E, w.w_E.dtype).at[directions].set(w.w_E)))
    return out[0], out[1]


class Halves(NamedTuple):
    """The two half-estimates of one ES step and their weights (`half_weights`)."""

    g1: dict[str, Array]  # {path: float32}: perturbed leaves only, as `estimators.weighted_sum` returns them
    g2: dict[str, Array]
    w1: estimators.Weights
    w2: estimators.Weights


def half_estimates(cfg: ESConfig, key: Array, step, params: dict, fitness_M: Array) -> Halves:
    """ĝ₁ and ĝ₂ of the step `strategy.estimate(cfg, key, step, params, fitness_M)` estimates from all members.

    Each half's sum regenerates only its own directions' noise (`strategy.step_factors`), with `cfg.chunk_size`
    as the full estimate uses it: the two together cost one full estimate. The ascent direction, in float32, on the
    leaves `cfg` perturbs (frozen leaves, zero in both halves, are left out).
    """
    sigma = strategy.sigma_at(cfg, step)
    w1, w2 = half_weights(cfg.method, fitness_M, sigma, strategy.shaping_of(cfg), cfg.min_valid_fraction)
    sums = []
    for h, w in ((0, w1), (1, w2)):
        directions, _ = _half_members(cfg.method, cfg.population, h)
        directions = jnp.asarray(directions)

        def factors_fn(local_E, directions=directions):  # padded chunks index past the half: zero weight there
            return strategy.step_factors(cfg, key, step, params, jnp.take(directions, local_E, mode="clip"))

        sums.append(estimators.weighted_sum(factors_fn, w.w_E[directions], cfg.rank, cfg.chunk_size or None))
    return Halves(sums[0], sums[1], w1, w2)


def update_effective_ranks(factors: dict, w_E: Array) -> dict[str, dict[str, Array]]:
    """{path: effective ranks} of the update Σ_k w_k E_k of every low-rank leaf of a step's factors
    (`strategy.step_factors` of directions 0..E−1, with the step's weights, or a half's): [L] per stacked leaf,
    a scalar per single leaf. Dense (vector) leaves are left out."""
    out: dict[str, Any] = {}
    for path, f in noise.flatten(factors).items():
        if isinstance(f, LowRank):
            out[path] = lowrank_effective_rank(f.a, w_E, f.b)
    return out


def step_diagnostics(cfg: ESConfig, key: Array, step, params: dict, fitness_M: Array, pg=None) -> dict[str, Array]:
    """The split-half diagnostics of one ES step, as metrics (`esroll.diagnostics.as_metrics`; jit-able, nothing
    here feeds the update):

        diag_snr, diag_cosine, diag_signal, diag_noise, diag_norm   split-half figures of the estimate, in total,
                                                                    and diag_snr_<group>, diag_cosine_<group> per
                                                                    leaf group (`esroll.diagnostics.leaf_group`)
        diag_pg_cosine         with `pg` (a policy gradient of the same parameters, ascent direction, any tree
                               holding the perturbed leaves): its cosine with the full ES estimate, in total and
                               per group (diag_pg_cosine_<group>)

    The estimate is the estimator's output before the optimizer (`strategy.estimate`), on the perturbed leaves.
    """
    halves = half_estimates(cfg, key, step, params, fitness_M)
    out = as_metrics(split_half_by_group(halves.g1, halves.g2))
    if pg is not None:
        full = noise.flatten(strategy.estimate(cfg, key, step, params, fitness_M)[0])
        pg = noise.flatten(pg)
        perturbed = {path: full[path] for path in halves.g1}
        policy = {path: pg[path].astype(jnp.float32) for path in halves.g1}
        cosines = split_half_by_group(perturbed, policy)
        out.update({f"diag_pg_cosine{'' if g == 'total' else '_' + g}": f["cosine"] for g, f in cosines.items()})
    return out


def rank_diagnostics(cfg: ESConfig, shapes: dict, key: Array, step, fitness_M: Array) -> dict[str, Array]:
    """diag_erank_<leaf>: the entropy effective rank of one ES step's update Σ_k w_k A_k B_kᵀ of each low-rank leaf
    of a parameter tree of `shapes` (arrays or ShapeDtypeStructs: the factors depend on the shapes only), averaged
    over its layers; diag_erank: the mean over the leaves (jit-able). Run it on one device: the factors are small,
    and a CPU mesh's partitioned LAPACK calls (the QR and SVD) wait on each other."""
    weights = estimators.direction_weights(
        cfg.method, fitness_M, strategy.sigma_at(cfg, step), strategy.shaping_of(cfg), cfg.min_valid_fraction
    )
    factors = strategy.step_factors(
        cfg, key, step, shapes, jnp.arange(estimators.num_directions(cfg.method, cfg.population))
    )
    ranks = {path: r["entropy"].mean() for path, r in update_effective_ranks(factors, weights.w_E).items()}
    out = {f"diag_erank_{path.rsplit('/', 1)[-1]}": rank for path, rank in ranks.items()}
    if ranks:
        out["diag_erank"] = jnp.mean(jnp.stack(list(ranks.values())))
    return out
