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


def _group(teacher, old, mask, rewards):
    from esroll.grpo.advantages import Group

    return Group(
        np.asarray(rewards, np.float64), token_logp=np.asarray(old), token_mask=np.asarray(mask, bool),
        teacher_logp=np.asarray(teacher),
    )  # fmt: skip


def test_the_registered_distillation_estimators_by_hand():
    """One prompt, two completions: log π_old = −1, −2 | −0.5, (pad); log π_T = −0.5, −3 | −2, (pad); rewards 1, 0.
    opd: 0.5, −1 | −1.5. With reward_weight 0.5, GRPO's advantages ±0.5/(√½ + 1e-4) (sample std of 1 and 0) add
    ±0.5·0.70700 to every token of each completion. opd_plus at reverse KL: −(log u + 1) = opd − 1; at forward KL
    (exact) 1/u = π_T/π_old: e^0.5, e^−1 | e^−1.5; its stop-gradient weight −f(u)/u = log(u)/u: −0.5·e^0.5, 1/e,
    1.5·e^−1.5. gndpo: the opd ratios 0.5, −1, −1.5 whitened: mean −2/3, deviations 7/6, −1/3, −5/6, Bessel variance
    (49/36 + 4/36 + 25/36)/2 = 13/12."""
    from esroll.grpo.advantages import estimate
    from esroll.grpo.estimators.distill import GndpoOptions, OpdOptions, OpdPlusOptions

    old = [[[-1.0, -2.0], [-0.5, 0.0]]]
    teacher = [[[-0.5, -3.0], [-2.0, 0.0]]]
    mask = [[[1, 1], [1, 0]]]
    g = _group(teacher, old, mask, [[1.0, 0.0]])
    opd = [[[0.5, -1.0], [-1.5, 0.0]]]
    np.testing.assert_allclose(estimate("opd", g, OpdOptions()).advantage, opd, atol=1e-6)
    a = 0.5 / (np.sqrt(0.5) + 1e-4)
    mixed = estimate("opd", g, OpdOptions(reward_weight=0.5)).advantage
    np.testing.assert_allclose(mixed, [[[0.5 + a / 2, -1 + a / 2], [-1.5 - a / 2, 0.0]]], atol=1e-5)
    rkl = estimate("opd_plus", g, OpdPlusOptions()).advantage
    np.testing.assert_allclose(rkl, [[[-0.5, -2.0], [-2.5, 0.0]]], atol=1e-6)
    fkl = estimate("opd_plus", g, OpdPlusOptions(divergence="forward_kl")).advantage
    np.testing.assert_allclose(fkl[0, 0], [np.exp(0.5), np.exp(-1)], rtol=1e-6)
    np.testing.assert_allclose(fkl[0, 1], [np.exp(-1.5), 0.0], rtol=1e-6)
    stop = estimate("opd_plus", g, OpdPlusOptions(divergence="forward_kl", exact=False)).advantage
    np.testing.assert_allclose(stop[0, 0], [-0.5 * np.exp(0.5), 1 / np.e], rtol=1e-6)
    np.testing.assert_allclose(stop[0, 1], [1.5 * np.exp(-1.5), 0.0], rtol=1e-6)
    sd = np.sqrt(13 / 12)
    gn = estimate("gndpo", g, GndpoOptions()).advantage
    np.testing.assert_allclose(gn, [[[7 / 6 / sd, -1 / 3 / sd], [-5 / 6 / sd, 0.0]]], atol=1e-6)
    assert estimate("opd", g, OpdOptions()).metrics["teacher_log_ratio"] == pytest.approx(-2 / 3)
    invalid = _group(teacher, old, mask, [[1.0, np.nan]])  # an invalid completion gets 0 on every token
    assert not estimate("opd", invalid, OpdOptions()).advantage[0, 1].any()
    with pytest.raises(ValueError, match="divergence"):
        OpdPlusOptions(divergence="hellinger")


def test_the_teacher_is_read_only_where_an_estimator_needs_it():
    """`teacher.path` is an unread key for plain GRPO and ES; a distillation estimator without it is refused in one
    line naming it; every configs/distill.py variant builds with the shipped teacher."""
    import importlib

    from configs import distill
    from esroll.config import ConfigError, from_config_dict
    from esroll.experiment import check_names, unread_keys

    for method in ("grpo", "looroll"):
        assert "teacher.path" in unread_keys(from_config_dict({"method": method, "teacher": {"path": "t"}}))
    cfg = from_config_dict({"method": "grpo", "grpo": {"advantage": "opd"}, "teacher": {"path": "t"}})
    assert "teacher.path" not in unread_keys(cfg)
    with pytest.raises(ConfigError, match=r"teacher\.path"):
        check_names(from_config_dict({"method": "grpo", "grpo": {"advantage": "gndpo"}}))
    for name in distill.METHODS:
        cd = importlib.reload(distill).get_config(f"quick,{name}")
        cfg = check_names(from_config_dict(cd.to_dict()))
        assert cfg.grpo.advantage == name and cfg.teacher.path == distill.TEACHER
    with pytest.raises(ValueError, match="configs/distill.py"):
        distill.get_config("opd,gndpo")


@pytest.mark.e2e
def test_opd_trains_from_the_shipped_teacher(tmp_path):
    """configs/distill.py:quick,opd: two steps that read the teacher's log-probabilities of the student's samples and
    log their mean log-ratio (negative: the student's samples are likelier under the student)."""
    from conftest import REPO
    from configs import distill
    from esroll.config import from_config_dict
    from esroll.experiment import check_names
    from esroll.metrics import read_metrics
    from esroll.train import train_and_evaluate

    cd = distill.get_config("quick,opd")
    cd.model.path = str(REPO / cd.model.path)
    cd.teacher.path = str(REPO / cd.teacher.path)
    train_and_evaluate(check_names(from_config_dict(cd.to_dict())), tmp_path, progress=False)
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "teacher_log_ratio" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["teacher_log_ratio"] < 0 for r in steps)
