"""The rollout of an agent task: each row an episode played by `esroll.agents.play`, returned as the same `Rollout`
every method reads (`esroll.rollout`), with the loss mask on the model's tokens and each episode's turns."""

from __future__ import annotations

import time

import numpy as np

from esroll import parallel
from esroll.errors import InputError
from esroll.agents.multiturn import Turns, play
from esroll.agents.reflect import score_reflections
from esroll.models import Perturbation, member_slots
from esroll.rollout import PAD, Rollout, Sampling

EPISODE_SCORES = ("accuracy", "return", "turns")  # held-out scores of episodes: solved, the return, turns played


def episodes(task, params, examples, example_B, key, sampling: Sampling, mesh, deltas=None, member_B=None,
             scores: bool = False) -> Rollout:  # fmt: skip
    """`rollout` of an agent task: row b plays the episode of `examples[example_B[b]]` (its `meta["seed"]`) with
    `esroll.agents.play`, member `member_B[b]`'s perturbation when `deltas` are given, in chunks of
    `sampling.rows_per_device` × the data axis rows (each row's sampling noise keyed by its index in the whole
    rollout, so chunking does not change it). The completion is the episode after its prompt, padded to
    `sampling.max_new_tokens` (a longer one is refused: `train.max_new_tokens` must hold the longest episode); the
    log-probabilities are those of the action tokens; the reward is the return; `scores` gives the held-out scores
    `EPISODE_SCORES` (the first, "accuracy", whether the environment was solved). A padding row plays the first
    example's episode and its outcome is dropped (reward 0, nothing generated). With `env.reflect_tokens`, every
    training episode (not a scored one) is followed by its reflection (`esroll.agents.reflect`): its tokens are the
    model's (loss), its text and span are in the turns, and the metrics give the share of reflections whose ratings
    parse and, where the environment has a planner, the share of parsed ratings that equal the oracle's."""
    env = task.env
    example_B = np.asarray(example_B)
    B, N = len(example_B), sampling.max_new_tokens
    data = parallel.data_size(mesh)
    chunk = data * (sampling.rows_per_device or -(-B // data))
    rows = B + (-B % chunk)
    example_B = np.concatenate([example_B, np.full(rows - B, PAD)])
    real_B = example_B != PAD
    slots = None
    if deltas is not None:  # padding rows take the last row's member, as in `rollout`
        member_B = np.asarray(member_B)
        member_B = np.concatenate([member_B, np.full(rows - B, member_B[-1], member_B.dtype)])
        slots = member_slots(member_B, 1, chunk)
    seeds = [examples[max(int(e), 0)].meta["seed"] for e in example_B]
    start_s = time.perf_counter()
    parts = []
    for start in range(0, rows, chunk):
        c = slice(start, start + chunk)
        if not real_B[c].any():
            continue
        perturb = None if deltas is None else Perturbation(deltas, member_B[c])
        played = play(
            task.cfg,
            params,
            task.tokenizer,
            [env.make() for _ in range(chunk)],
            seeds[c],
            key,
            max_turns=env.max_turns,
            max_action_tokens=env.max_action_tokens,
            max_observation_tokens=env.max_observation_tokens,
            temperature=sampling.temperature,
            eos_id=task.tokenizer.eos_token_id,
            pad_id=task.pad_id,
            perturb=perturb,
            row_offset=start,
            prompt_multiple=task.prompt_multiple,
            member_slots=slots,
            reflect_tokens=0 if scores else env.reflect_tokens,
        )
        if played.tokens_BxT.shape[1] > N:
            raise InputError(
                f"train.max_new_tokens: an episode of {played.tokens_BxT.shape[1]} tokens after its prompt does not "
                f"fit its {N}: raise it to env.options.<name>.max_turns × (env.max_action_tokens + "
                "env.max_observation_tokens), plus the reflection's room with env.reflect_tokens"
            )
        parts.append((c, played))
    P = max([p.prompt_BxP.shape[1] for _, p in parts] + [task.prompt_multiple])
    prompt_BxP = np.full((rows, P), task.pad_id, np.int32)
    prompt_mask_BxP = np.zeros((rows, P), bool)
    tokens_BxN = np.full((rows, N), task.pad_id, np.int32)
    logprobs_BxN, loss_BxN = np.zeros((rows, N), np.float32), np.zeros((rows, N), bool)
    length_B, reward_B, turns_B = np.zeros(rows, np.int32), np.zeros(rows, np.float32), np.zeros(rows, np.float32)
    solved_B, valid, acted = np.zeros(rows, np.float32), 0, 0
    W = env.max_turns
    start_BxW, end_BxW = np.zeros((rows, W), np.int32), np.zeros((rows, W), np.int32)
    turn_reward_BxW, states = np.zeros((rows, W), np.float32), [[] for _ in range(rows)]
    actions = [[] for _ in range(rows)]
    reflected = any(p.reflections is not None for _, p in parts)
    reflections = [""] * rows
    reflection_BxS = np.zeros((rows, 2), np.int32)  # each reflection's start and end
    for c, p in parts:
        keep = real_B[c]
        width, L = p.prompt_BxP.shape[1], p.tokens_BxT.shape[1]
        prompt_BxP[c, P - width :], prompt_mask_BxP[c, P - width :] = p.prompt_BxP, p.prompt_mask_BxP & keep[:, None]
        tokens_BxN[c, :L] = np.where(keep[:, None], p.tokens_BxT, task.pad_id)
        logprobs_BxN[c, :L] = np.where(keep[:, None], p.logprobs_BxT, 0.0)
        loss_BxN[c, :L] = p.loss_mask_BxT & keep[:, None]
        length_B[c] = np.where(keep, p.length_B, 0)
        reward_B[c] = np.where(keep, p.return_B, 0.0)
        turns_B[c], solved_B[c] = np.where(keep, p.turns_B, 0), np.where(keep, p.solved_B, 0.0)
        played_BxW = np.arange(p.reward_BxW.shape[1])[None] < p.turns_B[:, None]
        valid += int((p.valid_BxW & played_BxW)[keep].sum())
        acted += int(played_BxW[keep].sum())
        turned, kept = p.turns, keep[:, None]  # play's turn slots are env.max_turns
        start_BxW[c], end_BxW[c] = turned.start_BxW * kept, turned.end_BxW * kept
        turn_reward_BxW[c] = np.where(kept, turned.reward_BxW, 0.0)
        for i, b in enumerate(range(c.start, c.stop)):
            states[b] = turned.states[i] if keep[i] else []
            actions[b] = list(turned.actions[i]) if keep[i] else []
            if reflected and keep[i]:
                reflections[b] = p.reflections[i]
                reflection_BxS[b] = p.reflection_start_B[i], p.reflection_end_B[i]
    generated_s = time.perf_counter()
    n = max(int(real_B.sum()), 1)
    metrics = {
        "episode_solved": float(solved_B.sum() / n),
        "episode_turns": float(turns_B.sum() / n),
        "valid_actions": valid / max(acted, 1),
    }
    if reflected:
        real = np.flatnonzero(real_B)
        metrics.update(score_reflections(env.make(), [seeds[b] for b in real], [reflections[b] for b in real],
                                         [actions[b] for b in real], turns_B[real]))  # fmt: skip
    table = {"accuracy": solved_B, "return": reward_B, "turns": turns_B}
    return Rollout(
        example_B=example_B[:B],
        prompt_BxP=prompt_BxP[:B],
        prompt_mask_BxP=prompt_mask_BxP[:B],
        reward_B=reward_B[:B],
        length_B=length_B[:B],
        tokens_BxN=tokens_BxN[:B],
        logprobs_BxN=logprobs_BxN[:B],
        scores={name: table[name][:B] for name in EPISODE_SCORES} if scores else None,
        seconds={"generate": generated_s - start_s, "score": 0.0},
        loss_mask_BxN=loss_BxN[:B],
        metrics=metrics,
        turns=Turns(
            start_BxW[:B],
            end_BxW[:B],
            turn_reward_BxW[:B],
            turns_B[:B].astype(np.int32),
            states[:B],
            actions[:B],
            solved_B[:B] > 0,
            reflections[:B] if reflected else None,
            reflection_BxS[:B, 0] if reflected else None,
            reflection_BxS[:B, 1] if reflected else None,
        ),
    )
