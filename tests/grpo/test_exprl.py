"""ExpRL's DeltaNorm (`grpo.advantage = "exprl"`) on hand-built groups and on the judge's scores of hand-written
solutions, and a training step of GRPO with it and of LOO-ROLL with the judge's dense fitness, by name. Expected
credits are worked out by hand in each test from the prefix scores written beside them."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from configs.step_level import get_config
from esroll.data import Example
from esroll.es.method import make_es_method
from esroll.grpo import advantages as A
from esroll.grpo import make_grpo_method
from esroll.grpo.estimators.exprl import delta_norm
from esroll.steps import STEP_VERIFIERS, Steps

from conftest import shipped_config


def test_delta_norm_by_hand():
    """s = 0.25, 0.75, 1, 1: the first step gets s_1 − s_K = −0.75, then the rises 0.5, 0.25, 0."""
    np.testing.assert_allclose(delta_norm([0.25, 0.75, 1.0, 1.0]), [-0.75, 0.5, 0.25, 0.0])
    np.testing.assert_allclose(delta_norm([0.5]), [0.5])  # one step: its rise from 0
    np.testing.assert_allclose(delta_norm([0.0, 0.5, 0.25]), [-0.25, 0.5, -0.25])
    # "rise": the first step keeps its rise from 0, and the credits sum to s_K
    np.testing.assert_allclose(delta_norm([0.25, 0.75, 1.0, 1.0], "rise"), [0.25, 0.5, 0.25, 0.0])
    np.testing.assert_allclose(delta_norm([0.5], "rise"), [0.5])


def test_exprl_options_are_checked():
    from esroll.config import ConfigError
    from esroll.grpo.estimators.exprl import ExprlOptions

    with pytest.raises(ConfigError, match="first_step"):
        ExprlOptions(first_step="last")


def _group(rewards, step_BxN, scores):
    rewards = np.asarray(rewards, np.float64)
    X, M = rewards.shape
    step_BxN = np.asarray(step_BxN)
    N = step_BxN.shape[1]
    count_B = np.where(step_BxN >= 0, step_BxN + 1, 0).max(1)
    return A.Group(
        rewards,
        token_logp=np.zeros((X, M, N)),
        token_mask=(step_BxN >= 0).reshape(X, M, N),
        steps=Steps(step_BxN, count_B, (), ()),
        step_scores=np.asarray(scores, np.float64).reshape(X, M, -1),
    )


def test_exprl_credits_each_steps_tokens_and_drops_what_it_cannot_judge():
    """Five rows of a 6-token budget. Row 0: steps of 2, 2, 1 tokens, scores 0.25, 0.75, 1 → −0.75, 0.5, 0.25.
    Row 1 fills the budget (length-clipped): 0. Row 2: an unreadable judgement (NaN) on its second step: dropped,
    0 and loss weight 0. Row 3: one step, 0.5 → 0.5 (its rise from 0). Row 4: an invalid reward: 0. Loss weight 0
    on row 2 alone: a clipped or invalid row stays in the loss with advantage 0."""
    nan = math.nan
    step = [
        [0, 0, 1, 1, 2, -1],
        [0, 0, 0, 1, 1, 1],
        [0, 1, 1, -1, -1, -1],
        [0, 0, 0, -1, -1, -1],
        [0, 1, -1, -1, -1, -1],
    ]
    scores = [[0.25, 0.75, 1.0], [0.0, 1.0, nan], [0.5, nan, nan], [0.5, nan, nan], [0.0, 1.0, nan]]
    g = _group([[1, 1, 0, 0, nan]], step, scores)
    out = A.estimate("exprl", g)
    expected = np.zeros((1, 5, 6))
    expected[0, 0, :5] = [-0.75, -0.75, 0.5, 0.5, 0.25]
    expected[0, 3, :3] = 0.5
    np.testing.assert_allclose(out.advantage, expected, atol=1e-7)
    np.testing.assert_array_equal(out.token_weight[0, :, 0], [1, 1, 0, 1, 1])
    assert out.metrics["exprl_dropped"] == pytest.approx(1 / 5)
    assert out.metrics["exprl_clipped"] == pytest.approx(1 / 5)
    assert out.metrics["exprl_final_score"] == pytest.approx((1.0 + 0.5) / 2)
    assert out.metrics["exprl_credit_abs"] == pytest.approx((0.75 + 0.5 + 0.25 + 0.5) / 4)


SOLUTIONS = [
    "67+56=123\n123+34=157\n157+37=194\n#### 194",  # right: s 0.25, 0.75, 1, 1
    "67+56=123\n123+34=158\n158+37=195\n#### 195",  # wrong from line 2: 0.25 throughout
    "67+56=123\n123+34=157\n157+37=190\n#### 190",  # wrong on line 3: 0.25, 0.75, 0.75, 0.75
    "#### 194",  # the answer alone: one step
]


def test_the_judges_scores_of_hand_written_solutions_give_credits_that_sum_to_zero():
    """Through the `exprl` verifier: the right solution's credits −0.75, 0.5, 0.25, 0; the solution that goes wrong
    on line 2 gets 0 everywhere (no rise after its first step, s_1 = s_K); the one wrong on line 3 gets −0.5, 0.5, 0, 0
    (its first step carries the whole rise back); a one-step row gets its score, 0.25. Each row with more than one
    step sums to 0."""
    e = Example("arith_steps", "67+56+34+37=?", "194", SOLUTIONS[0], "")
    verifier = STEP_VERIFIERS.lookup("exprl")
    expected = [[-0.75, 0.5, 0.25, 0.0], [0.0] * 4, [-0.5, 0.5, 0.0, 0.0], [0.25]]
    for text, want in zip(SOLUTIONS, expected):
        credit = delta_norm(verifier(e, text.splitlines(keepends=True)))
        np.testing.assert_allclose(credit, want, atol=1e-12)
        assert len(want) == 1 or abs(credit.sum()) < 1e-12


@pytest.mark.e2e
def test_grpo_with_deltanorm_and_looroll_with_the_judges_fitness_train_by_name():
    """`configs/step_level.py:quick,exprl` takes GRPO steps with DeltaNorm (the judge as steps.verifier), and
    `looroll,exprl_fitness,quick` LOO-ROLL steps whose fitness mixes in the judge's mean prefix score; the variant on
    a GRPO method is refused."""
    from esroll import parallel
    from esroll.data import get_batch, make_splits
    from esroll.task import load_task

    mesh = parallel.make_mesh(1)
    for variant, make in (("quick,exprl", make_grpo_method), ("looroll,exprl_fitness,quick", make_es_method)):
        cfg = shipped_config(get_config, variant)
        assert cfg.steps.verifier == "exprl"
        train, held_out = make_splits(cfg.data)
        task, params = load_task(cfg, train, held_out, mesh)
        method = make(cfg, task, mesh)
        out = method.step(params, method.init(params, jax.random.key(0)), get_batch(train, 4, 0, 0), 0)
        key = "exprl_final_score" if make is make_grpo_method else "step_score_mean"
        assert 0.0 < out.metrics[key] <= 1.0, out.metrics  # some row reached a reference value
        if make is make_grpo_method:
            assert out.metrics["exprl_credit_abs"] > 0 and out.metrics["exprl_dropped"] == 0.0
        assert all(bool(np.isfinite(x).all()) for x in jax.tree.leaves(out.params))
    with pytest.raises(ValueError, match="exprl_fitness is a fitness of looroll"):
        get_config("grpo,exprl_fitness")
