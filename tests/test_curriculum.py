"""esroll.curriculum: AdaPrefix's controller holds a simulated problem at its target success rate and its schedule
withdraws the prefix; ADS's weights move toward the clusters at the policy's boundary on a simulated success table
and its choice is deterministic in (seed, step, state). (A run with both resumes bit-identically:
test_grpo.py::test_resume_is_exact.)"""

from __future__ import annotations

import numpy as np
import pytest

from esroll import curriculum as C
from esroll.errors import ConfigError


def test_prefix_controller_converges_to_the_target_success_rate():
    """One problem of 12 solution tokens whose success probability is a known function of the prefix given,
    p(k) = min(1, k / 8): the controller (8 samples a step) settles where p(k) = 1/2, k = 4."""
    rng = np.random.default_rng(0)
    cfg = C.CurriculumConfig(prefix=True, prefix_gain=2.0)
    lengths = np.array([12])
    k = C.prefix_init(lengths, 0.0)
    history = []
    for _ in range(400):
        success = rng.binomial(8, min(1.0, k[0] / 8)) / 8
        history.append(success)
        k = C.prefix_update(k, np.array([0]), np.array([success]), lengths, cfg.prefix_target, cfg.prefix_gain)
    assert abs(np.mean(history[200:]) - 0.5) < 0.05
    assert 3.0 < np.mean(k) < 5.0
    # never beyond the solution, never negative
    assert C.prefix_update(np.array([11.5]), np.array([0]), np.array([0.0]), lengths, 0.5, 2.0)[0] == 12
    assert C.prefix_update(np.array([0.5]), np.array([0]), np.array([1.0]), lengths, 0.5, 2.0)[0] == 0


def test_prefix_schedule_withdraws_all_assistance_by_the_horizon():
    k = np.array([0.0, 3.0, 10.0])
    np.testing.assert_array_equal(C.prefix_tokens(k, 0, 100), [0, 3, 10])
    np.testing.assert_array_equal(C.prefix_tokens(k, 50, 100), [0, 2, 5])  # round(1.5) = 2 (half to even)
    for step in (100, 500):
        assert C.prefix_tokens(k, step, 100).sum() == 0


def test_ads_weights_move_toward_the_boundary_cluster():
    """Three clusters whose true success rates are 0, 0.5 and 1: as the scheduler learns them, the boundary cluster
    (0.5) gets the largest weight and most of the draws; the choice repeats exactly for the same (seed, step, state)."""
    rng = np.random.default_rng(1)
    cluster_of = np.repeat([0, 1, 2], 50)
    true = np.array([0.0, 0.5, 1.0])
    cfg = C.CurriculumConfig(ads=True, ads_temperature=3.0)
    state = C.ads_init(cluster_of)
    first = C.ads_weights(state, cfg.ads_temperature)
    np.testing.assert_allclose(first, 1 / 3)  # no history: uniform
    for step in range(60):
        idx = C.ads_select(state, cluster_of, 16, cfg, seed=0, step=step)
        success = rng.binomial(8, true[cluster_of[idx]]) / 8
        state = C.ads_update(state, cluster_of, idx, success, cfg.ads_decay)
    w = C.ads_weights(state, cfg.ads_temperature)
    assert w[1] > 0.6 and w[1] > 3 * max(w[0], w[2])
    idx = C.ads_select(state, cluster_of, 16, cfg, seed=0, step=60)
    assert np.mean(cluster_of[idx] == 1) > 0.7
    np.testing.assert_array_equal(idx, C.ads_select(state, cluster_of, 16, cfg, seed=0, step=60))
    metrics = C.ads_metrics(state, idx, ["a", "b", "c"], cfg.ads_temperature)
    assert metrics["ads_weight[b]"] == pytest.approx(w[1]) and 0 <= metrics["ads_boundary"] <= 1


def test_options_are_checked():
    with pytest.raises(ConfigError, match="prefix_source"):
        C.CurriculumConfig(prefix_source="answer")
    with pytest.raises(ConfigError, match="ads_decay"):
        C.CurriculumConfig(ads_decay=1.0)


def test_training_loop_comparison_variants_build():
    from configs import training_loop
    from esroll.compare import comparison_from_dict

    for variant in training_loop.VARIANTS:
        comp = comparison_from_dict(training_loop.get_config(variant).to_dict())
        assert comp.reference == "grpo" and comp.reference in comp.configs
    comp = comparison_from_dict(training_loop.get_config().to_dict())
    assert set(comp.configs) == set(training_loop.ARMS)
    assert comp.configs["grpo_acpo"].grpo.acpo and comp.configs["grpo_acpo"].grpo.inner_iterations == 2
    assert comp.configs["looroll_adaprefix"].curriculum.prefix and comp.configs["looroll_adaprefix"].method == "looroll"
    assert all(cfg.data.min_difficulty == 2 for cfg in comp.configs.values())
