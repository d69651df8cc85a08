"""Closed-form estimator errors under the local affine model, and Monte-Carlo helpers to measure them.

Affine model: J(θ+σE) = J(θ) + σ⟨G, E⟩. Per-sample estimator ⟨G,E⟩E (one antithetic pair), summed over the perturbed
units u (one matrix of one layer, or one vector) of total dimension d, with independent noise per unit:
    V = E‖⟨G,E⟩E − G‖² = (d+1)‖G‖² + Σ_{low-rank u} 2(m_u+n_u+1)/r · ‖G_u‖²
(the first term is dense Gaussian noise; the second the rank-r excess, from E[⟨G,E⟩²‖E‖²] for E = ABᵀ/√r:
((m+2)(n+2) + (r−1)(mn+2))/r · ‖G‖²; for one m×n matrix at rank one, V = ((m+2)(n+2)−1)‖G‖²).
At M evaluations (members; exact for every M, derived by expanding the LOO sum):
    antithetic (M/2 directions):  2V/M
    LOO-ROLL (M directions):      V/M + V_dense/(M(M−1)),   V_dense = (d+1)‖G‖²
so the LOO / antithetic ratio is 1/2 + V_dense/(2V(M−1)) → 1/2.

Shape letters (see `esroll`): M population members, E directions, L layers, R rank.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from esroll.config import ESConfig
from esroll.es import estimators, noise, strategy
from esroll.models import LowRank

Array = jax.Array


def per_sample_mse(cfg: ESConfig, params: dict, grad: dict) -> tuple[Array, Array]:
    """(V at cfg.rank, V_dense) for gradient `grad` restricted to the leaves cfg perturbs."""
    flat_g = noise.flatten(grad)
    dim, sq, excess = 0, 0.0, 0.0
    for path, kind in strategy.leaf_kinds(cfg, params).items():
        g = flat_g[path].astype(jnp.float32)
        g = g if noise.is_stacked(path) else g[None]  # [units, ...]
        dim += g.size
        sq += jnp.sum(g**2)
        if kind == noise.LOWRANK:
            m, n = g.shape[1:]
            excess += 2 * (m + n + 1) / cfg.rank * jnp.sum(g**2)
    v_dense = (dim + 1) * sq
    return v_dense + excess, v_dense


def estimator_mse(method: str, population: int, v: Array, v_dense: Array) -> Array:
    """Predicted E‖ĝ − G‖² of the full estimator at `population` evaluations (affine model, raw fitness): the
    estimator's own prediction (`Estimator.mse`; antithetic 2V/M, LOO-ROLL V/M + V_dense/(M(M−1)))."""
    mse = estimators.ESTIMATORS.lookup(method).mse
    if mse is None:
        raise ValueError(f"ES estimator {method!r} declares no predicted error (Estimator.mse)")
    return mse(population, v, v_dense)


def affine_fitness(grad: dict, deltas: dict) -> Array:
    """⟨G, δ_i⟩ per member, from member-level deltas without forming them: the affine model's J(θ+δ_i) − J(θ)."""
    flat_g = noise.flatten(grad)
    total = 0.0
    for path, d in noise.flatten(deltas).items():
        g = flat_g[path].astype(jnp.float32)
        stacked = noise.is_stacked(path)
        if isinstance(d, LowRank):
            spec = "lmir,lio,lmor->m" if stacked else "mir,io,mor->m"
            total = total + jnp.einsum(spec, d.a.astype(jnp.float32), g, d.b.astype(jnp.float32))
        else:
            total = total + jnp.einsum("lmd,ld->m" if stacked else "md,d->m", d.astype(jnp.float32), g)
    return total


def inner_and_sqnorm(factors: dict, grad: dict, rank: int) -> dict[str, tuple[Array, Array]]:
    """Per unit and direction, from unscaled factors without forming E: (⟨G_u, E_k⟩, ‖E_k‖²), each [L, E] or [E].

    The per-sample squared error of one unit is then X²‖E‖² − 2X² + ‖G‖² (under the affine model).
    """
    flat_g = noise.flatten(grad)
    out = {}
    for path, f in noise.flatten(factors).items():
        g = flat_g[path].astype(jnp.float32)
        lead = "l" if noise.is_stacked(path) else ""
        if isinstance(f, LowRank):
            x = jnp.einsum(f"{lead}eir,{lead}io,{lead}eor->{lead}e", f.a, g, f.b) / jnp.sqrt(rank)
            gram_a = jnp.einsum(f"{lead}eir,{lead}eis->{lead}ers", f.a, f.a)
            gram_b = jnp.einsum(f"{lead}eor,{lead}eos->{lead}ers", f.b, f.b)
            out[path] = (x, jnp.sum(gram_a * gram_b, (-2, -1)) / rank)  # ‖ABᵀ‖² = tr(AᵀA·BᵀB)
        else:
            out[path] = (jnp.einsum(f"{lead}ed,{lead}d->{lead}e", f, g), jnp.sum(f**2, -1))
    return out


def materialize(params: dict, deltas: dict) -> dict:
    """Every member's parameters [M, *shape] built explicitly (small models and checks only)."""
    flat_d = noise.flatten(deltas)
    path0, d0 = next(iter(flat_d.items()))
    M = jax.tree.leaves(d0)[0].shape[1 if noise.is_stacked(path0) else 0]
    out = {}
    for path, p in noise.flatten(params).items():
        d = flat_d.get(path)
        stacked = noise.is_stacked(path)
        if d is None:
            delta = jnp.zeros((M,) + p.shape, p.dtype)
        elif isinstance(d, LowRank):
            delta = jnp.einsum("lmir,lmor->mlio" if stacked else "mir,mor->mio", d.a, d.b)
        else:
            delta = jnp.moveaxis(d, 1, 0) if stacked else d
        out[path] = p[None] + delta.astype(p.dtype)
    return noise.unflatten(out)


def sample_estimates(
    cfg: ESConfig,
    params: dict,
    fitness_fn: Callable[[dict], Array],
    key: Array,
    steps: int,
    reduce_fn: Callable[[dict], Array | dict] = lambda g: g,
):
    """reduce_fn(ĝ) for `steps` independent steps (the step index draws fresh noise); fitness_fn(deltas) -> [M]."""

    def one(step):
        fitness_M = fitness_fn(strategy.member_deltas(cfg, key, step, params))
        grad, _ = strategy.estimate(cfg, key, step, params, fitness_M)
        return reduce_fn(grad)

    return jax.lax.map(one, jnp.arange(steps))
