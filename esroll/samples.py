"""Samples a person can read: a few held-out rows of an evaluation as text, what workdir/samples.jsonl holds.

A single-turn row is its question, gold answer, the model's completion and its scores; an episode (an agent task)
is its seed and, turn by turn, the observation the agent saw, the action it wrote (exactly as generated, so a
malformed one shows what went wrong) and the reward it got, then its return and whether it was solved.

    {"step": 10, "example": 0, "prompt": "12+30=", "answer": "42", "completion": " 42", "scores": {...}}
    {"step": 10, "example": 0, "seed": 1000000, "turns": [{"observation": "...", "action": "down", "reward": 0.0},
     ...], "return": 1.0, "solved": true}
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from esroll.rollout import PAD, Rollout


def readable(out: Rollout, examples: Sequence, tokenizer, rows: int) -> list[dict]:
    """The first `rows` real rows of `out` (a rollout with its completions, or of episodes) as dicts of plain text
    and numbers. `examples` are the rollout's examples; `tokenizer` decodes the generated tokens."""
    picked = [b for b in range(len(out.example_B)) if out.example_B[b] != PAD][:rows]
    samples = []
    for b in picked:
        example = examples[int(out.example_B[b])]
        tokens = out.tokens_BxN[b]
        scores = {k: _number(v[b]) for k, v in (out.scores or {"reward": out.reward_B}).items()}
        if out.turns is None:
            text = tokenizer.decode(tokens[: int(out.length_B[b])].tolist(), skip_special_tokens=True)
            samples.append(
                {"example": int(out.example_B[b]), "prompt": example.prompt, "answer": example.answer,
                 "completion": text, "scores": scores}
            )  # fmt: skip
            continue
        t = out.turns
        turns = [
            {
                "observation": t.states[b][w] if w < len(t.states[b]) else "",
                "action": tokenizer.decode(
                    tokens[t.start_BxW[b, w] : t.end_BxW[b, w]].tolist(), skip_special_tokens=True
                ),
                "reward": _number(t.reward_BxW[b, w]),
            }
            for w in range(int(t.count_B[b]))
        ]
        samples.append(
            {"example": int(out.example_B[b]), "seed": example.meta.get("seed"), "turns": turns,
             "return": _number(out.reward_B[b]), "solved": bool(scores.get("accuracy", 0.0) > 0), "scores": scores}
        )  # fmt: skip
    return samples


def as_text(sample: dict) -> str:
    """One sample as a few lines for a terminal or TensorBoard's text tab."""
    if "turns" not in sample:
        scores = ", ".join(f"{k} {v:g}" for k, v in sample["scores"].items())
        return (
            f"prompt: {sample['prompt']!r}\nanswer: {sample['answer']!r}\ncompletion: {sample['completion']!r}\n"
            f"scores: {scores}"
        )
    lines = [f"episode of seed {sample['seed']}:"]
    for i, turn in enumerate(sample["turns"]):
        observation = turn["observation"].replace("\n", " / ")
        lines.append(f"  turn {i}: saw {observation!r}; wrote {turn['action']!r}; reward {turn['reward']:g}")
    lines.append(f"  return {sample['return']:g}, {'solved' if sample['solved'] else 'not solved'}")
    return "\n".join(lines)


def _number(x) -> float:
    return float(np.asarray(x, np.float64))
