"""The built-in tasks, registered through `esroll.data.register_task` as a user's task would be.

arithmetic, gsm8k and gsm_symbolic are scored by the final number of a completion (`esroll.rewards.extract_answer`
against the gold number), which is also what the label-free mode votes on, and report GSM8K's strict and flexible
matches as extra held-out scores; arith_steps (chains worked one equation per line, ending in "#### n") is scored
by the number after its `####`, with the same extra scores; countdown is scored by its expression rules and has no label-free mode (its reward
needs no answer key).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Hashable, Sequence

from esroll import rewards
from esroll.config import ConfigError, DataConfig, check_fields
from esroll.data.batching import split_examples
from esroll.data.gsm8k import load_gsm8k
from esroll.data.gsm_symbolic import make_gsm_symbolic_splits
from esroll.data.synthetic import make_arith_steps, make_arithmetic, make_countdown
from esroll.data.tasks import Example, register_task, task_options


def numeric_reward(example: Example, completion: str) -> float:
    """1.0 when the completion's final number equals the gold one (`esroll.rewards.gsm8k_reward`)."""
    return rewards.gsm8k_reward(completion, example.answer)


def numeric_answer(example: Example, completion: str) -> str | None:
    """The completion's final number, canonical, or None."""
    return rewards.extract_answer(completion)


NUMERIC_SCORES = {
    "strict": lambda e, c: rewards.gsm8k_reward(c, e.answer, rewards.extract_strict),
    "flexible": lambda e, c: rewards.gsm8k_reward(c, e.answer, rewards.extract_flexible),
}


def countdown_reward(example: Example, completion: str) -> float:
    """1.0 for a legal expression of the example's numbers that equals its target (`esroll.rewards.countdown_reward`)."""
    return rewards.countdown_reward(completion, example.meta["numbers"], example.meta["target"])


def _held_out(rows: list[Example], cfg: DataConfig) -> tuple[list[Example], list[Example]]:
    distinct = len({e.prompt for e in rows})
    if cfg.eval_size > distinct:
        raise ConfigError(
            "data.eval_size",
            cfg.eval_size,
            f"at most {distinct}: data.task={cfg.task!r} has {distinct} distinct prompts at this data.n_examples",
        )
    train, held_out = split_examples(rows, cfg.eval_size, cfg.seed)
    if not train:
        raise ValueError(f"config: no training examples left for data.task={cfg.task!r} after the held-out split")
    return train, held_out


def arithmetic_splits(cfg: DataConfig) -> tuple[list[Example], list[Example]]:
    """`n_examples` generated sums (`digits`, `ops`, `n_terms`, `word_problems`) from `seed`, `eval_size` of the
    distinct prompts held out."""
    rows = make_arithmetic(
        cfg.n_examples,
        cfg.seed,
        digits=cfg.digits,
        ops=tuple(cfg.ops),
        n_terms=cfg.n_terms,
        word_problems=cfg.word_problems,
    )
    return _held_out(rows, cfg)


@dataclasses.dataclass(frozen=True)
class ArithStepsOptions:
    """arith_steps' options (`data.options.arith_steps.*`): chains of min_operands to max_operands operands of
    `digits` digits, operators drawn from `ops` (+ and −)."""

    min_operands: int = 3
    max_operands: int = 4
    digits: int = 2
    ops: str = "+-"

    def __post_init__(self):
        checks = [
            ("min_operands", self.min_operands >= 2, ">= 2"),
            ("max_operands", self.max_operands >= self.min_operands, ">= min_operands"),
            ("digits", 1 <= self.digits <= 6, "in [1, 6]"),
            ("ops", bool(self.ops) and set(self.ops) <= {"+", "-"}, "a non-empty string of + and -"),
        ]
        check_fields(self, checks, "ArithStepsOptions")


_EQUATION_END = re.compile(r"=\s*(-?\d{1,12})\s*$")
_FINAL = re.compile(r"^\s*####\s*(-?\d{1,12})\s*$")


def running_value_states(example: Example, steps: Sequence[str]) -> list[Hashable]:
    """arith_steps' state after each step: ("value", equations so far, the value the step's equation ends with) for a
    step whose text ends in "= n", ("answer", n) for the final "#### n", and otherwise the exact text so far (as
    `prefix_states`). So "97-98=-1" and "97 - 98 = -1" reach the same state, and so do two chains that took different
    but equally right (or equally wrong) steps to the same running value. Reads the text with two anchored regular
    expressions of bounded numbers: any text gets a key, none raises."""
    keys, done, text = [], 0, ""
    for step in steps:
        text += step
        final, equation = _FINAL.match(step), _EQUATION_END.search(step.strip())
        if final:
            keys.append(("answer", int(final.group(1))))
        elif equation:
            done += 1
            keys.append(("value", done, int(equation.group(1))))
        else:
            keys.append(text)
    return keys


def arith_steps_splits(cfg: DataConfig) -> tuple[list[Example], list[Example]]:
    """`n_examples` chains worked one equation per line (`esroll.data.synthetic.make_arith_steps`, shaped by the
    task's options) from `seed`, `eval_size` of the distinct prompts held out."""
    o = task_options(cfg)
    rows = make_arith_steps(
        cfg.n_examples, cfg.seed, min_operands=o.min_operands, max_operands=o.max_operands, digits=o.digits, ops=o.ops
    )
    return _held_out(rows, cfg)


def final_answer_reward(example: Example, completion: str) -> float:
    """1.0 when the number after the completion's `####` equals the gold one: a worked solution is scored on the answer
    it ends with, not on a number met along the way."""
    return rewards.gsm8k_reward(completion, example.answer, rewards.extract_strict)


def final_answer(example: Example, completion: str) -> str | None:
    """The number after the completion's `####`, canonical, or None."""
    return rewards.extract_strict(completion)


def countdown_splits(cfg: DataConfig) -> tuple[list[Example], list[Example]]:
    """`n_examples` generated Countdown problems of `countdown_numbers` numbers from `seed`, `eval_size` held out."""
    return _held_out(make_countdown(cfg.n_examples, cfg.seed, n_numbers=cfg.countdown_numbers), cfg)


def gsm_symbolic_splits(cfg: DataConfig) -> tuple[list[Example], list[Example]]:
    """`n_examples` GSM-Symbolic problems, split by template rather than by prompt (see `esroll.data.gsm_symbolic`):
    `eval_size` held-out rows from templates never trained on, the rest for training."""
    if cfg.n_examples <= cfg.eval_size:
        raise ValueError(
            f"config: data.n_examples={cfg.n_examples} leaves no training examples after "
            f"data.eval_size={cfg.eval_size} for data.task='gsm_symbolic'"
        )
    return make_gsm_symbolic_splits(cfg.n_examples - cfg.eval_size, cfg.eval_size, cfg.seed)


def gsm8k_splits(cfg: DataConfig) -> tuple[list[Example], list[Example]]:
    """GSM8K read from `path`; held out: the first `eval_size` rows of `eval_path` (training questions equal to one of
    them dropped), or without `eval_path`, `eval_size` prompts split off the training data."""
    if not cfg.path:
        raise ValueError("config: 'data.path' must name a GSM8K file or dataset for data.task='gsm8k'")
    rows = load_gsm8k(cfg.path, split="train")
    if cfg.eval_path:
        held_out = load_gsm8k(cfg.eval_path, split="test")[: cfg.eval_size]
        seen = {e.prompt for e in held_out}
        return [e for e in rows if e.prompt not in seen], held_out
    return _held_out(rows, cfg)


register_task(
    "gsm8k",
    gsm8k_splits,
    numeric_reward,
    parse_answer=numeric_answer,
    eval_scores=NUMERIC_SCORES,
    reads=("path", "eval_path"),
)
register_task(
    "arithmetic",
    arithmetic_splits,
    numeric_reward,
    parse_answer=numeric_answer,
    eval_scores=NUMERIC_SCORES,
    reads=("n_examples", "digits", "ops", "n_terms", "word_problems"),
)
register_task("countdown", countdown_splits, countdown_reward, reads=("n_examples", "countdown_numbers"))
register_task(
    "gsm_symbolic",
    gsm_symbolic_splits,
    numeric_reward,
    parse_answer=numeric_answer,
    eval_scores=NUMERIC_SCORES,
    reads=("n_examples",),
)
register_task(
    "arith_steps",
    arith_steps_splits,
    final_answer_reward,
    parse_answer=final_answer,
    eval_scores=NUMERIC_SCORES,
    reads=("n_examples",),
    options=ArithStepsOptions,
    step_state=running_value_states,
)
