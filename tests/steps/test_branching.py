"""Steps in the rollout, branched rollouts and Monte Carlo step values, on the shipped model that writes worked
solutions (`assets/tiny-qwen3-steps`): a rollout's steps and step scores are those of its completions' text; a branch
continued from a step boundary is what `generate` samples with the prefix in the prompt, and at temperature 0 it
rewrites the original completion; `mc_steps` on a hand-built case; configs/step_level.py's variants."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from configs.step_level import get_config
from esroll import parallel
from esroll.config import StepsConfig, from_config_dict
from esroll.data import get_batch, make_splits
from esroll.experiment import check_names, unread_keys
from esroll.grpo import advantages, make_grpo_method
from esroll.grpo.estimators.mc_steps import step_values
from esroll.rollout import Sampling, rollout
from esroll.steps import branch, branch_at, with_steps
from esroll.sampling import generate, pad_prompts
from esroll.steps import Steps
from esroll.task import load_task
from esroll.steps.verify import equations

from conftest import REPO

N = 40


def _config(variant: str = "grpo,quick"):
    cd = get_config(variant)
    cd.model.path = str(REPO / "assets" / "tiny-qwen3-steps")
    return check_names(from_config_dict(cd.to_dict()))


@pytest.fixture(scope="module")
def steps_task():
    cfg = _config()
    train, held_out = make_splits(cfg.data)
    mesh = parallel.make_mesh(1)
    task, params = load_task(cfg, train, held_out, mesh)
    return cfg, task, params, held_out[:6], mesh


def test_a_rollouts_steps_and_scores_are_those_of_its_text(steps_task):
    cfg, task, params, examples, mesh = steps_task
    out = rollout(
        task, mesh, params, examples, np.repeat(np.arange(6), 2), jax.random.key(1), Sampling(N, 1.0), completions=True
    )
    out = with_steps(out, task, examples, StepsConfig(), scored=True)
    texts = task.texts(out.tokens_BxN, out.length_B)
    assert out.steps.count_B.sum() > 12 and np.isnan(out.step_scores_BxJ[:, out.steps.count_B.max() :]).all()
    for b, text in enumerate(texts):
        assert "".join(out.steps.text[b]) == text and len(out.steps.text[b]) == max(1, text.count("\n") + 1) - (
            text.endswith("\n")
        )
        count = out.steps.count_B[b]
        np.testing.assert_array_equal(out.step_scores_BxJ[b, :count], equations(examples[b // 2], out.steps.text[b]))
    assert 0 < np.nanmean(out.step_scores_BxJ) < 1  # the model makes some errors, and not only errors


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_a_branch_continues_as_generate_does_with_the_prefix_in_the_prompt(steps_task, temperature):
    """Each branch (prefix = a completion through one of its steps) against `generate` run on its own with prompt +
    prefix as the prompt (the branch's key and row): the same continuation tokens, log-probabilities within 1e-5.
    Greedy, every branch also rewrites its original completion: tokens identical, log-probabilities within 1e-5."""
    cfg, task, params, examples, mesh = steps_task
    sampling = Sampling(N, temperature)
    out = rollout(task, mesh, params, examples, np.arange(6), jax.random.key(2), sampling, completions=True)
    out = with_steps(out, task, examples, StepsConfig(max_steps=8))
    key = jax.random.key(3)
    branched, origin = branch(task, mesh, params, examples, out, key, sampling, branches=2)
    assert len(origin) == 2 * (out.steps.count_B - 1).sum() > 0
    np.testing.assert_array_equal(branched.prefix_B, [out.steps.end[b][s] for b, s in origin])
    prompts = task.prompt_ids(examples)
    fresh_rows = set(np.flatnonzero(np.diff(origin[:, 0], prepend=-1))[:2])  # the first branch of 2 completions
    for r, (b, s) in enumerate(origin):
        k = out.steps.end[b][s]
        np.testing.assert_array_equal(branched.tokens_BxN[r, :k], out.tokens_BxN[b, :k])
        assert not branched.logprobs_BxN[r, :k].any()
        if temperature == 0:
            assert branched.length_B[r] == out.length_B[b] and branched.reward_B[r] == out.reward_B[b]
            np.testing.assert_array_equal(branched.tokens_BxN[r], out.tokens_BxN[b])
            np.testing.assert_allclose(branched.logprobs_BxN[r, k:], out.logprobs_BxN[b, k:], atol=1e-5)
        if r not in fresh_rows:
            continue
        tokens, mask = pad_prompts([prompts[b] + list(out.tokens_BxN[b, :k])], multiple=task.prompt_multiple)
        fresh = generate(
            task.cfg, params, tokens, key, max_new_tokens=N - k, temperature=temperature, eos_ids=task.eos_ids,
            prompt_mask=mask, pad_id=task.pad_id, row_offset=r,
        )  # fmt: skip
        n = int(fresh.lengths[0])
        assert branched.length_B[r] == k + n
        np.testing.assert_array_equal(branched.tokens_BxN[r, k : k + n], np.asarray(fresh.tokens)[0, :n])
        np.testing.assert_allclose(branched.logprobs_BxN[r, k : k + n], np.asarray(fresh.logprobs)[0, :n], atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_a_branch_at_a_token_keeps_the_completions_first_t_tokens(steps_task, temperature):
    """`branch_at` (APPO's): each branch from position t is given the completion's first t tokens (`prefix_B` = t,
    no log-probability there) and samples token t onward; greedy, it rewrites the completion. A position at or past
    a completion's end is refused; -1 branches nowhere."""
    cfg, task, params, examples, mesh = steps_task
    sampling = Sampling(N, temperature)
    out = rollout(task, mesh, params, examples, np.arange(4), jax.random.key(4), sampling, completions=True)
    length = out.length_B
    at = np.stack([np.ones(4, int), length // 2, length - 1], 1)
    at[0, 1] = -1
    branched, origin = branch_at(task, mesh, params, examples, out, at, jax.random.key(5), sampling, branches=2)
    assert len(origin) == 2 * 11 and set(origin[:, 1]) == {0, 1, 2}
    for r, (b, k) in enumerate(origin):
        t = at[b, k]
        assert branched.prefix_B[r] == t and not branched.logprobs_BxN[r, :t].any()
        np.testing.assert_array_equal(branched.tokens_BxN[r, :t], out.tokens_BxN[b, :t])
        if temperature == 0:
            np.testing.assert_array_equal(branched.tokens_BxN[r], out.tokens_BxN[b])
            assert branched.reward_B[r] == out.reward_B[b]
    if temperature == 1:
        assert any((branched.tokens_BxN[r] != out.tokens_BxN[b]).any() for r, (b, _) in enumerate(origin))
    with pytest.raises(ValueError, match="past its completion"):
        branch_at(task, mesh, params, examples, out, length[:, None], jax.random.key(5), sampling, branches=1)


def test_mc_steps_on_a_hand_built_case():
    """Prompt 1: two completions, rewards 1 and 0; each one's V(prompt) is the other's reward (leave-one-out).
    Completion 0 has 3 steps; the branches after its step 0 score (1, 0) and after step 1 (1, 1): values 0, 1/2, 1, 1
    (its reward), step advantages 1/2, 1/2, 0. Completion 1 has 2 steps; the branches after its step 0 score (0, 0):
    values 1, 0, 0, advantages −1, 0. Prompt 2: its second completion's reward is NaN (invalid), so the first has no
    other completion to estimate V(prompt) from: its one step's advantage is undefined (NaN) and its tokens get 0;
    the invalid one gets 0 everywhere. `mc_prompt_value`: prompt 1's mean reward, 1/2 (prompt 2 has no estimate).
    With V(prompt) given (fresh rollouts, 1/4 for both prompts), the first steps' advantages are 1/2 − 1/4, 0 − 1/4
    and 1 − 1/4."""
    nan = np.nan
    step_BxN = np.array(
        [
            [0, 0, 1, 1, 2, 2],
            [0, 0, 0, 1, -1, -1],
            [0, 0, 0, -1, -1, -1],
            [0, 1, -1, -1, -1, -1],
        ]
    )
    count_B = np.array([3, 2, 1, 2])
    branch_rewards = np.full((2, 2, 4, 2), nan)
    branch_rewards[0, 0, 0], branch_rewards[0, 0, 1], branch_rewards[0, 1, 0] = (1, 0), (1, 1), (0, 0)
    branch_rewards[1, 1, 0] = (1, 1)
    g = advantages.Group(
        np.array([[1.0, 0.0], [1.0, nan]]),
        token_logp=np.zeros((2, 2, 6)),
        token_mask=(step_BxN >= 0).reshape(2, 2, 6),
        steps=Steps(step_BxN, count_B, (), ()),
        branch_rewards=branch_rewards,
    )
    values, adv = step_values(g)
    np.testing.assert_array_equal(values[0, 0, :4], [0.0, 0.5, 1.0, 1.0])
    np.testing.assert_array_equal(values[0, 1, :3], [1.0, 0.0, 0.0])
    assert np.isnan(values[1, 0, 0]) and values[1, 0, 1] == 1.0 and np.isnan(adv[1, 0, 0])
    assert np.isnan(values[1, 1]).all() and np.isnan(adv[0, 1, 2:]).all()
    out = advantages.estimate("mc_steps", g)
    expected = np.array(
        [
            [0.5, 0.5, 0.5, 0.5, 0, 0],
            [-1, -1, -1, 0, 0, 0],
            [0, 0, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 0],
        ]
    )
    np.testing.assert_array_equal(out.advantage.reshape(4, 6), expected)
    assert out.metrics["mc_prompt_value"] == 0.5
    _, given = step_values(g, np.array([0.25, 0.25]))
    np.testing.assert_array_equal([given[0, 0, 0], given[0, 1, 0], given[1, 0, 0]], [0.25, -0.25, 0.75])


@pytest.mark.e2e
def test_an_mc_steps_step_counts_its_branches(steps_task):
    """One GRPO step with mc_steps against plain GRPO on the same completions (sampling keyed by seed and step): the
    branches' rows are K per step boundary, their generated tokens are counted in the step's tokens and FLOPs, and
    the update is a different one."""
    cfg, task, params, _, mesh = steps_task
    train, _ = make_splits(cfg.data)
    examples = get_batch(train, cfg.train.prompts_per_step, cfg.data.seed, 0)
    outputs = {}
    for variant in ("grpo,quick", "mc_steps,quick"):
        c = _config(variant)
        method = make_grpo_method(c, task, mesh)
        outputs[variant] = method.step(params, method.init(params, jax.random.key(0)), examples, 0)
    plain, mc = outputs["grpo,quick"], outputs["mc_steps,quick"]
    rows = mc.metrics["branch_rows"]
    assert rows > 0 and rows % cfg.steps.branches == 0
    assert rows <= mc.tokens - plain.tokens <= rows * N  # each branch generates at least one token
    assert mc.metrics["flops_generate"] > plain.metrics["flops_generate"]
    assert mc.metrics["reward_mean"] == plain.metrics["reward_mean"]
    assert mc.metrics["grad_norm"] != plain.metrics["grad_norm"]


def test_step_level_config_variants():
    assert _config("grpo").method == "grpo" and _config("looroll").method == "looroll"
    hard = _config("looroll,hard")
    assert (hard.data.options["arith_steps"].min_operands, hard.data.options["arith_steps"].max_operands) == (5, 5)
    mc = _config("mc_steps,quick,hard")
    assert mc.grpo.advantage == "mc_steps" and mc.train.steps == 2
    unread = unread_keys(mc)
    assert "steps.verifier" in unread and "steps.branches" not in unread and "steps.boundary" not in unread
    assert "steps.boundary" in unread_keys(_config("grpo")) and "steps.boundary" in unread_keys(_config("looroll"))
    for bad in ("grpo,looroll", "quick", "grpo,fast", "grpo,quick,quick"):
        with pytest.raises(ValueError, match="configs/step_level.py: variant"):
            get_config(bad)


def test_dense_step_fitness_by_hand():
    """es.step_weight w: (1 − w)·outcome + w·(the row's mean step score over its steps); no steps: 0; a non-finite
    outcome stays non-finite."""
    from esroll.es.method import dense_rewards, mean_step_scores

    reward = np.array([1.0, 0.0, np.nan, 0.5])
    scores = np.array([[1, 0, np.nan], [np.nan] * 3, [1, 1, 1], [0, 1, np.nan]], float)
    np.testing.assert_array_equal(mean_step_scores(scores), [0.5, 0.0, 1.0, 0.5])
    out = dense_rewards(reward, mean_step_scores(scores), 0.5)
    np.testing.assert_array_equal(out[[0, 1, 3]], [0.75, 0.0, 0.5])
    assert np.isnan(out[2]) and out.dtype == np.float32
    kept = [0, 1, 3]
    np.testing.assert_array_equal(dense_rewards(reward[kept], mean_step_scores(scores[kept]), 0.0), [1.0, 0.0, 0.5])


def test_equal_groups_by_hand():
    from esroll.baselines import equal_groups

    rewards = np.array([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])  # groups 0 and 2 all equal
    assert equal_groups(rewards, np.array([0, 0, 1, 0, 0, -0.3])) == {
        "frac_groups_all_equal": 2 / 3,
        "frac_all_equal_signal": 0.5,  # group 2 has a non-zero weight, group 0 none
    }
    assert equal_groups(np.array([[0.0, 1.0]]), np.ones(2)) == {"frac_groups_all_equal": 0.0}


@pytest.mark.e2e
def test_an_es_step_with_the_dense_step_fitness(steps_task):
    """One LOO-ROLL step at es.step_weight 0 and 0.5 from the same state on the same prompts: the members decode the
    same completions (greedy), the outcome is the plain step's reward, the mixed reward is (outcome + mean step
    score) / 2, and the update differs. Outcome-only ES gives no all-equal prompt a signal."""
    from esroll.es.method import make_es_method

    _, task, params, _, mesh = steps_task
    outputs = {}
    for weight in (0.0, 0.5):
        cd = get_config("looroll,quick")
        cd.model.path = str(REPO / "assets" / "tiny-qwen3-steps")
        cd.es.step_weight = weight
        cfg = check_names(from_config_dict(cd.to_dict()))
        assert ("steps.verifier" in unread_keys(cfg)) == (weight == 0) and "steps.branches" in unread_keys(cfg)
        train, _ = make_splits(cfg.data)
        examples = get_batch(train, cfg.train.prompts_per_step, cfg.data.seed, 0)
        method = make_es_method(cfg, task, mesh)
        state = method.init(jax.tree.map(np.array, params), jax.random.key(0))
        outputs[weight] = method.step(jax.tree.map(np.array, params), state, examples, 0)
    plain, dense = outputs[0.0].metrics, outputs[0.5].metrics
    assert "step_score_mean" not in plain and 0 < dense["step_score_mean"] <= 1
    assert dense["outcome_mean"] == plain["reward_mean"] and outputs[0.0].tokens == outputs[0.5].tokens
    assert dense["reward_mean"] == pytest.approx(0.5 * dense["outcome_mean"] + 0.5 * dense["step_score_mean"])
    assert plain.get("frac_all_equal_signal", 0.0) == 0.0 and dense["frac_groups_all_equal"] > 0
    flat = [np.asarray(x, np.float64) for x in jax.tree.leaves((outputs[0.0].params, outputs[0.5].params))]
    half = len(flat) // 2
    assert any(not np.array_equal(a, b) for a, b in zip(flat[:half], flat[half:]))
