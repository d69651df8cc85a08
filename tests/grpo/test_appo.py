"""APPO (`esroll.grpo.estimators.appo`): the future likelihood gain Ω, the Branching Score and the positions it picks
on hand-built entropies (of hand-built logits) and log-ratios, the two-group token advantages on a hand-built group,
the registry's contract for estimators that branch, and a GRPO step with APPO by name."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import pytest

from configs.step_level import get_config
from esroll.grpo import advantages, make_grpo_method
from esroll.grpo.advantages import Group
from esroll.grpo.estimators.appo import AppoOptions, appo, branching_scores, choose_positions, future_gain
from esroll.grpo.branch_credit import value_changes
from esroll.grpo.update import keeps_reference, loss_reads_reference

from conftest import shipped_config

FLAT = 1e12  # a half-life so long that γ = 1 to twelve digits


def _entropy(logits):
    p = np.exp(logits - np.max(logits))
    p = p / p.sum()
    return float(-(p * np.log(p)).sum())


def test_future_gain_by_hand():
    """Ω_t = exp(Σ_{k ≥ t} γ^{k−t} r_k) over the row's tokens: with γ = 1/2 and log-ratios 0.1, 0.2, −0.1 (a fourth
    token past the end), Ω = exp(0.175), exp(0.15), exp(−0.1), and 1 past the end."""
    r = np.array([[0.1, 0.2, -0.1, 9.0]])
    mask = np.array([[True, True, True, False]])
    np.testing.assert_allclose(
        future_gain(r, mask, 0.5), [[math.exp(0.175), math.exp(0.15), math.exp(-0.1), 1.0]], rtol=1e-12
    )
    assert AppoOptions(half_life=2.0).gamma == pytest.approx(2**-0.5)


def test_branching_scores_and_positions_on_hand_built_logits():
    """Entropies of hand-built logits: 4 equal logits give ln 4, one dominant logit about 0. Row 0: H = ln 4, 0, ln 4,
    0, so z(H) = 1, −1, 1, −1; log-ratios 0, 1, −5, 1 with γ = 1 give future sums −3, −3, −4, 1, so clip(Ω) = 1, 1,
    1, 1.2 and z(Ω) = −1/√3 (three times), √3; BS = −1/√3, 1/√3, −1/√3, −√3. No token has both z > 0, so the
    positions (t ≥ 1) go by entropy: t = 2, then t = 1 and t = 3 tied at z(H) = −1, the earlier first. Row 1: H = 0,
    ln 4, ln 4, 0 and log-ratios −5, 0, 2, −1: future sums −4, 1, 1, −1, clip(Ω) = 1, 1.2, 1.2, 1, both z = −1, 1, 1,
    −1 and BS = 1 everywhere; t = 1 and t = 2 (both z > 0) come before t = 3, whose BS of 1 is two below-mean z's."""
    high, low = _entropy(np.zeros(4)), _entropy(np.array([40.0, 0.0, 0.0, 0.0]))
    assert high == pytest.approx(math.log(4)) and low < 1e-15
    H = np.array([[high, low, high, low], [low, high, high, low]])
    r = np.array([[0.0, 1.0, -5.0, 1.0], [-5.0, 0.0, 2.0, -1.0]])
    mask = np.ones((2, 4), bool)
    bs, z_h, z_o = branching_scores(H, r, mask, AppoOptions(half_life=FLAT))  # z = (x − mean) / (std + 1e-6)
    s = math.sqrt(3)
    np.testing.assert_allclose(z_h, [[1, -1, 1, -1], [-1, 1, 1, -1]], atol=1e-4)
    np.testing.assert_allclose(z_o, [[-1 / s, -1 / s, -1 / s, s], [-1, 1, 1, -1]], atol=1e-4)
    np.testing.assert_allclose(bs, [[-1 / s, 1 / s, -1 / s, -s], [1, 1, 1, 1]], atol=1e-4)
    np.testing.assert_array_equal(choose_positions(bs, z_h, z_o, [4, 4], 3), [[2, 1, 3], [1, 2, 3]])
    np.testing.assert_array_equal(choose_positions(bs, z_h, z_o, [4, 4], 1), [[2], [1]])
    # a row of 1 token has no position to branch at (t = 0 would be a fresh rollout); of 3 tokens, 2
    np.testing.assert_array_equal(choose_positions(bs, z_h, z_o, [1, 3], 3), [[-1, -1, -1], [1, 2, -1]])


def _group(rewards, lengths, positions, branch_rewards, logratio=None, valid=None):
    X, M = np.shape(rewards)
    N = 4
    mask = np.arange(N)[None, None, :] < np.asarray(lengths)[..., None]
    zeros = np.zeros((X, M, N))
    return Group(
        rewards=np.asarray(rewards, np.float64),
        valid=valid,
        token_mask=mask,
        token_logp=zeros,
        entropy=zeros,
        ref_logratio=zeros if logratio is None else np.asarray(logratio, np.float64),
        branch_positions=np.asarray(positions),
        branch_rewards=np.asarray(branch_rewards, np.float64),
    )


def test_two_group_advantages_by_hand():
    """One prompt, completions with rewards 1 and 0 (z = 1, −1 in the initial group), of 4 and 3 tokens. Completion 0
    branches at t = 2 (two continuations, rewards 0 and 1), completion 1 at t = 1 (rewards 1, 1): the branch group
    {0, 1, 1, 1} has mean 3/4 and std √3/4, so z = −√3 for a 0 and 1/√3 for a 1. Completion 0's tokens 0 and 1 lie on
    its branches (their first 2 tokens are its own): Â_base = ½ (1 + ½ (−√3 + 1/√3)) = ½ (1 − 1/√3); tokens 2 and 3
    are its alone: 1. Completion 1's token 0: ½ (−1 + 1/√3); tokens 1, 2: −1; token 3 is past its end: 0. Log-ratios
    0 give Ω = 1 and a scale 1 + 0.5·1 = 1.5 on every token."""
    s = math.sqrt(3)
    g = _group([[1.0, 0.0]], [[4, 3]], [[[2], [1]]], [[[[0.0, 1.0]], [[1.0, 1.0]]]])
    est = appo(g, AppoOptions(half_life=FLAT))
    base = [[0.5 * (1 - 1 / s)] * 2 + [1.0, 1.0], [0.5 * (-1 + 1 / s), -1.0, -1.0, 0.0]]
    np.testing.assert_allclose(est.advantage, 1.5 * np.array([base]), atol=1e-6)
    assert est.metrics["appo_shared"] == pytest.approx(3 / 7) and est.metrics["appo_branch_reward"] == 0.75
    assert est.metrics["appo_position"] == pytest.approx((2 / 4 + 1 / 3) / 2)


def test_an_all_equal_group_gets_its_branches_signal_and_omega_scales_it():
    """Both completions failed (the initial group's z is 0): the tokens their branches share get half the branches'
    z-scores, the others 0 — where GRPO gives 0 everywhere. A log-ratio of 1 on completion 0's last token (γ = 1)
    makes each of its future sums 1, so Ω = e, clipped to 1.2: the scale is 1.6 there and 1.5 on completion 1. An
    invalid completion gets 0 everywhere."""
    lr = np.zeros((1, 2, 4))
    lr[0, 0, 2] = 1.0
    g = _group([[0.0, 0.0]], [[3, 3]], [[[1], [2]]], [[[[1.0]], [[0.0]]]], logratio=lr)
    est = appo(g, AppoOptions(half_life=FLAT))
    np.testing.assert_allclose(est.advantage[0, 0], [1.6 * 0.5, 0, 0, 0], atol=1e-6)  # z of 1 in {1, 0}: 1
    np.testing.assert_allclose(est.advantage[0, 1], [1.5 * -0.5, 1.5 * -0.5, 0, 0], atol=1e-6)
    invalid = appo(g._replace(valid=np.array([[True, False]])), AppoOptions(half_life=FLAT))
    assert not invalid.advantage[0, 1].any()


def test_an_estimator_that_branches_must_say_where():
    with pytest.raises(ValueError, match="branch_points is given exactly when it needs 'token_branches'"):
        advantages.register_advantage("appo_like", lambda g, o, s: None, needs=("token_branches",))
    with pytest.raises(ValueError, match="branch_points is given exactly when"):
        advantages.register_advantage("appo_like", lambda g, o, s: None, branch_points=lambda o, g: None)
    with pytest.raises(ValueError, match="needs one of 'branches' and 'token_branches', not both"):
        advantages.register_advantage(
            "appo_like", lambda g, o, s: None, needs=("branches", "token_branches"), branch_points=lambda o, g: None
        )
    assert "appo_like" not in advantages.ESTIMATORS


def test_appo_is_refused_where_a_branch_cannot_be_scored_or_sampled():
    """A branch is scored by the gold reward: refused with the label-free vote; episodes cannot be continued from a
    prefix: refused with env.name."""
    from esroll.config import ConfigError
    from esroll.grpo.method import check_config

    cfg = shipped_config(get_config, "quick,appo")
    with pytest.raises(ConfigError, match="without branched rollouts with data.reward='majority'"):
        check_config(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, reward="majority")))
    with pytest.raises(ConfigError, match="no reasoning steps or branches with env.name set"):
        check_config(dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, name="frozenlake")))


@pytest.mark.e2e
def test_a_grpo_step_with_appo_by_name():
    """`configs/step_level.py:quick,appo`: the initial policy is kept for Ω but never scored by the loss; one step
    branches each valid completion at up to 3 positions and trains on finite parameters."""
    from esroll import parallel
    from esroll.data import get_batch, make_splits
    from esroll.task import load_task

    cfg = shipped_config(get_config, "quick,appo")
    assert keeps_reference(cfg.grpo) and not loss_reads_reference(cfg.grpo)
    mesh = parallel.make_mesh(1)
    train, held_out = make_splits(cfg.data)
    task, params = load_task(cfg, train, held_out, mesh)
    method = make_grpo_method(cfg, task, mesh)
    out = method.step(params, method.init(params, jax.random.key(0)), get_batch(train, 4, 0, 0), 0)
    rows = cfg.train.prompts_per_step * cfg.grpo.group_size
    assert rows < out.metrics["branch_rows"] <= 3 * rows  # a completion of L ≥ 4 tokens gets 3 positions
    assert 0 < out.metrics["appo_position"] < 1 and out.metrics["appo_scale"] == pytest.approx(1.5)  # Ω = 1
    assert out.metrics["appo_entropy_overlap"] == 1.0  # Ω the same everywhere: the entropy's choice
    assert all(bool(np.isfinite(x).all()) for x in jax.tree.leaves(out.params))


def test_value_changes_by_hand():
    """Completion 0 of 4 tokens: V(first 1) = 1/2, V(first 2) = 1, V(first 3) = 0 from the continuations, and its
    own reward 1 as V(first 4): ΔV = 1/2, −1, 1 at t = 1, 2, 3, none at t = 4. Completion 1 of 2 tokens: V(first 1)
    = 1/2, reward 0: ΔV_1 = −1/2, nothing after."""
    nan = np.nan
    cont = np.full((2, 4, 2), nan)
    cont[0, :3] = [[0, 1], [1, 1], [0, 0]]
    cont[1, 0] = [1, 0]
    dv = value_changes(cont, np.array([1.0, 0.0]), np.array([4, 2]))
    np.testing.assert_array_equal(dv, [[0.5, -1, 1, nan], [-0.5, nan, nan, nan]])


@pytest.mark.e2e
def test_the_branching_measure_runs_on_the_shipped_model(tmp_path):
    """`experiments.branching` on two questions, K = 2: every position t ≥ 1 of each completion is continued K times;
    against itself as the reference Ω is 1 everywhere, so BS has no ranking of its own (its correlation is
    undefined), APPO's choice is the entropy's, and Ω alone chooses nothing."""
    from experiments import branching

    out = branching.main(
        ["--prompts", "2", "--group", "1", "--k", "2", "--boot", "20", "--out", str(tmp_path), "--seed", "1"]
    )["shipped"]
    s = out["sample"]
    assert s["continuations"] == 2 * s["positions"] > 0 and s["omega_varies"] == 0.0
    assert np.isnan(out["bs"]["spearman"]) and out["bs"]["lift"] == out["entropy"]["lift"]
    assert out["bs"]["lift_over_entropy"] == 0.0 and np.isnan(out["omega"]["lift"])  # Ω picks nothing
    assert (tmp_path / "results.md").read_text().count("| entropy H |") == 1
