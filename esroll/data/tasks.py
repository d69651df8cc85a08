"""The row type shared by every task, prompt formatting, and scoring a completion against a row."""

import dataclasses
from typing import Any, Literal, Mapping

from esroll import rewards

TASKS = ("gsm8k", "arithmetic", "countdown", "gsm_symbolic")
NUMERIC_TASKS = ("gsm8k", "gsm_symbolic", "arithmetic")  # scored by the final number of the completion

# The fixed "plain" template. The tiny shipped model is trained on synthetic arithmetic with exactly this template
# and the completion `Example.target_text` (" 47"), so changing it invalidates that model.
PLAIN_TEMPLATE = "Question: {question}\nAnswer:"
TEMPLATES = ("plain", "chat")


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt and what counts as answering it.

    task: which reward applies ("gsm8k", "gsm_symbolic" and "arithmetic": final number; "countdown": expression).
    prompt: the question text, before any template.
    answer: the canonical gold number, e.g. "42".
    solution: a worked solution in GSM8K form ending in "#### <answer>" (Countdown: the constructing expression).
    target_text: the supervised completion after the template, e.g. " 47" (the trainer appends EOS).
    meta: task data the reward needs; Countdown stores `numbers` (a tuple) and `target` (an int). GSM-Symbolic stores
        the `template` id (an int) and its `draw`; sums store their `difficulty` (carries).
    prefix: a forced start of the answer, placed after the prompt (AdaPrefix, `esroll.curriculum`); the reward scores
        prefix + completion. Empty for every example a data loader makes.
    """

    task: str
    prompt: str
    answer: str
    solution: str
    target_text: str
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    prefix: str = ""


def format_prompt(
    question: str,
    tokenizer: Any = None,
    template: Literal["plain", "chat"] = "plain",
    system: str | None = None,
) -> str:
    """The model input for a question.

    "plain" fills `PLAIN_TEMPLATE` (after `system` and a blank line, if given). "chat" applies the tokenizer's chat
    template with a generation prompt and `enable_thinking=False` (Qwen3 non-thinking mode; templates that do not
    know the flag ignore it, since transformers forwards extra keyword arguments to the template).
    """
    if template == "plain":
        text = PLAIN_TEMPLATE.format(question=question)
        return f"{system}\n\n{text}" if system else text
    if template == "chat":
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("template='chat' needs a tokenizer with a chat template; use template='plain'")
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
    raise ValueError(f"unknown prompt template {template!r}; expected one of {', '.join(TEMPLATES)}")


def score(example: Example, completion: str) -> float:
    """The reward of one completion for one row, picked by `example.task`."""
    if example.task in NUMERIC_TASKS:
        return rewards.gsm8k_reward(completion, example.answer)
    if example.task == "countdown":
        return rewards.countdown_reward(completion, example.meta["numbers"], example.meta["target"])
    raise ValueError(f"unknown task {example.task!r}; expected one of {TASKS}")


def parse_answer(example: Example, completion: str) -> str | None:
    """The answer a completion gives, canonical (what label-free rewards vote on): the final number for numeric
    tasks; None if there is none. Countdown has no label-free mode (its reward needs no gold answer)."""
    if example.task in NUMERIC_TASKS:
        return rewards.extract_answer(completion)
    raise ValueError(f"task {example.task!r} has no parsed answer to vote on (label-free rewards: {NUMERIC_TASKS})")


def cluster_key(example: Example, key: str) -> str:
    """The cluster an example belongs to (BV-Blend's history, adaptive data schedules): `key` is "task", "difficulty"
    (`meta["difficulty"]` when the generator sets one, e.g. the carries of a sum; else the number of steps of the
    worked solution) or the name of a field of `example.meta`."""
    if key == "task":
        return example.task
    if key == "difficulty":
        if "difficulty" in example.meta:
            return f"difficulty={example.meta['difficulty']}"
        steps = [line for line in example.solution.split("####")[0].splitlines() if line.strip()]
        return f"steps={len(steps)}"
    if key not in example.meta:
        raise ValueError(
            f"cluster key {key!r}: the {example.task} examples have no such meta field ({sorted(example.meta)})"
        )
    return f"{key}={example.meta[key]}"


def eval_score_names(task: str) -> tuple[str, ...]:
    """What held-out evaluation logs per completion of `task`: the reward ("accuracy") and, for numeric answers, the
    two scores GSM8K harnesses report: "strict" (the number after `####`) and "flexible" (the last number)."""
    return ("accuracy", "strict", "flexible") if task in NUMERIC_TASKS else ("accuracy",)


def eval_scores(example: Example, completion: str) -> tuple[float, ...]:
    """The scores `eval_score_names(example.task)` names, for one completion."""
    if example.task not in NUMERIC_TASKS:
        return (score(example, completion),)
    return tuple(
        rewards.gsm8k_reward(completion, example.answer, extract)
        for extract in (rewards.extract_answer, rewards.extract_strict, rewards.extract_flexible)
    )
