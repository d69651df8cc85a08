"""The completion-level estimators of esroll.grpo.estimators (A-GRAE, BV-Blend, GMAE, MaxPO, LamPO, negative token
filtering, DDRL) and the label-free majority reward: hand-computed small groups, the invariances each claims,
unbiasedness by exhaustive enumeration (MaxPO), exact centring, and their reductions to GRPO / RLOO when their knobs are
off. The other registered estimators are tested elsewhere: the group-relative built-ins in tests/test_baselines.py, the
step-level ones and GuAE in tests/grpo/test_step_estimators.py (`mc_steps` in tests/steps/test_branching.py), the
turn-level ones in tests/grpo/test_turn_credit.py."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from esroll import baselines
from esroll import rewards as R
from esroll.grpo import advantages as A
from esroll.grpo import estimators as E
from esroll.errors import ConfigError


def est(name, rewards, options=None, state=None, **fields):
    g = A.Group(np.asarray(rewards, np.float64), **fields)
    if state is None:
        state = A.init_estimator_state(name, options)
    return A.estimate(name, g, options, state)


# ---------------------------------------------------------------- A-GRAE


def test_agrae_without_asymmetry_or_focus_is_grpo():
    r = np.random.default_rng(0).integers(0, 2, (5, 6)).astype(float)
    o = E.agrae.AgraeOptions(positive=1.0, positive_final=1.0, focus=0.0, horizon=10)
    for step in (0, 5, 20):
        np.testing.assert_allclose(est("agrae", r, o, step=step).advantage, baselines.grpo(r), rtol=1e-6)


def test_agrae_hand_computed():
    # One success in four: mean 1/4, sample std 1/2, so GRPO gives [3/2, -1/2, -1/2, -1/2] (up to its 1e-4).
    r = [[1.0, 0.0, 0.0, 0.0]]
    base = np.array([1.5, -0.5, -0.5, -0.5]) * 0.5 / (0.5 + 1e-4)
    o = E.agrae.AgraeOptions(positive=1.0, positive_final=0.5, focus=0.5, horizon=10)
    # step 0: β = 1, t = 0, weight 1 + 0.5·(2·1/4 − 1) = 3/4 (a hard group weighs less early)
    np.testing.assert_allclose(est("agrae", r, o, step=0).advantage[0], base * 0.75, rtol=1e-6)
    # step 5: β = 3/4 on the positive entry, t = 1/2: every group weighs 1
    np.testing.assert_allclose(est("agrae", r, o, step=5).advantage[0], base * [0.75, 1, 1, 1], rtol=1e-6)
    # from the horizon on: β = 1/2, weight 1 − 0.5·(−1/2) = 5/4 (hard groups weigh more late)
    for step in (10, 50):
        np.testing.assert_allclose(est("agrae", r, o, step=step).advantage[0], base * [0.5, 1, 1, 1] * 1.25, rtol=1e-6)


def test_agrae_is_permutation_equivariant_and_zero_on_equal_groups():
    r = np.random.default_rng(1).random((3, 5))
    perm = np.random.default_rng(2).permutation(5)
    a = est("agrae", r, step=3).advantage
    np.testing.assert_allclose(est("agrae", r[:, perm], step=3).advantage, a[:, perm], rtol=1e-5, atol=1e-6)
    assert np.all(est("agrae", np.ones((2, 4))).advantage == 0)


# ---------------------------------------------------------------- BV-Blend


def test_bv_blend_without_history_is_grpo_with_the_population_std():
    r = np.random.default_rng(3).integers(0, 2, (4, 8)).astype(float)
    out = est("bv_blend", r, cluster=np.zeros(4, int))
    np.testing.assert_allclose(out.advantage, baselines.grpo_population_std(r), rtol=1e-5, atol=1e-6)


def test_bv_blend_hand_computed_equal_group_and_history_update():
    # Cluster 0's history: weight 10, mean 1/2, second moment 1/2 (variance 1/4). SEM = √((1/4 + 1/4) / 10) = √0.05,
    # λ = 0.5 / (1 + 0.05 / 0.01) = 1/12. A group of four 1s: μ = 1 − λ/2, σ² = λ/4 + λ(1 − λ)/4 = 23/576,
    # so every entry gets (λ/2) / (√23 / 24) = 1/√23.
    state = E.bv_blend.bv_blend_init(E.bv_blend.BVBlendOptions())
    state["weight"][0], state["mean"][0], state["sq"][0] = 10.0, 0.5, 0.5
    out = est("bv_blend", [[1.0, 1.0, 1.0, 1.0]], state=state, cluster=np.array([0]))
    np.testing.assert_allclose(out.advantage[0], np.full(4, 1 / np.sqrt(23)), rtol=1e-3)
    assert out.metrics["bv_equal_groups_with_signal"] == 1.0
    # the history takes in the step: W = 0.9·10 + 4 = 13, mean = (0.9·10·0.5 + 4) / 13, sq likewise
    np.testing.assert_allclose(out.state["weight"][0], 13.0)
    np.testing.assert_allclose(out.state["mean"][0], 8.5 / 13, rtol=1e-6)
    np.testing.assert_allclose(out.state["sq"][0], 8.5 / 13, rtol=1e-6)
    assert np.all(out.state["weight"][1:] == 0)  # other clusters untouched
    # an all-equal group's advantage is bounded by √(λ / (1 − λ)) whatever the history
    state["mean"][0] = state["sq"][0] = 0.0
    far = est("bv_blend", [[1.0, 1.0, 1.0, 1.0]], state=state, cluster=np.array([0])).advantage
    assert np.all(np.abs(far) <= np.sqrt(0.5 / 0.5) + 1e-6)


def test_bv_blend_is_permutation_equivariant_within_a_group():
    state = E.bv_blend.bv_blend_init(E.bv_blend.BVBlendOptions())
    state["weight"][:] = 5.0
    state["mean"][:] = state["sq"][:] = 0.3
    r = np.random.default_rng(4).random((3, 6))
    perm = np.random.default_rng(5).permutation(6)
    c = np.array([0, 1, 0])
    a = est("bv_blend", r, state=dict(state), cluster=c).advantage
    np.testing.assert_allclose(
        est("bv_blend", r[:, perm], state=dict(state), cluster=c).advantage, a[:, perm], rtol=1e-5
    )


# ---------------------------------------------------------------- majority vote and GMAE


def test_majority_rewards():
    answers = np.array([[7, 7, 3, -1], [1, 2, 3, 4], [-1, -1, -1, -1], [5, 5, 6, 6]])
    expected = [[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]]  # ties: every modal answer; no answer: 0
    np.testing.assert_array_equal(R.majority_rewards(answers), expected)


def test_gmae_is_k_over_k_plus_one_rloo_for_context_free_rewards():
    """Closed form, and the enumeration it replaces: E_T[r_i − mean_T r] = k/(k+1)·(r_i − mean_{j≠i} r_j)."""
    r = np.random.default_rng(6).random((2, 6))
    for k in (1, 3, 5):
        o = E.gmae.GMAEOptions(context=k)
        closed = est("gmae", r, o).advantage
        np.testing.assert_allclose(closed, k / (k + 1) * np.asarray(baselines.rloo(r)), rtol=1e-5, atol=1e-6)
        for x in range(2):
            enumerated = E.gmae.gmae_enumerate(6, k, lambda T, x=x: r[x, list(T)])
            np.testing.assert_allclose(closed[x], enumerated, rtol=1e-5, atol=1e-6)
    # k = G − 1: the one context is the group itself, which is Dr. GRPO
    np.testing.assert_allclose(
        est("gmae", r, E.gmae.GMAEOptions(context=5)).advantage, baselines.dr_grpo(r), rtol=1e-5, atol=1e-6
    )


def test_gmae_majority_vote_hand_computed():
    # Answers A, A, B, C and contexts of k = 2 others. For response 0 (A): {0,1,2} -> rewards (1,1,0), advantage 1/3;
    # {0,1,3} -> 1/3; {0,2,3} -> three-way tie, all rewarded, 0. Mean 2/9. For 2 (B): {2,0,1} -> 0 − 2/3; the other
    # two contexts are ties -> 0; mean −2/9. The plain majority vote of the whole group would give (1,1,0,0).
    answers = np.array([[11, 11, 22, 33]])
    out = est("gmae", R.majority_rewards(answers), E.gmae.GMAEOptions(context=2), answers=answers)
    np.testing.assert_allclose(out.advantage[0], [2 / 9, 2 / 9, -2 / 9, -2 / 9], rtol=1e-6)


def test_gmae_sampled_contexts_are_seeded():
    answers = np.random.default_rng(7).integers(0, 3, (2, 12))
    o = E.gmae.GMAEOptions(context=6, max_contexts=20)  # C(11, 6) = 462 contexts: sampled
    one = est("gmae", R.majority_rewards(answers), o, answers=answers, step=4, seed=1).advantage
    again = est("gmae", R.majority_rewards(answers), o, answers=answers, step=4, seed=1).advantage
    np.testing.assert_array_equal(one, again)
    assert np.abs(one.sum(1)).max() < 1.0  # an average of centred advantages over sampled contexts: near 0


# ---------------------------------------------------------------- MaxPO


def test_maxpo_with_k1_is_rloo():
    r = np.random.default_rng(8).random((3, 5))
    np.testing.assert_allclose(
        est("maxpo", r, E.maxpo.MaxPOOptions(k=1)).advantage, baselines.rloo(r), rtol=1e-5, atol=1e-6
    )


def test_maxpo_pass_at_2_hand_computed():
    # One success in four, K = 2: s_0 = 3/6 (every pair with response 0 has max 1), s_j = 1/6. The others' pass@2
    # estimate is 0 for response 0 and 2/3 for each other response (two of the three pairs of {1, 0, 0} hold the 1).
    # A_0 = (4/2)·(1/2) − 0 = 1, A_j = (4/2)·(1/6) − 2/3 = −1/3.
    out = est("maxpo", [[1.0, 0.0, 0.0, 0.0]], E.maxpo.MaxPOOptions(k=2))
    np.testing.assert_allclose(out.advantage[0], [1, -1 / 3, -1 / 3, -1 / 3], rtol=1e-6)


@pytest.mark.parametrize("K", [2, 3])
def test_maxpo_is_exactly_centred(K):
    r = np.random.default_rng(K).random((6, 7)).round(1)  # ties included
    out = est("maxpo", r, E.maxpo.MaxPOOptions(k=K))
    np.testing.assert_allclose(out.advantage.sum(1), 0.0, atol=1e-5)


def test_maxpo_subset_weights_match_brute_force():
    r = np.array([0.3, 0.9, 0.1, 0.9, 0.5])
    G, K = 5, 3
    brute = np.zeros(G)
    for S in itertools.combinations(range(G), K):
        for i in S:
            brute[i] += max(r[list(S)]) / math.comb(G, K)
    baseline = [
        np.mean([max(np.delete(r, i)[list(S)]) for S in itertools.combinations(range(G - 1), K)]) for i in range(G)
    ]
    np.testing.assert_allclose(E.maxpo.maxpo_group(r, K), G / K * brute - np.array(baseline), rtol=1e-12)


@pytest.mark.parametrize("G,K", [(3, 2), (4, 2), (4, 3)])
def test_maxpo_is_unbiased_for_the_max_at_k_gradient(G, K):
    """Exhaustive: a softmax policy over 3 outcomes with rewards v; E[Σ_i A_i ∇log π(y_i)] over all G-tuples equals
    (G/K)·∇ E[max of K draws], the latter also by enumeration."""
    v = np.array([0.0, 0.4, 1.0])
    theta = np.array([0.2, -0.3, 0.5])
    p = np.exp(theta) / np.exp(theta).sum()
    score = np.eye(3) - p  # ∇_θ log π(y) for y = 0, 1, 2 (rows)
    lhs = np.zeros(3)
    for ys in itertools.product(range(3), repeat=G):
        prob = np.prod(p[list(ys)])
        adv = E.maxpo.maxpo_group(v[list(ys)], K)
        lhs += prob * sum(adv[i] * score[y] for i, y in enumerate(ys))
    grad = np.zeros(3)
    for ys in itertools.product(range(3), repeat=K):
        grad += np.prod(p[list(ys)]) * max(v[list(ys)]) * score[list(ys)].sum(0)
    np.testing.assert_allclose(lhs, G / K * grad, atol=1e-12)


def test_maxpo_needs_more_responses_than_k():
    with pytest.raises(ValueError, match="more responses than K"):
        E.maxpo.maxpo_group(np.zeros(2), 2)


# ---------------------------------------------------------------- LamPO


def test_lampo_without_temperature_is_rloo():
    r = np.random.default_rng(9).random((3, 5))
    ell = np.random.default_rng(10).normal(size=(3, 5))
    out = est("lampo", r, E.lampo.LamPOOptions(temperature=0.0), seq_logp=ell)
    np.testing.assert_allclose(out.advantage, baselines.rloo(r), rtol=1e-5, atol=1e-6)


def test_lampo_hand_computed_pair():
    # the better response is the likelier: the pair weighs 2σ(−1) < 1; the other way round 2σ(1) > 1
    right = est("lampo", [[1.0, 0.0]], seq_logp=np.array([[-1.0, -2.0]])).advantage[0]
    wrong = est("lampo", [[1.0, 0.0]], seq_logp=np.array([[-2.0, -1.0]])).advantage[0]
    w = 2 / (1 + np.exp(1.0))
    np.testing.assert_allclose(right, [w, -w], rtol=1e-6)
    np.testing.assert_allclose(wrong, [2 - w, -(2 - w)], rtol=1e-6)


def test_lampo_is_centred_shift_invariant_and_equivariant():
    rng = np.random.default_rng(11)
    r, ell = rng.random((4, 6)), rng.normal(size=(4, 6))
    a = est("lampo", r, seq_logp=ell).advantage
    np.testing.assert_allclose(a.sum(1), 0.0, atol=1e-6)
    np.testing.assert_allclose(est("lampo", r + 3.0, seq_logp=ell).advantage, a, rtol=1e-5, atol=1e-6)
    perm = rng.permutation(6)
    np.testing.assert_allclose(
        est("lampo", r[:, perm], seq_logp=ell[:, perm]).advantage, a[:, perm], rtol=1e-5, atol=1e-6
    )


# ---------------------------------------------------------------- negative token filtering (one rollout per prompt)


def test_ntf_single_rollout_batch_baseline_and_filtered_tokens():
    r = np.array([[1.0], [0.0], [0.0], [1.0]])  # G = 1: batch mean 1/2, std 1/2
    logp = np.log(np.array([[0.9, 0.2, 0.6], [0.9, 0.2, 0.6], [0.3, 0.7, 0.1], [0.1, 0.1, 0.1]]))[:, None, :]
    mask = np.array([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]], bool)[:, None, :]
    out = est("ntf", r, token_logp=logp, token_mask=mask)
    np.testing.assert_allclose(out.advantage[:, 0], np.array([1, -1, -1, 1]) * 0.5 / (0.5 + 1e-4), rtol=1e-6)
    # negatives (rows 1, 2) lose the tokens sampled with probability >= 0.5; positives keep every token
    expected = np.array([[1, 1, 1], [0, 1, 0], [1, 0, 1], [1, 1, 1]], np.float32)[:, None, :]
    np.testing.assert_array_equal(out.token_weight, expected)
    assert out.metrics["ntf_filtered_fraction"] == pytest.approx(3 / 5)  # of the negatives' 5 completion tokens
    none = est("ntf", r, E.ntf.NTFOptions(filter_prob=1.0), token_logp=logp, token_mask=mask)
    assert np.all(none.token_weight[mask] == 1)  # 1: nothing filtered (a sampled token never has probability 1 here)


def test_ntf_ema_baseline_follows_earlier_batches():
    o = E.ntf.NTFOptions(baseline="ema", normalize=False, decay=0.5)
    first = est("ntf", [[1.0], [1.0]], o)  # no history yet: the batch mean
    np.testing.assert_allclose(first.advantage, 0.0)
    second = est("ntf", [[0.0], [1.0]], o, state=first.state)  # baseline 1 (the EMA of one batch of mean 1)
    np.testing.assert_allclose(second.advantage[:, 0], [-1.0, 0.0])
    np.testing.assert_allclose(second.state["mean"], (0.5 * 1 * 1 + 0.5) / 1.5)


# ---------------------------------------------------------------- DDRL


def test_ddrl_hand_computed_groups_and_balance():
    answers = np.array(
        [
            [5, 5, 5, 5, 9],  # consistency 4/5 >= 0.6: four positives, one negative
            [1, 1, 2, 2, 3],  # 2/5: ambiguous, left out
            [1, 2, 3, 4, 6],  # 1/5 <= 0.3: all five negative
        ]
    )
    out = est("ddrl", R.majority_rewards(answers), answers=answers, step=3, seed=2)
    a = out.advantage
    assert np.all(a[1] == 0)
    assert set(np.unique(a)) <= {-1.0, 0.0, 1.0}
    # 4 positives against 6 negatives: 4 of each kept
    assert (a > 0).sum() == 4 and (a < 0).sum() == 4 and np.all(a[0, :4] == 1)
    assert out.metrics["ddrl_excluded_groups"] == pytest.approx(1 / 3)
    again = est("ddrl", R.majority_rewards(answers), answers=answers, step=3, seed=2).advantage
    np.testing.assert_array_equal(a, again)


def test_ddrl_needs_answers():
    with pytest.raises(ValueError, match="label-free"):
        est("ddrl", np.ones((1, 4)))


# ---------------------------------------------------------------- the registry and the options


def sequence_level() -> list[str]:
    """The estimators that credit whole completions (those that read steps, as mc_steps, are tested with a model
    that writes steps: tests/steps/test_branching.py; those that read episodes' turns: tests/grpo/test_turn_credit.py;
    PPO's, which reads a critic's values per token: tests/grpo/test_gae.py; the distillation estimators, which read
    a teacher's log-probability per token: tests/grpo/test_distill.py; APPO, which branches at token positions:
    tests/grpo/test_appo.py)."""
    skip = {*A.STEP_NEEDS, "turns", "values", "teacher", "token_branches"}
    return [name for name, spec in A.ESTIMATORS.items() if not set(spec.needs) & skip]


def test_every_estimator_gives_float32_of_the_rewards_shape():
    rng = np.random.default_rng(12)
    r = rng.integers(0, 2, (3, 6)).astype(float)
    answers = rng.integers(0, 3, (3, 6))
    fields = dict(
        seq_logp=rng.normal(size=(3, 6)),
        token_logp=np.log(rng.random((3, 6, 4))),
        token_mask=np.ones((3, 6, 4), bool),
        cluster=np.array([0, 1, 0]),
        answers=answers,
    )
    for name in sequence_level():
        out = est(name, r, **fields)
        assert out.advantage.shape == (3, 6) and out.advantage.dtype == np.float32, name
        assert np.all(np.isfinite(out.advantage)), name


def test_a_group_with_fewer_than_two_valid_entries_gets_zero():
    """Nothing to compare in a group of one valid entry (or none): every estimator whose baseline is the group gives it
    0 (docs/theory.md); the exceptions compare with something outside the group (raw: nothing; ntf: the batch or its
    EMA; bv_blend: its cluster's history, 0 here without one; guae: its anchor, a running mean of past rewards). DDRL used to read a lone answer as full consensus
    (c = 1) and could keep it as a positive (+a)."""
    rng = np.random.default_rng(13)
    X, M = 4, 4
    r = np.array([[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 0.0, 1.0]])
    # rows 0 and 1: one valid entry, row 2: none, row 3: all four (every answer different: no consensus, all -a)
    valid = np.array([[1, 0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], bool)
    answers = np.array([[7, 7, 7, 7], [3, 3, 3, 3], [5, 5, 5, 5], [1, 2, 3, 4]])
    fields = dict(
        valid=valid,
        seq_logp=rng.normal(size=(X, M)),
        token_logp=np.log(rng.random((X, M, 3))),
        token_mask=np.ones((X, M, 3), bool),
        cluster=np.array([0, 1, 0, 1]),
        answers=answers,
    )
    for name in sequence_level():
        if name in ("raw", "ntf", "guae"):
            continue
        out = est(name, r, **fields)
        np.testing.assert_array_equal(out.advantage[:3], 0, err_msg=name)
        assert np.all(out.advantage[~valid] == 0), name
    # gmae's label-free branch too, and without the other group
    np.testing.assert_array_equal(est("gmae", r[:3], valid=valid[:3], answers=answers[:3]).advantage, 0)
    ddrl = est("ddrl", r, valid=valid, answers=answers)
    assert ddrl.metrics["ddrl_excluded_groups"] == pytest.approx(3 / 4) and np.all(ddrl.advantage == 0)


def test_options_are_checked():
    from configs.default import get_config
    from esroll.config import from_config_dict
    from esroll.experiment import check_names

    cd = get_config("grpo_quick")
    cd.grpo.advantage = "agrae"  # no horizon declared
    with pytest.raises(ConfigError, match=r"^config: invalid value for 'grpo.adv.agrae.horizon': 0 \(expected >= 1"):
        check_names(from_config_dict(cd.to_dict()))
    cd.grpo.adv.agrae.horizon = 10
    assert check_names(from_config_dict(cd.to_dict())).grpo.adv["agrae"] == E.agrae.AgraeOptions(horizon=10)
    cd.grpo.update(advantage="maxpo", group_size=2)  # MaxPO's leave-two-out baseline needs group_size > k = 2
    with pytest.raises(ConfigError, match=r"^config: invalid value for 'grpo.group_size': 2 \(expected > adv.maxpo.k"):
        check_names(from_config_dict(cd.to_dict()))
    cd = get_config("grpo_quick")
    cd.grpo.update(advantage="ntf", group_size=1)
    cd.data.reward = "majority"  # one completion cannot vote
    with pytest.raises(ConfigError, match="grpo.group_size"):
        check_names(from_config_dict(cd.to_dict()))
    cd.data.reward = "gold"
    cd.grpo.update(advantage="ddrl", group_size=4)  # label-free only: a registry's property, checked by check_names
    with pytest.raises(
        ConfigError, match=r"^config: invalid value for 'grpo.advantage': 'ddrl' \(expected an estimator"
    ):
        check_names(from_config_dict(cd.to_dict()))
    cd.data.reward = "majority"
    check_names(from_config_dict(cd.to_dict()))
    with pytest.raises(ConfigError, match="high"):
        E.ddrl.DDRLOptions(high=0.5)
    with pytest.raises(ConfigError, match="focus"):
        E.agrae.AgraeOptions(focus=1.0)
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        A.estimate("nope", A.Group(np.zeros((1, 2))))


def test_answer_ids_are_stable_and_exact_in_float64():
    ids = [R.answer_id(s) for s in ("42", "-7", "3.5", "1000000")]
    assert len(set(ids)) == 4 and all(0 <= i < 2**52 and float(i) == i for i in ids)
    assert R.answer_id("42") == ids[0] and R.answer_id(None) == -1
