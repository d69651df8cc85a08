"""Credit accuracy (`esroll.grpo.credit`, `experiments.credit`): steps read from token advantages, the Monte Carlo
reference and its standard errors, and the scores, on hand-built cases worked out here; the reference's bias, its
standard errors' calibration and the reliability-corrected correlation on a synthetic policy whose step values are known
in
closed form; the entry script's report names every method."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import scipy.stats

from esroll.grpo.credit import SCORED, per_step, reference, scores, split_half
from esroll.grpo import advantages
from esroll.grpo.advantages import Group
from esroll.steps import Steps

from conftest import REPO


def _group(rewards, step_BxN, branch_rewards=None):
    rewards = np.asarray(rewards, np.float64)
    X, M = rewards.shape
    step_BxN = np.asarray(step_BxN)
    count_B = np.where(step_BxN >= 0, step_BxN + 1, 0).max(1)
    return Group(
        rewards,
        token_logp=np.zeros(step_BxN.shape).reshape(X, M, -1),
        token_mask=(step_BxN >= 0).reshape(X, M, -1),
        steps=Steps(step_BxN, count_B, (), ()),
        branch_rewards=branch_rewards,
    )


def test_per_step_is_the_mean_over_each_steps_tokens():
    g = _group([[1, 0]], [[0, 0, 1, -1], [0, 1, 1, 1]])
    adv = np.array([[[1.0, 3.0, 5.0, 9.0], [2.0, 4.0, 6.0, 8.0]]])
    np.testing.assert_array_equal(per_step(adv, g), [[[2.0, 5.0], [2.0, 6.0]]])
    np.testing.assert_array_equal(per_step(np.array([[0.5, -0.5]]), g), [[[0.5, 0.5], [-0.5, -0.5]]])
    one = _group([[1, 0]], [[0, 0, 0, -1], [0, 1, -1, -1]])
    assert np.isnan(per_step(adv, one)[0, 0, 1])


def test_reference_values_and_standard_errors():
    """Completion 0 (reward 1), 3 steps: branches after step 0 score (1, 0, 1, 0), after step 1 (1, 1, 1, 1).
    Completion 1 (reward 0), 2 steps: after step 0 (0, 0, 0, 1). The prompt's fresh rollouts score (1, 0, 0, 0):
    V(prompt) = 1/4, sample variance (ddof 1) (3/16 + 9/16) / 3 = 1/4, of the mean 1/16. Completion 0: values 1/4,
    1/2, 1, 1: advantages 1/4, 1/2, 0; (1, 0, 1, 0) has variance 1/3, of the mean 1/12: SE² = 1/12 + 1/16 = 7/48,
    then 0 + 1/12, then 0 + 0 (the own reward after the last step; the boundary before it had variance 0).
    Completion 1: values 1/4, 1/4, 0: advantages 0, −1/4; (0, 0, 0, 1) has variance 1/4, of the mean 1/16: SE² =
    1/16 + 1/16, then 0 + 1/16. The group's own rewards (1, 0) enter nowhere but the last values."""
    nan = np.nan
    br = np.full((1, 2, 3, 4), nan)
    br[0, 0, 0], br[0, 0, 1], br[0, 1, 0] = (1, 0, 1, 0), (1, 1, 1, 1), (0, 0, 0, 1)
    g = _group([[1, 0]], [[0, 1, 2], [0, 1, -1]], br)
    adv, se = reference(g, np.array([[1.0, 0.0, 0.0, 0.0]]))
    np.testing.assert_allclose(adv[0, 0], [0.25, 0.5, 0])
    np.testing.assert_allclose(adv[0, 1, :2], [0, -0.25])
    np.testing.assert_allclose(se[0, 0], np.sqrt([7 / 48, 1 / 12, 0]))
    np.testing.assert_allclose(se[0, 1, :2], np.sqrt([1 / 8, 1 / 16]))
    assert np.isnan(adv[0, 1, 2]) and np.isnan(se[0, 1, 2])
    # one rollout of the prompt: V(prompt) is its reward, and its variance (so the first steps' SE) is unknown
    adv1, se1 = reference(g, np.array([[1.0, nan, nan, nan]]))
    np.testing.assert_allclose(adv1[0, :, 0], [-0.5, -0.75])
    assert np.isnan(se1[0, :, 0]).all() and se1[0, 0, 1] == pytest.approx(np.sqrt(1 / 12))


# ---- a synthetic policy whose step values are known in closed form: three binary steps taken with probabilities
# P, reward 1 when at least two of them are 1. V(prefix) is the probability of reaching two 1s from it, summed by
# hand over the remaining steps' outcomes (`_value`), independently of the code under test.

P_ONE = (0.3, 0.6, 0.7)


def _value(prefix: tuple[int, ...]) -> float:
    need = 2 - sum(prefix)
    rest = [P_ONE[s] for s in range(len(prefix), 3)]
    total = 0.0
    for outcome in itertools.product((0, 1), repeat=len(rest)):
        p = math.prod(q if a else 1 - q for q, a in zip(rest, outcome))
        total += p * (sum(outcome) >= need)
    return total


def _reward(actions: np.ndarray) -> np.ndarray:
    return (actions.sum(-1) >= 2).astype(np.float64)


def _continuations(rng, actions_XxMxJ: np.ndarray, k: int) -> np.ndarray:
    """[X, M, 3, k] the rewards of k continuations sampled from the end of each step but the last; NaN after it."""
    X, M, J = actions_XxMxJ.shape
    out = np.full((X, M, J, k), np.nan)
    for s in range(J - 1):
        rest = (rng.random((X, M, k, J - 1 - s)) < P_ONE[s + 1 :]).astype(int)
        head = np.broadcast_to(actions_XxMxJ[:, :, None, : s + 1], (X, M, k, s + 1))
        out[:, :, s] = _reward(np.concatenate([head, rest], -1))
    return out


@pytest.fixture(scope="module")
def synthetic():
    """4000 groups of M = 4 completions, A = 4 reference continuations per boundary and 4 fresh rollouts of the
    prompt, 2 more continuations per boundary for `mc_steps`; the true step advantages from `_value`."""
    rng = np.random.default_rng(0)
    X, M, A = 4000, 4, 4
    actions = (rng.random((X, M, 3)) < P_ONE).astype(int)
    values = {p: _value(p) for n in range(4) for p in itertools.product((0, 1), repeat=n)}
    true = np.array([[[values[tuple(a[: s + 1])] - values[tuple(a[:s])] for s in range(3)] for a in row]
                     for row in actions])  # fmt: skip
    step_BxN = np.tile(np.arange(3), (X * M, 1))
    g = _group(_reward(actions), step_BxN, _continuations(rng, actions, A))
    prompt_rewards = _reward((rng.random((X, A, 3)) < P_ONE).astype(int))
    return g, prompt_rewards, true, _continuations(rng, actions, 2)


def _slope(estimate: np.ndarray, true: np.ndarray) -> float:
    """The least-squares slope through the origin of an estimate on the truth: 1 for an unbiased estimate."""
    return float(np.sum(estimate * true) / np.sum(true**2))


def test_reference_is_unbiased_at_every_step_with_calibrated_standard_errors(synthetic):
    """E[reference | the step taken] = the true advantage at each step, the first included (V(prompt) from fresh
    rollouts: the group mean would give (M − 1)/M = 0.75 at step 0), and the mean squared standard error equals the
    mean squared error (ddof 1: ddof 0 at A = 4 gives 0.75)."""
    g, prompt_rewards, true, _ = synthetic
    ref, se = reference(g, prompt_rewards)
    for s in range(3):
        assert 0.95 <= _slope(ref[..., s], true[..., s]) <= 1.05, s
        calibration = np.mean(se[..., s] ** 2) / np.mean((ref[..., s] - true[..., s]) ** 2)
        assert 0.95 <= calibration <= 1.05, (s, calibration)


def test_mc_steps_first_step_is_unbiased(synthetic):
    """`mc_steps`' V(prompt) is the mean of the group's other completions: its first step's advantage has slope 1 on
    the true one (the whole group's mean, which includes the completion's own reward, gives (M − 1)/M)."""
    g, _, true, small = synthetic
    est = advantages.estimate("mc_steps", g._replace(branch_rewards=small))
    mc = per_step(est.advantage, g)
    for s in range(3):
        assert 0.95 <= _slope(mc[..., s], true[..., s]) <= 1.05, s


def test_corrected_correlation_estimates_the_correlation_with_the_truth(synthetic):
    """Against the noisy reference (A = 4) an exact estimator correlates below 0.8; corrected for the reference's
    split-half reliability, each method's correlation is within 0.05 of its correlation with the true advantages
    (exact: 1; GRPO's broadcast; `mc_steps` from 2 continuations of its own)."""
    g, prompt_rewards, true, small = synthetic
    ref, se = reference(g, prompt_rewards)
    halves = split_half(g, prompt_rewards)
    equal = advantages.all_equal(g)
    grpo = advantages.estimate("grpo", g).advantage
    mc = advantages.estimate("mc_steps", g._replace(branch_rewards=small)).advantage
    for name, token in (("exact", true), ("grpo", grpo), ("mc_steps", mc)):
        method = true if name == "exact" else per_step(token, g)
        out = scores(method, token, ref, se, equal, halves=halves, boot=0)
        with_truth = scipy.stats.spearmanr(method.ravel(), true.ravel()).statistic
        assert abs(out["spearman_corrected"] - with_truth) <= 0.05, (name, out["spearman_corrected"], with_truth)
        assert out["spearman"] < out["spearman_corrected"] and 0 < out["reliability"] < 1
        if name == "exact":
            assert out["spearman"] < 0.8  # the noisy reference's attenuation, which the correction undoes


def test_scores_on_a_hand_built_case():
    """Three prompts, one completion of three steps each (M = 1). The reference's steps rank 1..9 by value; the
    method gives prompt 2's steps in reverse order. Pooled Spearman: the rank differences are 0 but prompt 2's
    (d = 2, 0, −2), so ρ = 1 − 6·8 / (9·80) = 1 − 48/720. Significant steps (|A| > 1.96·0.1): −0.4, −0.3, 0.3, 0.35,
    0.4, all of the method's signs right; with the first one's sign flipped, 4 of 5. Prompt 0 is an all-equal group
    with a non-zero method advantage, prompt 1 one with none: 1/2."""
    ref = np.array([[[-0.4, -0.3, -0.15]], [[-0.1, 0.05, 0.1]], [[0.3, 0.35, 0.4]]])
    method = ref.copy()
    method[2, 0] = [0.4, 0.35, 0.3]
    se = np.full(ref.shape, 0.1)
    token = np.array([[[1.0, 0.0]], [[0.0, 0.0]], [[0.0, 0.0]]])
    equal = np.array([True, True, False])
    out = scores(method, token, ref, se, equal, boot=200, seed=0)
    assert out["spearman"] == pytest.approx(1 - 48 / 720)
    assert out["significant_steps"] == 5 and out["sign_agreement"] == 1.0
    assert out["equal_signal"] == 0.5 and out["equal_groups"] == 2 and out["steps"] == 9
    for name in ("spearman", "sign_agreement", "equal_signal"):
        assert out[f"{name}_low"] <= out[name] <= out[f"{name}_high"], name
    flipped = ref.copy()
    flipped[0, 0, 0] = 0.5
    assert scores(flipped, token, ref, se, equal, boot=0)["sign_agreement"] == pytest.approx(4 / 5)
    exact = scores(ref, token, ref, se, equal, boot=50)
    assert exact["spearman"] == pytest.approx(1.0) and exact["spearman_low"] == pytest.approx(1.0)
    assert math.isnan(scores(ref, token, ref, se, np.zeros(3, bool), boot=0)["equal_signal"])


@pytest.mark.e2e
def test_entry_script_writes_the_report(tmp_path):
    from experiments.credit import ROWS, main

    from esroll.critic import critic_from_policy
    from esroll.models import load_hf, save_hf

    model = str(REPO / "assets" / "tiny-qwen3-steps")
    cfg, policy = load_hf(model)
    critic_cfg, critic = critic_from_policy(cfg, policy)
    critic["value_head"] = np.random.default_rng(0).normal(0, 0.1, critic["value_head"].shape).astype(np.float32)
    save_hf(tmp_path / "critic", critic_cfg, critic)
    results = main(
        ["--models", f"tiny={model},again={model}", "--critics", f"tiny={tmp_path / 'critic'}", "--prompts", "3",
         "--group", "2", "--k_ref", "2", "--boot", "5", "--out", str(tmp_path / "out"),
         "--success_heads", f"again={tmp_path / 'critic'}"]
    )  # fmt: skip
    text = (tmp_path / "out" / "results.md").read_text()
    for name in ROWS:
        assert f"| `{name}` |" in text, name
    assert {"ppo", "ppo_lam1"} <= set(results["tiny"]) and "ppo" not in results["again"]
    assert {"srppo_k1", "srppo_k4"} <= set(results["again"]) and "srppo_k1" not in results["tiny"]
    assert text.count("| `ppo` |") == 2 and "| `ppo` | – | – | – | – |" in text  # the model without a critic
    assert text.count("| `srppo_k4` |") == 2
    for flag in ("--critics", "--success_heads"):
        with pytest.raises(SystemExit, match=flag):
            main([flag, f"other={tmp_path / 'critic'}", "--out", str(tmp_path)])
    tmp_path = tmp_path / "out"
    assert set(SCORED) <= set(results["tiny"]) and (tmp_path / "credit.png").stat().st_size > 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["tiny"]["sample"]["prompts"] == 3 and saved["meta"]["models"] == [["tiny", model], ["again", model]]
    with pytest.raises(SystemExit, match="--models"):
        main(["--models", "nolabel", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--k_ref"):
        main(["--k_ref", "3", "--out", str(tmp_path)])
