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

With an agent task (`Task.env`, `esroll.agents`), a row is a multi-turn episode (`esroll.agents.play`) instead:
its prompt the episode's first text, its completion the rest of the episode (actions and the environment's answers),
its reward the return, and `loss_mask_BxN` True on the model's tokens only. Every process plays every row (the
environments run on the host, and play is deterministic given the same arguments); rows are not yet split over the
mesh's data axis.
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
from esroll.models import Perturbation, member_slots
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
    prefix_B: np.ndarray | None = None  # [B] int32 (with prefixes): tokens of each completion given, not generated
    steps: Any = None  # `esroll.steps.Steps` (`esroll.steps.with_steps`): each completion's reasoning steps
    step_scores_BxJ: np.ndarray | None = None  # [B, J] (with step_scores): each step's verifier score, NaN past them
    loss_mask_BxN: np.ndarray | None = None  # [B, N] bool (episodes): the model's own tokens; None: every generated one
    metrics: dict[str, float] | None = None  # what the rollout itself logs (episodes: solved, turns, valid actions)
    turns: Any = None  # `esroll.agents.Turns` (episodes): each episode's turns: action spans, rewards, states

    @property
    def generated_B(self) -> np.ndarray:
        """[B] tokens each row generated (its length less the prefix it was given)."""
        return self.length_B if self.prefix_B is None else self.length_B - self.prefix_B


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
    prefixes: Sequence[Sequence[int]] | None = None,
) -> Rollout:
    """Decode the rows, row b answering `examples[example_B[b]]` (with member `member_B[b]`'s perturbation when
    `deltas` are given), and score them with `task.rewards`. With `completions`, the tokens and their
    log-probabilities travel in the same exchange as the rewards; with `scores`, the evaluation scores of
    `esroll.data.eval_scores` instead (their first, "accuracy", the task's own reward, is then `reward_B`); with
    `answers`, each row's parsed answer as an integer id (`Task.answer_ids`: what label-free rewards vote on).

    prefixes: row b's completion starts with the tokens `prefixes[b]` (appended to its prompt, decoding continues
    from them through the same KV-cache `generate`: a branched rollout, `esroll.steps.branch`); each completion,
    prefix included, stays within `sampling.max_new_tokens` (a continuation is cut where a fresh completion would
    be). The completion returned and scored is prefix + continuation (the prefix's log-probabilities 0: they were
    given, not sampled), and `prefix_B` holds the prefix lengths. A rollout's completions cut into reasoning steps
    and scored by a verifier: `esroll.steps.with_steps`.

    Every process must pass the same arguments. The sampling noise of row b is a function of (key, b, step), so the
    result does not depend on the mesh. With an agent task (`task.env`), the rows are episodes, played by the
    environment's own rollout (`esroll.agents.EnvTask.rollout`).
    """
    if getattr(task, "env", None) is not None:
        if answers or prefixes is not None:
            raise ValueError("rollout: episodes have no parsed answers or prefixes")
        return task.env.rollout(task, params, examples, example_B, key, sampling, mesh, deltas, member_B, scores)
    example_B = np.asarray(example_B)
    B = len(example_B)
    data = parallel.data_size(mesh)
    chunk = data * (sampling.rows_per_device or -(-B // data))  # rows decoded per `generate` call
    rows = B + (-B % chunk)  # padded to a whole number of chunks
    example_B = np.concatenate([example_B, np.full(rows - B, PAD)])
    real_B = example_B != PAD
    N = sampling.max_new_tokens
    if prefixes is None:
        tokens_XxP, mask_XxP = pad_prompts(task.prompt_ids(examples), multiple=task.prompt_multiple, pad_id=task.pad_id)
        prompt_BxP = np.where(real_B[:, None], tokens_XxP[example_B], task.pad_id).astype(np.int32)
        prompt_mask_BxP = real_B[:, None] & mask_XxP[example_B]
        prefix_B = np.zeros(rows, np.int32)
    else:
        if len(prefixes) != B:
            raise ValueError(f"rollout: {len(prefixes)} prefixes for {B} rows")
        prefix_B = np.array([len(p) for p in prefixes] + [0] * (rows - B), np.int32)
        if (prefix_B >= N).any():
            raise ValueError(f"rollout: a prefix of {prefix_B.max()} tokens leaves none of max_new_tokens = {N}")
        ids = task.prompt_ids(examples)
        row_ids = [list(ids[e]) + [int(t) for t in prefixes[b]] if e != PAD else [] for b, e in enumerate(example_B)]
        prompt_BxP, prompt_mask_BxP = pad_prompts(row_ids, multiple=task.prompt_multiple, pad_id=task.pad_id)
    # The longest continuation any row may take, its prefix rounded down to a multiple of 8 so that a few lengths
    # (compilations of `generate`) serve every batch of branches.
    new_tokens = N - int(prefix_B[real_B].min(initial=0)) // 8 * 8
    place = (lambda x: parallel.put_rows(mesh, x)) if mesh.size > 1 else np.asarray
    slots = None
    if deltas is not None:  # padding rows take the last row's member: no chunk gets a member more for them
        member_B = np.asarray(member_B)
        member_B = np.concatenate([member_B, np.full(rows - B, member_B[-1], member_B.dtype)])
        slots = member_slots(member_B, data, chunk)  # one table size for every chunk: one compilation
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
            max_new_tokens=new_tokens,
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
            member_slots=slots,
        )
        idx, tokens = parallel.local_rows(gen.tokens)
        parts.append((idx + start, tokens, parallel.local_rows(gen.lengths)[1], parallel.local_rows(gen.logprobs)[1]))
    empty = (
        np.zeros(0, int),
        np.zeros((0, new_tokens), np.int32),
        np.zeros(0, np.int32),
        np.zeros((0, new_tokens), np.float32),
    )
    idx, tokens, lengths, logprobs = (np.concatenate(p) for p in zip(empty, *parts))
    if prefixes is not None:  # prefix + continuation, cut to N tokens in all
        tokens, lengths, logprobs = _with_prefixes(prefixes, prefix_B[idx], idx, tokens, lengths, logprobs, N, task)
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
    n_scores = len(names)
    at = n_scores + 1 + int(answers)  # where the tokens start
    out = Rollout(
        example_B=example_B[:B],
        prompt_BxP=prompt_BxP[:B],
        prompt_mask_BxP=prompt_mask_BxP[:B],
        reward_B=table[:, 0].astype(np.float32),
        length_B=table[:, n_scores].astype(np.int32),
        tokens_BxN=table[:, at : at + N].astype(np.int32) if completions else None,
        logprobs_BxN=table[:, at + N :].astype(np.float32) if completions else None,
        scores={name: table[:, i].astype(np.float32) for i, name in enumerate(names)} if scores else None,
        answer_B=table[:, n_scores + 1].astype(np.int64) if answers else None,
        seconds={"generate": generated_s - start_s, "score": scored_s - generated_s},
        prefix_B=None if prefixes is None else prefix_B[:B],
    )
    return out


def given_rollout(task: Any, examples: Sequence[Example], example_B: np.ndarray, max_new_tokens: int) -> Rollout:
    """The rows of `example_B` answered by the data instead of the model: each example's `target_text` (its
    supervised completion), EOS appended, cut to `max_new_tokens`, scored by `task.rewards` as a sampled row is.
    What GKD trains on for the share of its steps that are not on the student's own samples. The log-probabilities
    are left 0 (nothing was sampled: the caller scores them if it needs them); single-turn tasks only."""
    if getattr(task, "env", None) is not None:
        raise ValueError("given_rollout: episodes have no given completions")
    example_B = np.asarray(example_B)
    B, N = len(example_B), max_new_tokens
    tokens_XxP, mask_XxP = pad_prompts(task.prompt_ids(examples), multiple=task.prompt_multiple, pad_id=task.pad_id)
    eos = [task.eos_ids[0]] if task.eos_ids else []
    targets = [task.tokenizer.encode(e.target_text, add_special_tokens=False) + eos for e in examples]
    tokens_BxN = np.full((B, N), task.pad_id, np.int32)
    length_B = np.zeros(B, np.int32)
    for b, x in enumerate(example_B):
        ids = targets[x][:N]
        tokens_BxN[b, : len(ids)], length_B[b] = ids, len(ids)
    start = time.perf_counter()
    reward_B = task.rewards([examples[x] for x in example_B], tokens_BxN, length_B)
    return Rollout(
        example_B=example_B,
        prompt_BxP=tokens_XxP[example_B].astype(np.int32),
        prompt_mask_BxP=mask_XxP[example_B],
        reward_B=np.asarray(reward_B, np.float32),
        length_B=length_B,
        tokens_BxN=tokens_BxN,
        logprobs_BxN=np.zeros((B, N), np.float32),
        scores=None,
        seconds={"generate": 0.0, "score": time.perf_counter() - start},
    )


def _with_prefixes(prefixes, prefix_R, idx, cont_RxM, cont_len_R, cont_logp_RxM, N: int, task):
    """Rows [R, N] of prefix + continuation for the local rows `idx`: each continuation cut to N − its prefix
    tokens (as a fresh completion is cut at N), padding after, log-probabilities 0 on the prefix."""
    R = len(idx)
    tokens = np.full((R, N), task.pad_id, np.int32)
    logprobs = np.zeros((R, N), np.float32)
    lengths = np.zeros(R, np.int32)
    for r, b in enumerate(idx):
        k = int(prefix_R[r])
        if b >= len(prefixes):  # a padding row
            continue
        n = min(int(cont_len_R[r]), N - k)
        tokens[r, :k] = prefixes[b]
        tokens[r, k : k + n] = cont_RxM[r, :n]
        logprobs[r, k : k + n] = cont_logp_RxM[r, :n]
        lengths[r] = k + n
    return tokens, lengths, logprobs


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
