"""A teacher: a model whose log-probabilities score the tokens a student samples (on-policy distillation).

    cfg, params = load_teacher("assets/tiny-qwen3-steps-teacher", task.tokenizer)
    logp_BxN = teacher_logprobs(cfg, params, out)            # log π_T of each token the student generated
    logq_BxNxV = teacher_log_distributions(cfg, params, out)  # π_T's whole next-token distribution, in log space
    logp_BxN, h_BxNxD = teacher_signals(cfg, params, out, distributions=True)  # what GKD's loss reads instead

A teacher reads the student's token ids, so it must share the student's tokenizer exactly: the same vocabulary,
merges, pre-tokenisation, normalisation and special tokens. One that differs is refused in one line naming what
differs, never silently scored through the wrong ids. Each call is one cache-free forward over prompt and completion
(`esroll.scoring.rollout_logprobs`: the log-softmax of the raw logits, as the student's own `Rollout.logprobs_BxN`).

GKD's loss needs the teacher's whole next-token distribution at every completion position. Rather than [B, N, V]
log-probabilities (at a 150k vocabulary, 600 kB a token in float32), the rows carry the teacher's final hidden states
[B, N, D_T] and the loss applies the teacher's head (`teacher_head`) chunk by chunk beside the student's
(`esroll.scoring.Divergence`).
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from esroll import sharding
from esroll.errors import InputError, reading
from esroll.models import ModelConfig, forward, load_hf
from esroll.models import attention
from esroll.models.hf import abstract_params
from esroll.models.transformer import head
from esroll.scoring import completion_logprobs, rollout_logprobs

_PARTS = ("model", "pre_tokenizer", "normalizer", "decoder", "added_tokens")  # what decides the ids of a text


def check_tokenizer(student, teacher, where: str = "teacher.path") -> None:
    """Refuse (an InputError naming `where`) a teacher tokenizer that would give any text other ids than the
    student's: a different vocabulary (the first differing token named), merges, pre-tokenisation, normalisation,
    added tokens, or end and padding ids."""
    s, t = student.get_vocab(), teacher.get_vocab()
    if s != t:
        token = next((k for k in sorted(s.keys() | t.keys(), key=lambda k: s.get(k, t.get(k))) if s.get(k) != t.get(k)))
        detail = f"token {token!r} is id {t.get(token)} in the teacher's, {s.get(token)} in the student's"
        raise InputError(f"{where}: the teacher's tokenizer differs from the student's ({detail}); {_MUST}")
    if hasattr(student, "backend_tokenizer") and hasattr(teacher, "backend_tokenizer"):
        a, b = (json.loads(x.backend_tokenizer.to_str()) for x in (student, teacher))
        for part in _PARTS:
            if a.get(part) != b.get(part):
                raise InputError(f"{where}: the teacher's tokenizer differs from the student's (its {part}); {_MUST}")
    for name in ("eos_token_id", "pad_token_id"):
        if getattr(student, name) != getattr(teacher, name):
            detail = f"{name} {getattr(teacher, name)} against the student's {getattr(student, name)}"
            raise InputError(f"{where}: the teacher's tokenizer differs from the student's ({detail}); {_MUST}")


_MUST = "a teacher must share the student's tokenizer exactly"


def load_teacher(
    path: str,
    student_tokenizer,
    where: str = "teacher.path",
    dtype=None,
    mesh: Mesh | None = None,
    kernel: str = "auto",
) -> tuple[ModelConfig, dict]:
    """The teacher model in folder `path` (a causal LM: `esroll.models.load_hf`), after checking its tokenizer against
    the student's (`check_tokenizer`); any error reading it is one line naming `where`. With `mesh`, its parameters
    are split over the mesh as the student's masters are (`esroll.sharding.master_shardings`; each device reads its
    shards from the file), so a teacher larger than one device's memory scores the rows under GSPMD, with the attention
    kernel that `kernel` (the student's `model.attention`) picks for the mesh (`esroll.models.attention.choose`)."""
    from transformers import AutoTokenizer

    shardings = None if mesh is None else (lambda c: sharding.master_shardings(mesh, abstract_params(c)))
    with reading(where):
        cfg, params = load_hf(path, dtype, shardings=shardings)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    if cfg.head != "lm":
        raise InputError(f"{where}: {path} is a {cfg.head} model; a teacher is a causal language model")
    check_tokenizer(student_tokenizer, tokenizer, where)
    return dataclasses.replace(cfg, attention=attention.choose(kernel, mesh)), params


def experiment_teacher(cfg, student_tokenizer, mesh: Mesh | None) -> tuple[ModelConfig, dict]:
    """`load_teacher` of an experiment config `cfg`: `teacher.path`, in `model.dtype`, with `model.attention`."""
    return load_teacher(
        cfg.teacher.path, student_tokenizer, dtype=jnp.dtype(cfg.model.dtype), mesh=mesh, kernel=cfg.model.attention
    )


def _completion_hidden(cfg, params, prompt_BxP, prompt_mask_BxP, tokens_BxN, mask_BxN):
    """[B, N, D]: the final-normed hidden states of one cache-free forward over prompt and completion, at the
    positions that predict the completion's tokens (position P-1+n predicts token n)."""
    P = prompt_BxP.shape[1]
    tokens_BxT = jnp.concatenate([prompt_BxP, tokens_BxN], 1)
    mask_BxT = jnp.concatenate([prompt_mask_BxP, mask_BxN], 1)
    hidden_BxTxD, _ = forward(cfg, params, tokens_BxT, mask_BxT=mask_BxT, return_hidden=True)
    return hidden_BxTxD[:, P - 1 : -1]


@functools.partial(jax.jit, static_argnums=0)
def _log_distributions(cfg, params, prompt_BxP, prompt_mask_BxP, tokens_BxN, mask_BxN):
    logits_BxNxV = head(cfg, params, _completion_hidden(cfg, params, prompt_BxP, prompt_mask_BxP, tokens_BxN, mask_BxN))
    return jnp.where(mask_BxN[..., None], jax.nn.log_softmax(logits_BxNxV, -1), 0.0)


def _completion_mask(out) -> np.ndarray:
    N = out.tokens_BxN.shape[1]
    return np.arange(N)[None, :] < np.asarray(out.length_B)[:, None]


def teacher_logprobs(cfg: ModelConfig, params: dict, out) -> np.ndarray:
    """[B, N] float32: log π_T of each token of the rollout `out`'s completions (a `Rollout` with its completions),
    given the prompt and the tokens before it; 0 past each completion's length."""
    return rollout_logprobs(cfg, params, out)


def teacher_log_distributions(cfg: ModelConfig, params: dict, out) -> np.ndarray:
    """[B, N, V] float32: log π_T(· | prefix) at each completion position of `out` (the whole next-token distribution,
    for exact divergences; [B, N, V] is small at a small vocabulary); 0 past each completion's length."""
    mask = _completion_mask(out)
    return np.asarray(_log_distributions(cfg, params, out.prompt_BxP, out.prompt_mask_BxP, out.tokens_BxN, mask))


@functools.partial(jax.jit, static_argnums=(0, 6))
def _hidden_and_logprobs(cfg, params, prompt_BxP, prompt_mask_BxP, tokens_BxN, mask_BxN, chunk):
    hidden_BxNxD = _completion_hidden(cfg, params, prompt_BxP, prompt_mask_BxP, tokens_BxN, mask_BxN)
    hidden_BxNxD = jnp.where(mask_BxN[..., None], hidden_BxNxD, 0)
    logp_BxN = completion_logprobs(cfg, params, hidden_BxNxD, tokens_BxN, chunk)
    return jnp.where(mask_BxN, logp_BxN, 0.0), hidden_BxNxD.astype(jnp.float32)


def teacher_head(cfg: ModelConfig, params: dict) -> dict:
    """The weights the teacher's output head reads (`esroll.models.transformer.head`): its embedding when tied, else
    its `lm_head`."""
    return {k: params[k] for k in (("embed",) if cfg.tie_word_embeddings else ("lm_head",))}


def teacher_signals(
    cfg: ModelConfig, params: dict, out, distributions: bool, chunk: int = 0
) -> tuple[np.ndarray, np.ndarray | None]:
    """(log π_T of each sampled token [B, N], and with `distributions` the teacher's final-normed hidden states at the
    completion positions [B, N, D_T] float32, from which its head gives the whole distributions, 0 past each
    completion's length): one teacher forward over the rollout `out` either way, its head applied `chunk` positions
    at a time (0: all; `esroll.scoring.completion_logprobs`)."""
    if not distributions:
        return teacher_logprobs(cfg, params, out), None
    mask = _completion_mask(out)
    logp, hidden = _hidden_and_logprobs(cfg, params, out.prompt_BxP, out.prompt_mask_BxP, out.tokens_BxN, mask, chunk)
    return np.asarray(logp), np.asarray(hidden)
