"""An ES member's fitness from its rows (`esroll.es.method.member_fitness`): max@K over its samples, per-prompt
shaping across the members, the label-free vote over every member's samples, non-finite rewards; prompt shapings
that shift every fitness alike leave both estimators' weights as raw fitness gives them (docs/theory.md); and a
label-free LOO-ROLL run with two samples per prompt."""

from __future__ import annotations

import numpy as np
import pytest


def test_es_member_fitness_counterparts():
    """ES's counterparts: max@K over each member's K samples, GRPO's per-prompt normalisation across the members,
    and the label-free reward as the majority answer over every member's samples of a prompt."""
    from esroll.es.strategy import ESSettings
    from esroll.es.method import member_fitness
    from esroll.rollout import Rollout, prompt_means, training_rewards

    M, X, K = 3, 2, 2
    # rows (member, prompt, sample): member 0 solves prompt 0 once, member 1 both prompts always, member 2 nothing
    reward = np.array([[[1, 0], [0, 0]], [[1, 1], [1, 1]], [[0, 0], [0, 0]]], np.float32).ravel()
    mean = member_fitness(ESSettings(samples=K), reward, M, X)
    np.testing.assert_allclose(mean, [0.25, 1.0, 0.0])
    best = member_fitness(ESSettings(samples=K, sample_reduce="max"), reward, M, X)
    np.testing.assert_allclose(best, [0.5, 1.0, 0.0])
    # per prompt across members (dr_grpo: minus the members' mean): the max@2 means are 2/3 and 1/3
    centred = member_fitness(ESSettings(samples=K, sample_reduce="max", prompt_shaping="dr_grpo"), reward, M, X)
    expected = [(1 - 2 / 3 + 0 - 1 / 3) / 2, (1 - 2 / 3 + 1 - 1 / 3) / 2, (-2 / 3 - 1 / 3) / 2]
    np.testing.assert_allclose(centred, expected, atol=1e-6)
    # label-free: prompt 0's six answers are 4,4,4,4,7,7 -> 4 is the majority; prompt 1's 5,5,5,5,9,9
    answers = np.array([[[4, 7], [5, 9]], [[4, 4], [5, 5]], [[4, 7], [5, 9]]]).ravel()
    example_B = np.tile(np.repeat(np.arange(X), K), M)  # the ES rows' layout: member, prompt, sample
    out = Rollout(example_B, None, None, reward, None, None, None, None, answers)
    votes, extra = training_rewards(out, label_free=True)
    np.testing.assert_array_equal(votes, [1, 0, 1, 0, 1, 1, 1, 1, 1, 0, 1, 0])
    np.testing.assert_allclose(member_fitness(ESSettings(samples=K), votes, M, X), [0.5, 1.0, 0.5])
    assert extra["pseudo_label_agreement"] == pytest.approx(np.mean(votes == reward))
    assert extra["gold_reward_mean"] == pytest.approx(reward.mean())
    np.testing.assert_allclose(prompt_means(example_B, votes, X), [4 / 6, 4 / 6])  # over members and samples
    np.testing.assert_allclose(prompt_means(example_B, reward, X), [3 / 6, 2 / 6])
    # a non-finite reward makes its member's fitness non-finite (the strategy drops it), whatever the shaping, and so
    # does a non-finite gold reward behind a finite vote
    broken = reward.copy()
    broken[5] = np.nan  # member 1, prompt 0, sample 1
    for shaping in ("raw", "grpo"):
        fitness = member_fitness(ESSettings(samples=K, prompt_shaping=shaping), broken, M, X)
        assert np.isnan(fitness[1]) and np.isfinite(fitness[[0, 2]]).all()
    fitness = member_fitness(ESSettings(samples=K), votes, M, X, gold_B=broken)
    assert np.isnan(fitness[1]) and np.isfinite(fitness[[0, 2]]).all()


@pytest.mark.parametrize("method", ["looroll", "eggroll"])
def test_es_prompt_shaping_by_a_common_shift_leaves_the_estimate_as_raw(method):
    """docs/theory.md: dr_grpo and rloo prompt shaping shift every member's fitness alike (rloo also scales it by
    M/(M − 1)), which both estimators cancel; the shapings that divide by (or rank against) the members' rewards
    change the weights member by member, coupling each member's fitness to the others' perturbations."""
    from esroll.es.estimators import direction_weights
    from esroll.es.strategy import ESSettings
    from esroll.es.method import member_fitness

    M, X = 6, 5
    reward = np.random.default_rng(14).random(M * X).astype(np.float32)

    def weights(prompt_shaping):
        fitness = member_fitness(ESSettings(prompt_shaping=prompt_shaping), reward, M, X)
        return np.asarray(direction_weights(method, fitness, 0.1).w_E, np.float64)

    raw = weights("raw")
    assert np.any(raw != 0)
    np.testing.assert_allclose(weights("dr_grpo"), raw, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(weights("rloo"), raw * M / (M - 1), rtol=1e-5, atol=1e-6)
    for name in ("zscore", "grpo", "centered_ranks"):
        w = weights(name)
        assert not np.allclose(w * (w @ raw) / (w @ w), raw, rtol=1e-3), name  # not even proportional to raw


@pytest.mark.e2e
def test_es_label_free_with_two_samples_per_prompt_trains(tmp_path):
    """LOO-ROLL label-free (the majority answer over the population's samples) with 2 samples per prompt and max@2
    fitness: it takes its step (rows laid out member, prompt, sample) and logs how often the vote agrees with gold.
    GRPO's label-free, single-rollout and stateful estimators run in test_compare's advantage comparison. (2 prompts
    of 2 samples: the quick run's rows per step.)"""
    from configs.default import get_config
    from esroll.config import from_config_dict
    from esroll.metrics import read_metrics
    from esroll.train import train_and_evaluate

    from conftest import SHIPPED_MODEL

    cd = get_config("quick")
    cd.model.path = SHIPPED_MODEL
    cd.data.reward = "majority"
    cd.es.update(samples=2, sample_reduce="max")
    cd.train.update(steps=1, prompts_per_step=2, eval_every=2, checkpoint_every=2, export=False, temperature=1.0)
    train_and_evaluate(from_config_dict(cd.to_dict()), tmp_path, progress=False)
    records = read_metrics(tmp_path / "metrics.jsonl")
    population, prompts = cd.es.population, cd.train.prompts_per_step
    assert records[1]["completions"] == population * prompts * 2 and 0 <= records[1]["pseudo_label_agreement"] <= 1
    assert "eval_accuracy" in records[-1]
