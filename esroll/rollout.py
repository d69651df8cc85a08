"""One rollout: examples → prompt rows → `generate` (optionally perturbed) → rewards, after one exchange across
processes. The only caller of `generate` in training and evaluation.

ES, GRPO and held-out evaluation differ only in the arguments:
    ES          rows member-major over the step's X prompts: example_B = tile(arange(X), M), member_B = repeat(
                arange(M), X), this step's deltas, the members' sampling settings;
    GRPO        M rows per prompt: example_B = repeat(arange(X), M), sampled, with completions and log-probabilities;
    evaluation  one row per question, greedy.
A row whose example is `PAD` is a padding row: it has no prompt, generates nothing and gets reward 0. Rows are decoded
in chunks of `Sampling.rows_per_device` rows per device (all at once by default), split over the mesh's data axis;
each process scores the rows its devices decoded, and one all-gather after the last chunk gives every process every
row's outcome.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from esroll import parallel
from esroll.rewards import majority_rewards
from esroll.data import Example, eval_score_names
from esroll.models import Perturbation
from esroll.sampling import generate, pad_prompts

PAD = -1  # in a row → example map: a padding row


class Sampling(NamedTuple):
    """How rows are decoded: temperature 0 is greedy; top_k 0 and top_p 1 disable those filters. rows_per_device:
    rows each device decodes at once (0: all of its share in one call); phases / unroll: `generate`'s decode phases
    and layers per scan iteration."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    rows_per_device: int = 0
    phases: int = 4
    unroll: int = 1

    @classmethod
    def of(cls, max_new_tokens: int, temperature: float, parallel_cfg, rows_per_device: int = 0) -> Sampling:
        """Sampling settings with a config's `parallel` section (phases, scan unroll) and a chosen row count."""
        return cls(
            max_new_tokens,
            temperature,
            rows_per_device=rows_per_device,
            phases=parallel_cfg.decode_phases,
            unroll=parallel_cfg.scan_unroll,
        )


class Rollout(NamedTuple):
    """The outcome of every row, on every process (host arrays): B rows, N = max_new_tokens, P the padded prompt."""

    example_B: np.ndarray  # [B] int: the row → example map (PAD for padding rows)
    prompt_BxP: np.ndarray  # [B, P] int32, left-padded
    prompt_mask_BxP: np.ndarray  # [B, P] bool
    reward_B: np.ndarray  # [B] float32; 0 on padding rows
    length_B: np.ndarray  # [B] int32: tokens generated, EOS included
    tokens_BxN: np.ndarray | None  # [B, N] int32 (with completions=True): pad_id after EOS
    logprobs_BxN: np.ndarray | None  # [B, N] float32 (with completions=True): log π at each sampled token, 0 after EOS
    scores: dict[str, np.ndarray] | None  # name -> [B] float32 (with scores=True): `esroll.data.eval_scores`
    answer_B: np.ndarray | None = None  # [B] int64 (with answers=True): parsed-answer ids, -1 for none
    seconds: dict[str, float] | None = None  # wall time of the phases: "generate" (decoding), "score" (rewards)


def rollout(
    task: Any,
    mesh: Mesh,
    params: dict,
    examples: Sequence[Example],
    example_B: np.ndarray,
    key: jax.Array,
    sampling: Sampling,
    *,
    deltas: dict | None = None,
    member_B: np.ndarray | None = None,
    completions: bool = False,
    scores: bool = False,
    answers: bool = False,
) -> Rollout:
    """Decode the rows, row b answering `examples[example_B[b]]` (with member `member_B[b]`'s perturbation when
    `deltas` are given), and score them with `task.rewards`. With `completions`, the tokens and their
    log-probabilities travel in the same exchange as the rewards; with `scores`, the evaluation scores of
    `esroll.data.eval_scores` instead (their first, "accuracy", the task's own reward, is then `reward_B`); with
    `answers`, each row's parsed answer as an integer id (`Task.answer_ids`: what label-free rewards vote on).

    Every process must pass the same arguments. The sampling noise of row b is a function of (key, b, step), so the
    result does not depend on the mesh.
    """
    example_B = np.asarray(example_B)
    B = len(example_B)
    data = parallel.data_size(mesh)
    chunk = data * (sampling.rows_per_device or -(-B // data))  # rows decoded per `generate` call
    rows = B + (-B % chunk)  # padded to a whole number of chunks
    example_B = np.concatenate([example_B, np.full(rows - B, PAD)])
    real_B = example_B != PAD
    tokens_XxP, mask_XxP = pad_prompts(task.prompt_ids(examples), multiple=task.prompt_multiple, pad_id=task.pad_id)
    prompt_BxP = np.where(real_B[:, None], tokens_XxP[example_B], task.pad_id).astype(np.int32)
    prompt_mask_BxP = real_B[:, None] & mask_XxP[example_B]
    place = (lambda x: parallel.put_rows(mesh, x)) if mesh.size > 1 else np.asarray
    if deltas is not None:
        member_B = np.concatenate([member_B, np.zeros(rows - B, member_B.dtype)])
    # Chunk by chunk: the KV cache and every other per-row buffer is sized to one chunk. A row's sampling noise is
    # keyed by its index in the whole rollout (`row_offset`), so chunking does not change any row's tokens.
    parts = []  # (row indices, tokens, lengths, log-probabilities) of this process's rows
    start_s = time.perf_counter()
    for start in range(0, rows, chunk):
        rows_c = slice(start, start + chunk)
        if not real_B[rows_c].any():
            continue  # only padding: nothing to decode (every process skips the same chunks)
        perturb = None if deltas is None else Perturbation(deltas, place(member_B[rows_c]))
        gen = generate(
            task.cfg,
            params,
            place(prompt_BxP[rows_c]),
            key,
            max_new_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            eos_ids=task.eos_ids,
            prompt_mask=place(prompt_mask_BxP[rows_c]),
            perturb=perturb,
            pad_id=task.pad_id,
            row_offset=start,
            unroll=sampling.unroll,
            phases=sampling.phases,
        )
        idx, tokens = parallel.local_rows(gen.tokens)
        parts.append((idx + start, tokens, parallel.local_rows(gen.lengths)[1], parallel.local_rows(gen.logprobs)[1]))
    N = sampling.max_new_tokens
    empty = (np.zeros(0, int), np.zeros((0, N), np.int32), np.zeros(0, np.int32), np.zeros((0, N), np.float32))
    idx, tokens, lengths, logprobs = (np.concatenate(p) for p in zip(empty, *parts))
    generated_s = time.perf_counter()
    real = real_B[idx]
    names = eval_score_names(examples[0].task) if scores else ("accuracy",)
    local = np.zeros((len(idx), len(names)), np.float32)  # the reward first, then the other scores
    score_fn = task.eval_scores if scores else lambda *a: task.rewards(*a)[:, None]
    answer_ids = np.full((len(idx), 1), -1.0)
    if real.any():  # a process whose devices hold only padding rows scores nothing (but still joins the exchange)
        rows_examples = [examples[e] for e in example_B[idx[real]]]
        local[real] = score_fn(rows_examples, tokens[real], lengths[real])
        if answers:
            answer_ids[real, 0] = task.answer_ids(rows_examples, tokens[real], lengths[real])
    # One exchange: [reward, scores..., length, (answer id), tokens..., log-probabilities...] per row, in float64
    # (exact for all: answer ids are below 2^52).
    columns = [local, lengths[:, None]] + ([answer_ids] if answers else [])
    if completions:
        columns += [tokens, logprobs]
    scored_s = time.perf_counter()
    table = parallel.gather_to_all(np.concatenate(columns, 1, dtype=np.float64), idx, rows)[:B]
    S = len(names)
    A = S + 1 + int(answers)  # where the tokens start
    return Rollout(
        example_B=example_B[:B],
        prompt_BxP=prompt_BxP[:B],
        prompt_mask_BxP=prompt_mask_BxP[:B],
        reward_B=table[:, 0].astype(np.float32),
        length_B=table[:, S].astype(np.int32),
        tokens_BxN=table[:, A : A + N].astype(np.int32) if completions else None,
        logprobs_BxN=table[:, A + N :].astype(np.float32) if completions else None,
        scores={name: table[:, i].astype(np.float32) for i, name in enumerate(names)} if scores else None,
        answer_B=table[:, S + 1].astype(np.int64) if answers else None,
        seconds={"generate": generated_s - start_s, "score": scored_s - generated_s},
    )


def training_rewards(out: Rollout, label_free: bool) -> tuple[np.ndarray, dict[str, float]]:
    """Each row's training reward [B] and what to log of it. With `label_free` (data.reward = "majority"), a row's
    reward is whether its answer is a modal answer of all the rows answering its example (every ES member and
    sample, every GRPO completion of the group; `esroll.rewards.majority_rewards`), and the gold reward the rows
    carry is logged as a diagnostic beside how often the vote agrees with it; otherwise the gold reward itself."""
    if not label_free:
        return out.reward_B, {}
    if out.answer_B is None:
        raise ValueError("label-free rewards need the rows' parsed answers (rollout(..., answers=True))")
    reward_B = np.zeros(len(out.example_B), np.float32)
    for example in np.unique(out.example_B[out.example_B != PAD]):
        rows = np.flatnonzero(out.example_B == example)
        reward_B[rows] = majority_rewards(out.answer_B[rows][None])[0]
    gold_B = np.asarray(out.reward_B, np.float64)
    return reward_B, {"gold_reward_mean": gold_B.mean(), "pseudo_label_agreement": np.mean(reward_B == gold_B)}


def prompt_means(example_B: np.ndarray, value_B: np.ndarray, prompts: int) -> np.ndarray:
    """[prompts]: the mean of `value_B` over the rows answering each example (what the curriculum reads as each
    prompt's success)."""
    real = example_B != PAD
    counts = np.bincount(example_B[real], minlength=prompts)
    return np.bincount(example_B[real], np.asarray(value_B, np.float64)[real], minlength=prompts) / np.maximum(
        counts, 1
    )
