"""esroll.diagnostics: split-half figures on hand-computed vectors, the ES halves, the ES estimate's cosine with a
given gradient (sign and value), and the split-half SNR against its Monte-Carlo value on problems with a known
gradient; effective ranks against a dense SVD.

Monte-Carlo checks compare two estimates within Z standard errors of their difference, at fixed seeds and sample
sizes (as tests/es/test_es_theory.py does).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from esroll import diagnostics, es
from esroll.es import diagnostics as es_diagnostics
from esroll.es import estimators, noise, strategy, theory
from esroll.models import ModelConfig, param_shapes

Z = 5.0


# ---------------------------------------------------------------- figures on constructed vectors


def test_split_half_figures_by_hand():
    """g1 = (3, 4), g2 = (4, 3), split over two leaves: ⟨g1,g2⟩ = 24, ‖g1−g2‖² = 2, so snr = 24 / (2/4) = 48."""
    g1 = {"a": jnp.array([3.0]), "b": {"c": jnp.array([[4.0]])}}
    g2 = {"a": jnp.array([4.0]), "b": {"c": jnp.array([[3.0]])}}
    d = diagnostics.split_half(g1, g2)
    expected = {
        "cosine": 24 / 25,
        "snr": 48.0,
        "signal": 24.0,
        "noise": 0.5,
        "norm1": 5.0,
        "norm2": 5.0,
        "norm": 3.5 * math.sqrt(2),
    }
    for name, value in expected.items():
        assert np.isclose(d[name], value, rtol=1e-6), name
    assert np.isclose(diagnostics.cosine(g1, g2), 24 / 25, rtol=1e-6)
    assert np.isclose(diagnostics.cosine(g1, jax.tree.map(lambda x: -2 * x, g1)), -1.0, rtol=1e-6)
    assert np.isnan(diagnostics.cosine(g1, jax.tree.map(jnp.zeros_like, g1)))  # undefined, not 0
    # Opposite halves: negative signal; equal halves: no noise, snr undefined.
    assert diagnostics.split_half(g1, jax.tree.map(jnp.negative, g1))["signal"] < 0
    assert np.isnan(diagnostics.split_half(g1, g1)["snr"])
    with pytest.raises(ValueError, match="different leaves"):
        diagnostics.split_half(g1, {"a": g1["a"]})


def test_split_half_by_group_adds_up():
    """Per group: its own figures; "total": signal and noise summed over groups, snr their ratio."""
    g1 = {"layers": {"q": jnp.array([[1.0, 2.0]]), "gate": jnp.array([[2.0]]), "attn_norm": jnp.array([1.0])}}
    g2 = {"layers": {"q": jnp.array([[1.0, 0.0]]), "gate": jnp.array([[-2.0]]), "attn_norm": jnp.array([3.0])}}
    d = diagnostics.split_half_by_group(g1, g2)
    assert set(d) == {"attention", "mlp", "norm", "total"}
    # attention: dot 1, diff (0, 2) -> noise 1; mlp: dot −4, noise 4; norm: dot 3, noise 1.
    for group, (signal, noise_) in {"attention": (1, 1), "mlp": (-4, 4), "norm": (3, 1), "total": (0, 6)}.items():
        assert np.isclose(d[group]["signal"], signal) and np.isclose(d[group]["noise"], noise_), group
    assert np.isclose(d["mlp"]["snr"], -1.0) and np.isclose(d["mlp"]["cosine"], -1.0)
    assert np.isclose(d["total"]["cosine"], 0.0, atol=1e-7)
    flat = {"layers/q": g1["layers"]["q"], "layers/gate": g1["layers"]["gate"]}  # flat {path: leaf} dicts too
    assert set(diagnostics.split_half_by_group(flat, flat)) == {"attention", "mlp", "total"}


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_every_model_leaf_has_a_group(family):
    cfg = ModelConfig(
        family=family, vocab_size=11, hidden_size=8, intermediate_size=12, num_layers=2, num_heads=2,
        num_kv_heads=1, head_dim=4, qkv_bias=family == "qwen2", o_bias=family == "llama", qk_norm=family == "qwen3",
    )  # fmt: skip
    groups = {p: diagnostics.leaf_group(p) for p in noise.flatten(param_shapes(cfg))}
    assert "other" not in groups.values(), groups
    assert groups["embed"] == groups["lm_head"] == "embed" and groups["final_norm"] == "norm"
    assert groups["layers/q"] == groups["layers/o"] == "attention" and groups["layers/down"] == "mlp"
    if family == "qwen3":
        assert groups["layers/q_norm"] == groups["layers/k_norm"] == "norm"
    if family == "qwen2":
        assert groups["layers/v_bias"] == "attention"
    assert diagnostics.leaf_group("w") == "other"


# ---------------------------------------------------------------- the ES halves


def test_half_weights_by_hand():
    """Population 8, σ = 0.5. EGGROLL: pairs (0,1), (4,5) form half 0, each weight (f⁺−f⁻)/(4σ); LOO-ROLL: members
    0, 2, 4, 6 form half 0, weights (f_i − their mean)/(3σ)."""
    f = jnp.array([5.0, 1.0, 2.0, 0.0, 3.0, 7.0, 4.0, 4.0])
    sigma = 0.5
    w1, w2 = es_diagnostics.half_weights("eggroll", f, sigma)
    np.testing.assert_allclose(w1.w_E, [4 / 2, 0, -4 / 2, 0], rtol=1e-6)
    np.testing.assert_allclose(w2.w_E, [0, 2 / 2, 0, 0 / 2], rtol=1e-6)
    full = estimators.direction_weights("eggroll", f, sigma, "raw").w_E
    np.testing.assert_allclose((w1.w_E + w2.w_E) / 2, full, rtol=1e-6)  # EGGROLL: the halves average to the full
    w1, w2 = es_diagnostics.half_weights("looroll", f, sigma)
    np.testing.assert_allclose(w1.w_E[0::2], (np.array([5, 2, 3, 4]) - 3.5) / 1.5, rtol=1e-6)
    np.testing.assert_allclose(w2.w_E[1::2], (np.array([1, 0, 7, 4]) - 3.0) / 1.5, rtol=1e-6)
    assert np.all(w1.w_E[1::2] == 0) and np.all(w2.w_E[0::2] == 0)
    # A non-finite member drops its pair in its own half only.
    w1, w2 = es_diagnostics.half_weights("eggroll", f.at[5].set(jnp.nan), sigma)
    np.testing.assert_allclose(w1.w_E, [4 / (2 * sigma), 0, 0, 0], rtol=1e-6)  # one pair left in half 0: M' = 2
    assert int(w1.num_dropped) == 2 and int(w2.num_dropped) == 0 and not w1.skipped
    with pytest.raises(ValueError, match="even"):
        es_diagnostics.half_of_direction("eggroll", 6)  # 3 pairs
    with pytest.raises(ValueError, match="at least 4"):
        es_diagnostics.half_of_direction("looroll", 2)


def test_half_estimates_compose_to_the_full_eggroll_estimate():
    """On the library's factor layout (a stacked and a single matrix, a dense vector), chunked: each half is
    `weighted_sum` of its weights, and for EGGROLL (ĝ₁+ĝ₂)/2 is `strategy.estimate`."""
    params = {"w": jnp.zeros((5, 3)), "v": jnp.zeros(4), "layers": {"q": jnp.zeros((2, 4, 3))}}
    cfg = es.ESConfig(
        method="eggroll", population=12, rank=2, sigma=0.3, shaping="raw", chunk_size=2, dense_patterns=("v",)
    )
    key, f = jax.random.key(3), jnp.asarray(np.random.default_rng(0).normal(size=12), jnp.float32)

    @jax.jit
    def run(f):
        h = es_diagnostics.half_estimates(cfg, key, 0, params, f)
        g, _ = strategy.estimate(cfg, key, 0, params, f)
        factors_fn = lambda d: strategy.step_factors(cfg, key, 0, params, d)
        g1 = estimators.weighted_sum(factors_fn, h.w1.w_E, cfg.rank)  # all directions, the other half's weighted 0
        return h, noise.flatten(g), g1

    h, g, g1 = run(f)
    assert set(h.g1) == {"w", "v", "layers/q"}
    for path in h.g1:
        np.testing.assert_allclose(h.g1[path], g1[path], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose((h.g1[path] + h.g2[path]) / 2, g[path], rtol=1e-5, atol=1e-6)
        assert np.abs(h.g1[path] - h.g2[path]).max() > 1e-3


# ---------------------------------------------------------------- the ES estimate against a given gradient


@pytest.mark.parametrize("method", ["eggroll", "looroll"])
def test_pg_cosine_has_the_sign_and_value_of_the_true_gradient(method):
    """`step_diagnostics`' diag_pg_cosine as the trainer computes it (jitted, the step's key, step and fitness), on
    J(θ) = ⟨G, θ⟩, whose gradient is G, each member scored at its parameters θ_i built explicitly. Both estimators
    are a positive multiple of Σ_i (f_i − f̄)(θ_i − θ) (LOO-ROLL: 1/((M−1)σ²); EGGROLL: 1/(Mσ²), the f̄ term
    cancelling within each pair), so against ±G the cosine, in total and per leaf group, is ± that sum's cosine with
    G: clearly positive against the true gradient, negative against its opposite. A sign flipped in the perturbation,
    the estimator's weights or sum, or the cosine's inputs changes the sign of one of them."""
    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.normal(size=(4, 2)), jnp.float32),
        "layers": {
            "q": jnp.asarray(rng.normal(size=(2, 3, 2)), jnp.float32),
            "gate": jnp.asarray(rng.normal(size=(2, 2, 3)), jnp.float32),
        },
    }
    G = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
    cfg = es.ESConfig(method=method, population=64, rank=1, sigma=0.5, shaping="raw")
    key, step = jax.random.key(5), 3
    flat_params, flat_G = noise.flatten(params), noise.flatten(G)

    @jax.jit  # one program (eagerly, each operation would be compiled on its own)
    def members(params, flat_G):
        theta_M = noise.flatten(theory.materialize(params, strategy.member_deltas(cfg, key, step, params)))  # [M, ...]
        return theta_M, sum(jnp.einsum("m...,...->m", theta_M[p], g) for p, g in flat_G.items())  # J(θ_i) = ⟨G, θ_i⟩

    theta_M, fitness_M = members(params, flat_G)
    # The estimate rebuilt by hand from the members' parameters and fitness, and its cosine with G over some leaves.
    f = np.asarray(fitness_M, np.float64)
    by_hand = {
        p: np.einsum("m,m...->...", f - f.mean(), np.asarray(theta_M[p] - flat_params[p][None], np.float64))
        for p in flat_G
    }

    def cos(paths):
        dot = sum(np.sum(by_hand[p] * flat_G[p]) for p in paths)
        return dot / np.sqrt(sum(np.sum(by_hand[p] ** 2) for p in paths) * sum(np.sum(flat_G[p] ** 2) for p in paths))

    expected = {
        "diag_pg_cosine": cos(by_hand),
        "diag_pg_cosine_attention": cos(["layers/q"]),
        "diag_pg_cosine_mlp": cos(["layers/gate"]),
        "diag_pg_cosine_other": cos(["w"]),
    }
    diagnose = jax.jit(functools.partial(es_diagnostics.step_diagnostics, cfg))
    for sign in (1, -1):
        d = diagnose(key, step, params, fitness_M, jax.tree.map(lambda g: sign * g, G))
        for name, value in expected.items():
            assert np.isclose(d[name], sign * value, rtol=1e-4, atol=1e-5), (name, sign)
    assert expected["diag_pg_cosine"] > 0.5  # SNR about K/D ≈ 1–2 here (K = 32 or 64 directions, D = 32 weights)
    assert all(value > 0 for value in expected.values())


# ---------------------------------------------------------------- split-half SNR against Monte Carlo


class Quadratic:
    """J(θ) = ½⟨w, H w⟩ + ⟨c, w⟩ on one matrix leaf: LOO-ROLL is unbiased for ∇J at any σ (docs/theory.md 1), and
    the curvature adds noise the affine model does not have. Hashable, for a static argument."""

    def __init__(self, m, n, seed=0):
        rng = np.random.default_rng(seed)
        h = rng.normal(size=(m * n, m * n)) / np.sqrt(m * n)
        self.H, self.C, self.W = (h + h.T) / 2, rng.normal(size=(m, n)), rng.normal(size=(m, n))
        self.grad = {"w": (self.H @ self.W.reshape(-1)).reshape(m, n) + self.C}

    def __call__(self, deltas):
        w = theory.materialize({"w": jnp.asarray(self.W, jnp.float32)}, deltas)["w"]
        v = w.reshape(w.shape[0], -1)
        return 0.5 * jnp.sum(v * (v @ jnp.asarray(self.H, jnp.float32)), -1) + jnp.sum(w * self.C, (1, 2))


def _affine_problem():
    params = {"w": jnp.zeros((4, 2)), "layers": {"q": jnp.zeros((2, 3, 2))}}
    rng = np.random.default_rng(0)
    grad = jax.tree.map(lambda p: np.asarray(rng.normal(size=p.shape), np.float32), params)
    return params, grad, functools.partial(theory.affine_fitness, jax.tree.map(jnp.asarray, grad))


@functools.partial(jax.jit, static_argnums=(0, 2, 4))
def _draws(cfg, params, fitness_fn, grad, steps):
    """Per step: split-half signal and noise (key 1), and the squared errors of the full estimate and of
    (ĝ₁+ĝ₂)/2 about the known gradient at independent steps (key 2)."""
    flat_grad = noise.flatten(grad)

    def sq_error(g):
        return sum(jnp.sum((g[p] - x) ** 2) for p, x in flat_grad.items())

    def one(step):
        key = jax.random.key(1)
        h = es_diagnostics.half_estimates(
            cfg, key, step, params, fitness_fn(strategy.member_deltas(cfg, key, step, params))
        )
        d = diagnostics.split_half(h.g1, h.g2)
        key = jax.random.key(2)
        f = fitness_fn(strategy.member_deltas(cfg, key, step, params))
        full, _ = strategy.estimate(cfg, key, step, params, f)
        h = es_diagnostics.half_estimates(cfg, key, step, params, f)
        mean = {p: (h.g1[p] + h.g2[p]) / 2 for p in h.g1}
        return d["signal"], d["noise"], sq_error(noise.flatten(full)), sq_error(mean)

    return jax.lax.map(one, jnp.arange(steps), batch_size=1000)  # vectorised 1000 steps at a time: the same draws


@pytest.mark.parametrize(
    "method, population, problem",
    [("eggroll", 16, "affine"), ("looroll", 8, "affine"), ("looroll", 16, "quadratic")],
)
def test_split_half_snr_matches_monte_carlo(method, population, problem):
    """The split-half SNR of (ĝ₁+ĝ₂)/2, averaged over steps as Σ signal / Σ noise (a ratio of means: the mean of the
    per-step ratios is biased upward by the noise in its denominator, and heavy-tailed), equals ‖μ‖² / tr Cov from
    independent steps, μ being the known gradient (both estimators are unbiased here) and tr Cov the mean squared
    error about it. Under the affine model both also equal the closed forms: 2V/M for EGGROLL (whose halves average
    to the full estimate); for LOO-ROLL V/M + 2V_dense/(M(M−2)), above the full estimate's V/M + V_dense/(M(M−1)).
    """
    steps = 8000
    if problem == "affine":
        params, grad, fitness_fn = _affine_problem()
    else:
        J = Quadratic(3, 3)
        params, grad, fitness_fn = {"w": jnp.asarray(J.W, jnp.float32)}, J.grad, J
    cfg = es.ESConfig(method=method, population=population, rank=1, sigma=0.5, shaping="raw")
    signal, noise_, sq_full, sq_split = map(np.asarray, _draws(cfg, params, fitness_fn, grad, steps))
    sq_mu = sum(float(np.sum(np.square(g))) for g in jax.tree.leaves(grad))

    snr = signal.mean() / noise_.mean()  # the delta method's standard error of a ratio of means
    snr_se = np.std(signal - snr * noise_, ddof=1) / np.sqrt(steps) / noise_.mean()
    mc = sq_mu / sq_split.mean()
    mc_se = mc * sq_split.std(ddof=1) / np.sqrt(steps) / sq_split.mean()
    gap_se = np.hypot(snr_se, mc_se)
    assert snr_se < 0.05 * snr and mc_se < 0.05 * mc, "too few steps to test anything"
    assert abs(snr - mc) < Z * gap_se, f"split-half {snr:.4f} ± {snr_se:.4f}, Monte Carlo {mc:.4f} ± {mc_se:.4f}"
    per_step = signal / noise_
    assert per_step.mean() - mc > Z * np.hypot(per_step.std(ddof=1) / np.sqrt(steps), mc_se)  # why Σ/Σ

    if problem == "affine":
        v, v_dense = (float(x) for x in theory.per_sample_mse(cfg, params, grad))
        M = population
        full = float(theory.estimator_mse(method, M, v, v_dense))
        split = full if method == "eggroll" else v / M + 2 * v_dense / (M * (M - 2))
        assert abs(mc - sq_mu / split) < Z * mc_se, (
            f"Monte Carlo {mc:.4f} ± {mc_se:.4f}, closed form {sq_mu / split:.4f}"
        )
        # The split mean's noise against the full estimate's, paired on the same steps.
        ratio = sq_split.mean() / sq_full.mean()
        ratio_se = np.std(sq_split - ratio * sq_full, ddof=1) / np.sqrt(steps) / sq_full.mean()
        if method == "eggroll":
            np.testing.assert_allclose(sq_split, sq_full, rtol=1e-4)
        else:
            assert abs(ratio - split / full) < Z * ratio_se, f"ratio {ratio:.4f} ± {ratio_se:.4f} vs {split / full:.4f}"
            assert ratio - 1 > Z * ratio_se and ratio <= (M - 1) / (M - 2)


# ---------------------------------------------------------------- effective rank


def test_effective_rank_by_hand():
    """diag(1, 1, 1, 0): both ranks 3. diag(2, 1): p = (2/3, 1/3), entropy rank exp(H(p)), participation 9/5."""
    effective_rank = jax.jit(diagnostics.effective_rank)  # one program per shape, not one per operation
    r = effective_rank(np.diag(np.array([1.0, 1.0, 1.0, 0.0], np.float32)))
    assert np.isclose(r["entropy"], 3, rtol=1e-5) and np.isclose(r["participation"], 3, rtol=1e-5)
    p = np.array([2, 1]) / 3
    r = effective_rank(np.array([[0.0, 2.0, 0.0], [1.0, 0.0, 0.0]], np.float32))
    assert np.isclose(r["entropy"], np.exp(-(p * np.log(p)).sum()), rtol=1e-5)
    assert np.isclose(r["participation"], 9 / 5, rtol=1e-5)
    r = effective_rank(np.zeros((2, 3, 3), np.float32))  # batched; a zero matrix has rank 0
    np.testing.assert_array_equal(r["entropy"], [0, 0])
    np.testing.assert_array_equal(r["participation"], [0, 0])


@pytest.mark.parametrize("directions, rank", [(3, 2), (12, 3)])  # E·r below and above min(m, n) = 7
def test_lowrank_effective_rank_equals_dense(directions, rank):
    """On the library's factors (a layer-stacked 9×7 leaf and a single 7×10 one) and a weighted update: the QR-core
    figures equal the dense SVD's of `estimators.weighted_sum`'s update (which carries 1/√r), layer by layer."""
    params = {"a": jnp.zeros((7, 10)), "layers": {"b": jnp.zeros((2, 9, 7))}}
    cfg = es.ESConfig(method="looroll", population=directions, rank=rank, sigma=0.1)
    w_E = jnp.asarray(np.random.default_rng(1).normal(size=directions) * np.geomspace(1, 0.05, directions))

    @jax.jit
    def run(w_E):
        factors = strategy.step_factors(cfg, jax.random.key(0), 0, params, jnp.arange(directions))
        update = estimators.weighted_sum(
            lambda d: strategy.step_factors(cfg, jax.random.key(0), 0, params, d), w_E, rank
        )
        f = factors["layers"]["b"]
        s = diagnostics.lowrank_singular_values(f.a, w_E, f.b) / math.sqrt(rank)
        dense_s = jnp.linalg.svd(update["layers/b"], compute_uv=False)
        dense = {path: diagnostics.effective_rank(u) for path, u in update.items()}
        return es_diagnostics.update_effective_ranks(factors, w_E), dense, s, dense_s

    low, dense, s, dense_s = run(w_E)
    assert s.shape == (2, min(7, directions * rank)) and np.all(np.diff(s, axis=-1) <= 1e-6)
    np.testing.assert_allclose(s, dense_s[:, : s.shape[-1]], rtol=1e-4, atol=1e-5 * float(dense_s.max()))
    assert low["layers/b"]["entropy"].shape == (2,) and low["a"]["entropy"].shape == ()
    for path in ("a", "layers/b"):
        for kind in ("entropy", "participation"):
            np.testing.assert_allclose(low[path][kind], dense[path][kind], rtol=1e-4)
    assert 1 < float(low["a"]["entropy"]) < min(7, directions * rank)
