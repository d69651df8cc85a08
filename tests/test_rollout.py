"""The one rollout: row → example maps, padding rows, perturbations, one exchange, any mesh."""

from __future__ import annotations

import re

import jax
import numpy as np
import optax
import pytest

from esroll import es, parallel, sharding
from esroll.data import get_batch, make_splits
from esroll.models import Perturbation
from esroll.rollout import PAD, Sampling, rollout
from esroll.sampling import generate, pad_prompts
from esroll.task import load_task

from conftest import REPO, quick_config


@pytest.fixture(scope="module")
def setup():
    cfg = quick_config("quick")
    train, held_out = make_splits(cfg.data)
    task, params = load_task(cfg, train, held_out)
    return cfg, task, params, get_batch(train, 5, 0, 1)


def direct(task, params, examples, example_B, key, sampling, perturb=None):
    """What the rollout must equal: generate on one device over explicitly built rows, then score row by row."""
    tokens, mask = pad_prompts(task.prompt_ids(examples), multiple=task.prompt_multiple, pad_id=task.pad_id)
    gen = generate(
        task.cfg,
        params,
        tokens[example_B],
        key,
        max_new_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        eos_ids=task.eos_ids,
        prompt_mask=mask[example_B],
        perturb=perturb,
        pad_id=task.pad_id,
    )
    toks, lengths = np.asarray(gen.tokens), np.asarray(gen.lengths)
    rewards = task.rewards([examples[e] for e in example_B], toks, lengths)
    return toks, lengths, rewards, np.asarray(gen.logprobs)


@pytest.mark.parametrize("devices,model,rows_per_device", [(1, 1, 0), (8, 1, 0), (1, 1, 4), (8, 2, 1)])
def test_es_rows_with_perturbation_equal_direct_generation(setup, devices, model, rows_per_device):
    """Member-major ES rows (3 members × 5 prompts = 15 rows, padded to 16 on 8 devices): tokens, lengths, rewards
    and log-probabilities equal one-device generation over the same rows, scored row by row — decoded all at once
    or in chunks of `rows_per_device` rows per device (4 chunks of 4 on one device; 4 of 4 rows, one per data shard,
    on 4 × 2), on a data-only mesh or a 4 × 2 (data × model) one with the weights split over the model axis."""
    cfg, task, params, examples = setup
    M, X = 3, len(examples)
    strategy = es.make_strategy(es.ESConfig(population=M, sigma=0.005), optax.sgd(0.0))
    state = strategy.init(params, jax.random.key(0))
    deltas = strategy.ask(state, params)
    example_B, member_B = np.tile(np.arange(X), M), np.repeat(np.arange(M, dtype=np.int32), X)
    sampling = Sampling(6, temperature=0.3, rows_per_device=rows_per_device)
    key = jax.random.key(3)
    mesh = parallel.make_mesh(devices, model=model)
    out = rollout(
        task,
        mesh,
        sharding.place(params, sharding.compute_shardings(mesh, params)),
        examples,
        example_B,
        key,
        sampling,
        deltas=deltas,
        member_B=member_B,
        completions=True,
    )
    toks, lengths, rewards, logprobs = direct(
        task, params, examples, example_B, key, sampling, Perturbation(deltas, member_B)
    )
    assert out.reward_B.shape == (M * X,) and out.reward_B.dtype == np.float32
    np.testing.assert_array_equal(out.tokens_BxN, toks)
    np.testing.assert_array_equal(out.length_B, lengths)
    np.testing.assert_array_equal(out.reward_B, rewards)
    np.testing.assert_allclose(out.logprobs_BxN, logprobs, atol=1e-5)
    np.testing.assert_array_equal(out.example_B, example_B)
    assert rewards.sum() > 0 and (lengths > 1).all()  # real answers, some right


def test_padding_rows_are_empty_and_leave_the_others_alone(setup):
    cfg, task, params, examples = setup
    mesh = parallel.make_mesh(1)
    sampling = Sampling(6)
    plain = rollout(task, mesh, params, examples, np.arange(5), jax.random.key(0), sampling, completions=True)
    padded = rollout(
        task,
        mesh,
        params,
        examples,
        np.array([0, PAD, 1, 2, PAD, 3, 4, PAD]),
        jax.random.key(0),
        sampling,
        completions=True,
    )
    real = padded.example_B != PAD
    assert (padded.reward_B[~real] == 0).all() and (padded.length_B[~real] == 0).all()
    assert not padded.prompt_mask_BxP[~real].any()
    np.testing.assert_array_equal(padded.tokens_BxN[real], plain.tokens_BxN)  # greedy: the rows' own answers
    np.testing.assert_array_equal(padded.reward_B[real], plain.reward_B)
    # Without completions, nothing but the outcome crosses processes.
    lean = rollout(task, mesh, params, examples, np.arange(5), jax.random.key(0), sampling)
    assert lean.tokens_BxN is None and lean.logprobs_BxN is None
    np.testing.assert_array_equal(lean.reward_B, plain.reward_B)


def test_training_code_calls_generate_in_one_place():
    """`esroll.rollout` is the only caller of `generate` in training and evaluation (`esroll.plan` only lowers it,
    through `lower_generate`, to measure it)."""
    callers = [
        p.relative_to(REPO).as_posix()
        for p in (REPO / "esroll").rglob("*.py")
        if re.search(r"\bgenerate\(", p.read_text()) and p.name != "sampling.py"
    ]
    assert callers == ["esroll/rollout.py"]
