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
        assert cfg.teacher.path == distill.TEACHER and "teacher.path" not in unread_keys(cfg)
        if name in distill.ES_TEACHER:
            assert cfg.method == distill.ES_TEACHER[name] and cfg.es.teacher_weight == 1.0
        else:
            assert cfg.grpo.advantage == name
    with pytest.raises(ConfigError, match=r"teacher\.path"):
        check_names(from_config_dict({"method": "looroll", "es": {"teacher_weight": 0.5}}))
    with pytest.raises(ConfigError, match=r"teacher_fitness"):
        from_config_dict({"method": "looroll", "es": {"teacher_fitness": "kl"}})
    assert "es.teacher_fitness" in unread_keys(from_config_dict({"method": "looroll"}))
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


def test_es_teacher_scores_by_hand():
    """Rows of log π_T = −1, −2, −3 and log π = −0.5, −1, −9 with 2, 3 and 0 tokens: log_ratio (−0.5 − 1)/2 = −0.75,
    (−0.5 − 1 + 6)/3 = 1.5, 0; log_likelihood −1.5, −2, 0."""
    from esroll.es.method import teacher_scores

    teacher = np.tile([[-1.0, -2.0, -3.0]], (3, 1))
    student = np.tile([[-0.5, -1.0, -9.0]], (3, 1))
    length = np.array([2, 3, 0])
    np.testing.assert_allclose(teacher_scores(teacher, student, length, "log_ratio"), [-0.75, 1.5, 0.0])
    np.testing.assert_allclose(teacher_scores(teacher, student, length, "log_likelihood"), [-1.5, -2.0, 0.0])


@pytest.mark.e2e
def test_an_es_step_with_the_teacher_fitness():
    """One LOO-ROLL step from one state on the same prompts and sampling keys, with the verifier's reward alone, half
    and half with the teacher's log-ratio, and with a "teacher" that is the student itself. The members decode the
    same completions each time; the outcome is the plain step's reward; the mixed reward is (outcome + teacher score) / 2.
    The student's own log-probabilities as the teacher give a log-ratio within the members' perturbation of 0 (a
    teacher forward shifted by a token against the rollout's log-probabilities would not), and the real teacher's
    is clearly below it."""
    from conftest import REPO
    from configs import distill
    from esroll import parallel
    from esroll.config import from_config_dict
    from esroll.data import get_batch, make_splits
    from esroll.es.method import make_es_method
    from esroll.experiment import check_names
    from esroll.task import load_task

    student = str(REPO / "assets" / "tiny-qwen3-steps")
    runs = {"plain": (0.0, distill.TEACHER), "teacher": (0.5, distill.TEACHER), "self": (0.5, student)}
    outputs, mesh, task = {}, parallel.make_mesh(1), None
    for name, (weight, teacher) in runs.items():
        cd = distill.get_config("quick,looroll_teacher")
        cd.model.path = student
        cd.teacher.path = str(REPO / teacher)
        cd.train.temperature = 1.0  # sampled: the teacher and the student then disagree clearly
        cd.es.teacher_weight = weight
        cfg = check_names(from_config_dict(cd.to_dict()))
        train, held_out = make_splits(cfg.data)
        if task is None:
            task, params = load_task(cfg, train, held_out, mesh)
        method = make_es_method(cfg, task, mesh)
        state = method.init(jax.tree.map(np.array, params), jax.random.key(0))
        examples = get_batch(train, cfg.train.prompts_per_step, cfg.data.seed, 0)
        outputs[name] = method.step(jax.tree.map(np.array, params), state, examples, 0)
    plain, mixed, itself = (outputs[k].metrics for k in runs)
    assert "teacher_log_ratio" not in plain and "flops_teacher" not in plain
    assert outputs["plain"].tokens == outputs["teacher"].tokens == outputs["self"].tokens
    assert mixed["outcome_mean"] == plain["reward_mean"] == itself["outcome_mean"]
    assert mixed["reward_mean"] == pytest.approx(0.5 * mixed["outcome_mean"] + 0.5 * mixed["teacher_score_mean"])
    assert mixed["teacher_score_mean"] == mixed["teacher_log_ratio"]
    assert abs(itself["teacher_log_ratio"]) < 0.01 and mixed["teacher_log_ratio"] < -0.05, (itself, mixed)
    assert mixed["flops_teacher"] > 0 and outputs["teacher"].flops > outputs["plain"].flops


def test_generalized_jsd_by_hand():
    """Teacher P = (½, ½), student Q = (0.9, 0.1). β = 0.5: M = (0.7, 0.3), KL(P‖M) = ½ln(5/7) + ½ln(5/3), KL(Q‖M) =
    0.9·ln(9/7) + 0.1·ln(1/3), JSD = their mean ≈ 0.10175. β = 0: KL(P‖Q) = ½ln(5/9) + ½ln 5 ≈ 0.51083. β = 1: KL(Q‖P)
    = 0.9·ln 1.8 + 0.1·ln 0.2 ≈ 0.36806. Near 0 and 1 it approaches β·KL(P‖Q) and (1 − β)·KL(Q‖P)."""
    from esroll.grpo.distill import generalized_jsd

    p, q = np.log([0.5, 0.5]), np.log([0.9, 0.1])
    half = 0.5 * (0.5 * np.log(5 / 7) + 0.5 * np.log(5 / 3)) + 0.5 * (0.9 * np.log(9 / 7) + 0.1 * np.log(1 / 3))
    forward, reverse = 0.5 * np.log(5 / 9) + 0.5 * np.log(5), 0.9 * np.log(1.8) + 0.1 * np.log(0.2)
    assert float(generalized_jsd(p, q, 0.5)) == pytest.approx(half, rel=1e-5)
    assert float(generalized_jsd(p, q, 0.0)) == pytest.approx(forward, rel=1e-5)
    assert float(generalized_jsd(p, q, 1.0)) == pytest.approx(reverse, rel=1e-5)
    assert float(generalized_jsd(p, q, 1e-3)) / 1e-3 == pytest.approx(forward, rel=2e-2)
    assert float(generalized_jsd(p, q, 1 - 1e-3)) / 1e-3 == pytest.approx(reverse, rel=2e-2)
    assert float(generalized_jsd(q, q, 0.3)) == pytest.approx(0.0, abs=1e-7)


def test_gkd_gradient_against_a_cache_free_reference(tmp_path):
    """One GKD minibatch gradient through the trainer's path (the registered "gkd" estimator, token advantages, the
    teacher's hidden states in the batches and its head an argument, the compiled GRPO gradient with chunked
    log-probabilities: N = 7 in chunks of 3) against −∇ of the loss written here from a cache-free forward:
    Σ_t JSD_β(P_t‖Q_t) / (len · B) over the completion tokens, JSD_β = β·Σ P(log P − log M) + (1 − β)·Σ Q(log Q −
    log M), M = βP + (1 − β)Q, β = 0.3, the teacher's P = softmax(h·W) from hidden states h and a head W drawn here
    (computed here in numpy). The advantage is 0 (no reward weight), so the divergence is all the gradient."""
    import types

    from conftest import build_tiny_hf
    from esroll import parallel
    from esroll.config import from_config_dict
    from esroll.experiment import check_names
    from esroll.grpo import advantages
    from esroll.grpo.method import estimator_group, make_batches, token_advantages
    from esroll.grpo.update import make_gradient
    from esroll.models import forward, load_hf
    from test_grpo import scored_rows

    build_tiny_hf("qwen3", tmp_path, initializer_range=0.2)
    cfg, params = load_hf(tmp_path)
    X, M = 2, 2
    prompt, prompt_mask, completion, completion_mask = scored_rows(cfg.vocab_size, rows=X * M)
    B, N = X * M, completion.shape[1]
    length = completion_mask.sum(1)
    rng = np.random.default_rng(5)
    hidden = np.where(completion_mask[..., None], rng.normal(0, 1, (B, N, cfg.hidden_size)), 0.0).astype(np.float32)
    head_key = "embed" if cfg.tie_word_embeddings else "lm_head"
    w = rng.normal(0, 0.5, np.shape(params[head_key])).astype(np.float32)
    logits = hidden.astype(np.float64) @ (w.T if cfg.tie_word_embeddings else w)
    teacher = logits - logits.max(-1, keepdims=True)
    teacher = (teacher - np.log(np.exp(teacher).sum(-1, keepdims=True))).astype(np.float32)
    out = types.SimpleNamespace(
        prompt_BxP=prompt, prompt_mask_BxP=prompt_mask, tokens_BxN=completion, length_B=length,
        logprobs_BxN=np.zeros((B, N), np.float32), loss_mask_BxN=None, turns=None,
    )  # fmt: skip
    run = check_names(from_config_dict({"grpo": {"advantage": "gkd", "beta": 0.0, "group_size": M, "logprob_chunk": 3,
        "adv": {"gkd": {"beta": 0.3}}}, "teacher": {"path": "unused"}}))  # fmt: skip
    g = run.grpo
    needs = advantages.ESTIMATORS.lookup("gkd").needs
    sampled = np.take_along_axis(teacher, completion[..., None], -1)[..., 0]
    group = estimator_group(out, np.array([[1.0, 0.0], [0.0, 1.0]]), completion_mask, None, 0, 0, needs, None, sampled)
    est = advantages.estimate("gkd", group, advantages.options_of(g), None)
    adv = token_advantages("gkd", est.advantage, completion_mask, M)
    assert not adv.any()
    mesh = parallel.make_mesh(1)
    ones = np.ones((B, N), np.float32)
    (batch,) = make_batches(out, completion_mask, adv, ones, g.aggregation, 1, 1, mesh, hidden)
    head = {head_key: jnp.asarray(w)}
    grads, metrics = make_gradient(cfg, g, mesh, None, cfg)(params, None, batch, jnp.asarray(True), teacher_head=head)

    beta = 0.3
    weight = completion_mask / (length[:, None] * B)
    P = jnp.exp(jnp.asarray(teacher))

    def loss(p):
        tokens = jnp.concatenate([prompt, completion], 1)
        mask = jnp.concatenate([prompt_mask, completion_mask], 1)
        logits = forward(cfg, p, tokens, mask_BxT=mask)[0][:, prompt.shape[1] - 1 : -1]
        log_q = jax.nn.log_softmax(logits)
        log_m = jnp.log(beta * P + (1 - beta) * jnp.exp(log_q))
        to_teacher = (P * (jnp.asarray(teacher) - log_m)).sum(-1)
        to_student = (jnp.exp(log_q) * (log_q - log_m)).sum(-1)
        jsd = beta * to_teacher + (1 - beta) * to_student
        return (jnp.asarray(weight, jnp.float32) * jnp.where(completion_mask, jsd, 0.0)).sum(), jsd

    (_, jsd), expected = jax.value_and_grad(loss, has_aux=True)(params)
    largest = max(float(np.abs(x).max()) for x in jax.tree.leaves(expected))
    for x, y in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-4 * largest)
    assert largest > 0
    assert float(metrics["gkd_divergence"]) == pytest.approx(float(jsd[completion_mask].mean()), rel=1e-4)


@pytest.mark.e2e
def test_gkd_trains_on_the_students_samples_and_on_the_datas(tmp_path):
    """configs/distill.py:quick,gkd with every step on the data's worked solutions (student_fraction 0): nothing is
    decoded, the rows are the solutions (each correct: reward 1), and the divergence to the teacher is logged; with
    every step on the student's own samples (1), no `student_data` flag and the student's own reward."""
    from conftest import REPO
    from configs import distill
    from esroll.config import from_config_dict
    from esroll.experiment import check_names
    from esroll.metrics import read_metrics
    from esroll.train import train_and_evaluate

    for fraction in (0.0, 1.0):
        cd = distill.get_config("quick,gkd")
        cd.model.path = str(REPO / cd.model.path)
        cd.teacher.path = str(REPO / cd.teacher.path)
        cd.grpo.adv = {"gkd": {"student_fraction": fraction}}
        workdir = tmp_path / str(fraction)
        train_and_evaluate(check_names(from_config_dict(cd.to_dict())), workdir, progress=False)
        steps = [r for r in read_metrics(workdir / "metrics.jsonl") if "gkd_divergence" in r]
        assert [r["step"] for r in steps] == [1, 2] and all(r["gkd_divergence"] > 0 for r in steps)
        if fraction == 0.0:
            assert all(r["student_data"] == 0.0 and r["reward_mean"] == 1.0 for r in steps), steps
        else:
            assert all("student_data" not in r and r["reward_mean"] < 1.0 for r in steps), steps
