"""esroll.curriculum: AdaPrefix's controller holds a simulated problem at its target success rate and its schedule
withdraws the prefix; ADS's weights move toward the clusters at the policy's boundary on a simulated success table and
its choice is deterministic in (seed, step, state). In the trainer, AdaPrefix's forced tokens end the GRPO prompt
(outside the completion mask and token weights), the reward scores prefix + completion as one answer, and held-out
evaluation gets no prefix. (A run with both resumes bit-identically:
tests/test_resume.py::test_a_resumed_run_ends_bit_identical[grpo].)"""

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
    from esroll.config import ExperimentConfig
    from esroll.experiment import check_names

    cfg = ExperimentConfig(curriculum=C.CurriculumConfig(prefix_source="answer"))  # a name: checked by check_names
    with pytest.raises(
        ConfigError,
        match=r"^config: invalid value for 'curriculum.prefix_source': 'answer' \(expected one of solution, target\)$",
    ):
        check_names(cfg)
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
    assert comp.configs["grpo_acpo"].grpo.variants == ("acpo",) and comp.configs["grpo_acpo"].grpo.inner_iterations == 2
    assert comp.configs["looroll_adaprefix"].curriculum.prefix and comp.configs["looroll_adaprefix"].method == "looroll"
    assert all(cfg.data.min_difficulty == 2 for cfg in comp.configs.values())


# ---- AdaPrefix in the trainer: the prefix is prompt (outside the GRPO loss), scored with the completion


@pytest.fixture(scope="module")
def adaprefix_grpo():
    """grpo_quick on the shipped model with AdaPrefix on (half of each worked solution given at step 0), its task on
    a 1-device mesh, and the training loop's `Curriculum`."""
    import dataclasses

    from esroll import parallel
    from esroll.data import make_splits
    from esroll.task import load_task
    from esroll.curriculum import Curriculum

    from conftest import quick_config

    cfg = quick_config("grpo_quick")
    cur = C.CurriculumConfig(prefix=True, prefix_source="solution", prefix_init=0.5, prefix_horizon=100)
    cfg = dataclasses.replace(cfg, curriculum=cur)
    train, held_out = make_splits(cfg.data)
    mesh = parallel.make_mesh(1)
    task, params = load_task(cfg, train, held_out, mesh)
    return cfg, train, held_out, task, params, mesh, Curriculum(cfg, train, task.tokenizer)


@pytest.mark.e2e
def test_adaprefix_prefix_is_prompt_and_outside_the_grpo_loss(adaprefix_grpo, monkeypatch):
    """One GRPO step on a batch of AdaPrefix examples (k_e > 0 tokens of each solution): `generate` decodes from the
    plain prompt followed by exactly those k_e tokens, and the update is conditioned on that same prompt while what
    it scores (completion, completion mask, token weights) is what `generate` produced alone: the mask is the
    generated length, and the weights are normalised by it (seq_mean_token_mean: 1 / (len · B)), never by k_e + len."""
    import dataclasses

    import jax

    from esroll import grpo, rollout
    from esroll.grpo import method as grpo_method

    cfg, train, _, task, params, mesh, batches = adaprefix_grpo
    examples, idx, given = batches.batch(0)
    assert given.min() > 0 and all(e.prefix for e in examples)  # every prompt is assisted

    decoded, updated = [], []
    real_generate, real_make_update = rollout.generate, grpo.make_update

    def recording_generate(model_cfg, params, prompt, key, **kwargs):
        gen = real_generate(model_cfg, params, prompt, key, **kwargs)
        decoded.append(jax.device_get((prompt, kwargs["prompt_mask"], gen.tokens, gen.lengths)))
        return gen

    def recording_make_update(*args, **kwargs):
        update = real_make_update(*args, **kwargs)

        def recorded(params, state, batch, on_policy, *teacher_head):
            updated.append(jax.device_get(batch))
            return update(params, state, batch, on_policy, *teacher_head)

        return recorded

    monkeypatch.setattr(rollout, "generate", recording_generate)
    monkeypatch.setattr(grpo_method, "make_update", recording_make_update)
    method = grpo.make_grpo_method(cfg, task, mesh)
    method.step(params, method.init(params, jax.random.key(0)), examples, 0)
    ((gen_prompt, gen_prompt_mask, gen_tokens, gen_lengths),), (batch,) = decoded, updated

    M, N = cfg.grpo.group_size, cfg.train.max_new_tokens
    B = len(examples) * M
    assert batch.prompt.shape[:2] == (1, B) and gen_tokens.shape == (B, N)  # one microbatch, one decoding chunk
    np.testing.assert_array_equal(batch.prompt[0], gen_prompt)
    np.testing.assert_array_equal(batch.prompt_mask[0], gen_prompt_mask)
    for r in range(B):
        x = r // M
        plain = task.prompt_ids([dataclasses.replace(examples[x], prefix="")])[0]
        prefix_ids = batches.source_ids[idx[x]][: given[x]]
        assert len(prefix_ids) == given[x]
        assert gen_prompt[r][gen_prompt_mask[r]].tolist() == plain + prefix_ids, r  # the forced tokens end the prompt
        length = int(gen_lengths[r])
        assert 1 <= length <= N
        np.testing.assert_array_equal(batch.completion[0, r, :length], gen_tokens[r, :length])  # generated only
        np.testing.assert_array_equal(batch.completion_mask[0, r], np.arange(N) < length)
        expected_w = np.where(np.arange(N) < length, 1.0 / (length * B), 0.0)
        np.testing.assert_allclose(batch.weight[0, r], expected_w, rtol=1e-6, atol=0)
    assert float(batch.weight.sum()) == pytest.approx(1.0, rel=1e-5)


def test_adaprefix_reward_scores_prefix_and_completion_as_one_answer(adaprefix_grpo):
    """`Task.rewards` (and the answer ids and evaluation scores, from the same text) read prefix + completion: the
    whole reference answer as prefix with only EOS generated earns 1, the same EOS without the prefix 0; an answer
    split between prefix and completion earns 1, and a prefix followed by a wrong tail 0."""
    import dataclasses

    from esroll.rewards import answer_id

    _, train, _, task, _, _, _ = adaprefix_grpo
    e = next(e for e in train if e.answer == "153")  # target_text " 153", solution "86 + 67 = 153\n#### 153"
    assert e.target_text == " 153" and e.solution.endswith("#### 153")
    eos = task.eos_ids[0]
    head = e.solution[: e.solution.rindex("####") + 5]  # the worked solution up to "#### "
    cases = [  # (prefix, completion text, reward)
        (e.target_text, "", 1.0),  # the whole answer is the prefix; the policy only ends it
        ("", "", 0.0),  # the same completion alone answers nothing
        (e.solution, "", 1.0),  # the whole worked solution as prefix (prefix_source="solution")
        (" 15", "3", 1.0),  # split between prefix and completion
        (" 15", "4", 0.0),  # the prefix alone, a wrong tail
        (e.target_text, " 7", 0.0),  # the whole answer, then a wrong final number
        (head, "153", 1.0),
        (head, "154", 0.0),
        ("", " 153", 1.0),  # unaided
    ]
    N = 8
    tokens = np.full((len(cases), N), task.pad_id, np.int32)
    lengths = np.zeros(len(cases), np.int32)
    for r, (_, text, _) in enumerate(cases):
        ids = task.tokenizer.encode(text, add_special_tokens=False) + [eos]
        tokens[r, : len(ids)], lengths[r] = ids, len(ids)
    examples = [dataclasses.replace(e, prefix=prefix) for prefix, _, _ in cases]
    expected = np.array([reward for _, _, reward in cases], np.float32)
    np.testing.assert_array_equal(task.rewards(examples, tokens, lengths), expected)
    np.testing.assert_array_equal(task.eval_scores(examples, tokens, lengths)[:, 0], expected)
    ids = task.answer_ids(examples, tokens, lengths)
    assert ids[3] == ids[0] == answer_id("153") and ids[4] == answer_id("154") and ids[1] == -1


@pytest.mark.e2e
def test_evaluation_is_unaided_while_adaprefix_is_on(adaprefix_grpo, tmp_path, monkeypatch):
    """A 2-step GRPO run with AdaPrefix giving the whole direct answer (prefix_init 1): every training rollout is
    assisted, yet every held-out evaluation (step 0, 1 and 2) decodes the held-out questions exactly as the data
    made them, with no prefix, from the plain prompts."""
    import dataclasses

    from esroll import grpo, train as trainer
    from esroll.train import train_and_evaluate

    cfg, _, held_out, task, _, _, _ = adaprefix_grpo
    cur = dataclasses.replace(cfg.curriculum, prefix_source="target", prefix_init=1.0)
    run = dataclasses.replace(cfg.train, steps=2, eval_every=1, checkpoint_every=100, export=False)
    cfg = dataclasses.replace(cfg, curriculum=cur, train=run)
    calls = {"eval": [], "train": []}

    def recording(kind, real):
        def wrapped(task, mesh, params, examples, example_B, *args, **kwargs):
            out = real(task, mesh, params, examples, example_B, *args, **kwargs)
            calls[kind].append((list(examples), out))
            return out

        return wrapped

    monkeypatch.setattr(trainer, "rollout", recording("eval", trainer.rollout))  # `evaluate`'s only decoder
    monkeypatch.setattr(grpo.method, "rollout", recording("train", grpo.method.rollout))
    train_and_evaluate(cfg, tmp_path, mesh_devices=1, progress=False)

    assert len(calls["train"]) == 2
    for examples, _ in calls["train"]:  # assistance is on: the whole answer, " <n>", precedes each completion
        assert [e.prefix for e in examples] == [e.target_text for e in examples]
    assert len(calls["eval"]) == 3  # before training and after each step (32 questions: one rollout each)
    plain_prompts = task.prompt_ids(held_out)
    for examples, out in calls["eval"]:
        assert examples == held_out and all(e.prefix == "" for e in examples)
        assert np.all(out.example_B >= 0)  # 32 questions, one unpadded rollout
        for r, x in enumerate(out.example_B):
            assert out.prompt_BxP[r][out.prompt_mask_BxP[r]].tolist() == plain_prompts[x]
