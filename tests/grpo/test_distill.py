"""The teacher's token signals (`esroll.grpo.distill`): OPD's and GNDPO's advantages on hand-built tokens, and OPD+'s
exact score-function weight against the exact gradient of each f-divergence on a categorical toy over a whole
vocabulary (by autodiff), with the stop-gradient weight biased except for reverse KL."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from esroll.grpo.distill import DIVERGENCES, f_value, f_weight, gndpo_advantage, opd_advantage


def test_opd_advantage_by_hand():
    """log π_S = −1, −2, (−7 off the mask); log π_T = −0.5, −3, 0: advantages 0.5, −1, 0."""
    adv = opd_advantage(np.array([[-1.0, -2.0, -7.0]]), np.array([[-0.5, -3.0, 0.0]]), np.array([[1, 1, 0]], bool))
    np.testing.assert_allclose(adv, [[0.5, -1.0, 0.0]])


def test_gndpo_advantage_by_hand_and_its_shift_invariance():
    """log π_T − log π_old = 0.5, −1, −9 (clipped to −5), and an off-mask token. Mean −11/6; deviations 7/3, 5/6,
    −19/6; Bessel variance (49/9 + 25/36 + 361/36) / 2 = 97/12; so 0.82068, 0.29310, −1.11378."""
    teacher = np.array([[-1.0, -2.0, -10.0, 0.0]])
    old = np.array([[-1.5, -1.0, -1.0, -2.0]])
    mask = np.array([[1, 1, 1, 0]], bool)
    sd = np.sqrt(97 / 12)
    np.testing.assert_allclose(
        gndpo_advantage(teacher, old, mask), [[7 / 3 / sd, 5 / 6 / sd, -19 / 6 / sd, 0]], atol=1e-6
    )
    unclipped = np.array([[True, True, False, False]])  # without the clipped token, a shift of the teacher cancels
    np.testing.assert_allclose(
        gndpo_advantage(teacher + 1.7, old, unclipped), gndpo_advantage(teacher, old, unclipped), atol=1e-9
    )


def toy(seed: int = 0, V: int = 6):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=V)), jnp.asarray(jax.nn.log_softmax(rng.normal(size=V) * 1.5))


def exact_gradient(name: str, theta, log_teacher):
    """∇_θ Σ_y π_T(y)·f(π_θ(y)/π_T(y)), by autodiff through jnp versions of f (written here, apart from the module)."""
    fs = {
        "reverse_kl": lambda u: u * jnp.log(u),
        "forward_kl": lambda u: -jnp.log(u),
        "js": lambda u: 0.5 * (u * jnp.log(u) - (u + 1) * jnp.log((u + 1) / 2)),
        "alpha": lambda u: (u**0.5 - 1 - 0.5 * (u - 1)) / (0.5 * -0.5),
    }

    def divergence(t):
        u = jnp.exp(jax.nn.log_softmax(t) - log_teacher)
        return jnp.sum(jnp.exp(log_teacher) * fs[name](u))

    return np.asarray(jax.grad(divergence)(theta))


def score_estimate(weight_V, theta):
    """E_{y ~ π_θ}[w(y)·∇_θ log π_θ(y)], summed exactly over the vocabulary."""
    p = np.asarray(jax.nn.softmax(theta), np.float64)
    scores = np.eye(len(p)) - p[None, :]  # row y: ∇_θ log softmax(θ)_y = e_y − π_θ
    return (p[:, None] * weight_V[:, None] * scores).sum(0)


@pytest.mark.parametrize("name", DIVERGENCES)
def test_the_exact_weight_gives_each_divergences_gradient_and_the_stop_gradient_one_only_reverse_kls(name):
    theta, log_teacher = toy()
    log_u = np.asarray(jax.nn.log_softmax(theta) - log_teacher, np.float64)
    grad = exact_gradient(name, theta, log_teacher)  # float32 autodiff
    exact = score_estimate(f_weight(name, log_u, exact=True), theta)
    stop = score_estimate(f_weight(name, log_u, exact=False), theta)
    np.testing.assert_allclose(exact, grad, atol=1e-5)
    if name == "reverse_kl":  # f'(u) = f(u)/u + 1: a constant apart, whose expected score is 0
        np.testing.assert_allclose(stop, grad, atol=1e-5)
        np.testing.assert_allclose(f_weight(name, log_u) - f_weight(name, log_u, exact=False), 1.0)
    elif name in ("forward_kl", "js"):
        assert np.abs(stop - grad).max() > 1e-2, (stop, grad)


def test_the_exact_weight_by_sampling_is_unbiased():
    """200,000 samples of y ~ π_θ, the mean of f'(u)·∇ log π_θ(y): within 0.01 of forward KL's exact gradient (its
    entries' standard errors are below 0.003 here); the stop-gradient mean stays off it."""
    theta, log_teacher = toy(1)
    p = np.asarray(jax.nn.softmax(theta), np.float64)
    log_u = np.asarray(jax.nn.log_softmax(theta) - log_teacher, np.float64)
    scores = np.eye(len(p)) - p[None, :]
    ys = np.random.default_rng(0).choice(len(p), size=200_000, p=p / p.sum())
    grad = exact_gradient("forward_kl", theta, log_teacher)
    sampled = (f_weight("forward_kl", log_u)[ys][:, None] * scores[ys]).mean(0)
    np.testing.assert_allclose(sampled, grad, atol=0.01)
    stop = (f_weight("forward_kl", log_u, exact=False)[ys][:, None] * scores[ys]).mean(0)
    assert np.abs(stop - grad).max() > 0.05


def test_f_is_zero_at_one_and_convex():
    u = np.linspace(0.05, 5, 400)
    for name in DIVERGENCES:
        assert f_value(name, np.array([1.0]))[0] == pytest.approx(0.0, abs=1e-12), name
        assert (np.diff(f_value(name, u), 2) > -1e-12).all(), name
