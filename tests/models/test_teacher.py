"""The teacher (`esroll.teacher`): its tokenizer checked against the student's, and its log-probabilities of a
student's sampled completions against an independent full-logits forward and, for a teacher that is the student,
against the log-probabilities the student's own decoding recorded."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, load_steps_task
from esroll.errors import InputError
from esroll.models import forward
from esroll.models.transformer import head
from esroll.rollout import Sampling, rollout
from esroll.teacher import load_teacher, teacher_head, teacher_log_distributions, teacher_logprobs, teacher_signals

STUDENT = REPO / "assets" / "tiny-qwen3-steps"
TEACHER = REPO / "assets" / "tiny-qwen3-steps-teacher"


@pytest.fixture(scope="module")
def sampled():
    """The student's task and 8 completions sampled at temperature 1 (so their recorded log-probabilities are the
    raw model's)."""
    task, params, held_out, mesh = load_steps_task(STUDENT, 200, 8)
    out = rollout(task, mesh, params, held_out, np.arange(8), jax.random.key(3), Sampling(48, 1.0), completions=True)
    return task, out


def test_a_teacher_that_is_the_student_scores_what_the_students_decoding_recorded(sampled):
    task, out = sampled
    cfg, params = load_teacher(str(STUDENT), task.tokenizer)
    mask = np.arange(out.tokens_BxN.shape[1])[None] < out.length_B[:, None]
    got = teacher_logprobs(cfg, params, out)
    np.testing.assert_allclose(got[mask], out.logprobs_BxN[mask], atol=1e-4)
    assert not got[~mask].any()


def test_teacher_logprobs_equal_a_full_forward_of_the_teacher(sampled):
    """By a separate path: the teacher's whole [B, T, V] logits over prompt + completion, log-softmax, and the entry of
    each completion token read at the position before it."""
    task, out = sampled
    cfg, params = load_teacher(str(TEACHER), task.tokenizer)
    P, N = out.prompt_BxP.shape[1], out.tokens_BxN.shape[1]
    mask = np.arange(N)[None] < out.length_B[:, None]
    tokens = np.concatenate([out.prompt_BxP, out.tokens_BxN], 1)
    logits, _ = jax.jit(forward, static_argnums=0)(
        cfg, params, jnp.asarray(tokens), mask_BxT=jnp.asarray(np.concatenate([out.prompt_mask_BxP, mask], 1))
    )
    logp = np.asarray(jax.nn.log_softmax(logits, -1))
    expected = np.take_along_axis(logp[:, P - 1 : P - 1 + N], out.tokens_BxN[..., None], -1)[..., 0]
    got = teacher_logprobs(cfg, params, out)
    np.testing.assert_allclose(got[mask], expected[mask], atol=1e-5)
    dist = teacher_log_distributions(cfg, params, out)
    assert dist.shape == (8, N, cfg.vocab_size)
    np.testing.assert_allclose(
        np.take_along_axis(dist, out.tokens_BxN[..., None], -1)[..., 0][mask], got[mask], atol=1e-5
    )
    np.testing.assert_allclose(np.exp(dist[mask]).sum(-1), 1.0, atol=1e-5)
    assert (got[mask] > out.logprobs_BxN[mask]).mean() > 0.5  # the stronger model finds most sampled tokens likelier
    # What GKD's loss reads instead of the distributions: the hidden states, which the teacher's head turns into them.
    sampled_logp, hidden = teacher_signals(cfg, params, out, distributions=True)
    assert hidden.shape == (8, N, cfg.hidden_size) and not hidden[~mask].any()
    np.testing.assert_allclose(sampled_logp[mask], expected[mask], atol=1e-5)
    from_hidden = np.asarray(jax.nn.log_softmax(head(cfg, teacher_head(cfg, params), jnp.asarray(hidden)), -1))
    np.testing.assert_allclose(from_hidden[mask], logp[:, P - 1 : P - 1 + N][mask], atol=1e-5)


def test_a_teacher_split_over_the_mesh_scores_as_one_on_a_device(sampled):
    """`load_teacher(..., mesh=…)` splits the teacher as the student's masters (4 × 2 data × model devices here), and
    its signals equal those of the teacher read whole onto one device."""
    from esroll import parallel

    task, out = sampled
    cfg, whole = load_teacher(str(TEACHER), task.tokenizer)
    _, split = load_teacher(str(TEACHER), task.tokenizer, mesh=parallel.make_mesh(8, model=2))
    layer = jax.tree.leaves(split["layers"])[0]
    assert len(jax.devices()) == 8 and not layer.sharding.is_fully_replicated
    assert layer.addressable_shards[0].data.size < layer.size
    for a, b in zip(teacher_signals(cfg, whole, out, True), teacher_signals(cfg, split, out, True), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-5)


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(sampled, tmp_path):
    task, _ = sampled
    with pytest.raises(
        InputError, match=r"^teacher\.path: the teacher's tokenizer differs from the student's \(token "
    ):
        load_teacher(str(REPO / "assets" / "tiny-qwen3-agent"), task.tokenizer)
    # The same vocabulary with one merge fewer would split some texts into other ids: refused too.
    shutil.copytree(TEACHER, tmp_path / "t")
    spec = json.loads((tmp_path / "t" / "tokenizer.json").read_text())
    spec["model"]["merges"] = spec["model"]["merges"][:-1]
    (tmp_path / "t" / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(
        InputError, match=r"^teacher\.path: .* differs from the student's \(its model\); a teacher must"
    ):
        load_teacher(str(tmp_path / "t"), task.tokenizer)
    with pytest.raises(InputError, match=r"^teacher\.path: .*no-such-folder"):
        load_teacher(str(tmp_path / "no-such-folder"), task.tokenizer)
