"""Credit accuracy (`esroll.credit`, `experiments.credit`): steps read from token advantages, the Monte Carlo reference
and its standard errors, and the three scores, each on hand-built cases worked out here; the entry script's report
names every method."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from esroll.credit import METHODS, per_step, reference, scores
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
    Completion 1 (reward 0), 2 steps: after step 0 (0, 0, 0, 1). V(prompt) = 1/2 over M = 2 (variance 1/4).
    Completion 0: values 1/2, 1/2, 1, 1: advantages 0, 1/2, 0; SE² = 1/4/4 + 1/4/2 = 3/16, then 0 + 1/16 = 1/16,
    then 0 + 0 (the own reward after the last step; the boundary before it had variance 0). Completion 1: values
    1/2, 1/4, 0: advantages −1/4, −1/4; SE² = 3/16/4 + 1/8 = 3/64 + 8/64 = 11/64, then 0 + 3/64."""
    nan = np.nan
    br = np.full((1, 2, 3, 4), nan)
    br[0, 0, 0], br[0, 0, 1], br[0, 1, 0] = (1, 0, 1, 0), (1, 1, 1, 1), (0, 0, 0, 1)
    g = _group([[1, 0]], [[0, 1, 2], [0, 1, -1]], br)
    adv, se = reference(g)
    np.testing.assert_allclose(adv[0, 0], [0, 0.5, 0])
    np.testing.assert_allclose(adv[0, 1, :2], [-0.25, -0.25])
    np.testing.assert_allclose(se[0, 0], np.sqrt([3 / 16, 1 / 16, 0]))
    np.testing.assert_allclose(se[0, 1, :2], np.sqrt([11 / 64, 3 / 64]))
    assert np.isnan(adv[0, 1, 2]) and np.isnan(se[0, 1, 2])


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


def test_entry_script_writes_the_report(tmp_path):
    from experiments.credit import ROWS, main

    model = str(REPO / "assets" / "tiny-qwen3-steps")
    results = main(
        ["--models", f"tiny={model}", "--prompts", "3", "--group", "2", "--k_ref", "2", "--boot", "5",
         "--out", str(tmp_path)]
    )  # fmt: skip
    text = (tmp_path / "results.md").read_text()
    for name in ROWS:
        assert f"| `{name}` |" in text, name
    assert set(METHODS) <= set(results["tiny"]) and (tmp_path / "credit.png").stat().st_size > 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["tiny"]["sample"]["prompts"] == 3 and saved["meta"]["models"] == [["tiny", model]]
    with pytest.raises(SystemExit, match="--models"):
        main(["--models", "nolabel", "--out", str(tmp_path)])
