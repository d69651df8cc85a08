"""Prefix judges (ExpRL): a judge that holds the task's reference solution, hidden from the policy, rates how far each
prefix of a completion has got toward it, on a scale of 1 to 5; the step-level signal of `exprl` (DeltaNorm,
`esroll.grpo.estimators.exprl`) and of ES's dense fitness (`es.step_weight` with `steps.verifier = "exprl"`).

    judge(example, prefixes) -> [judgement per prefix]    (prefixes[k]: the completion's text through step k)

A judgement is what the judge answered: a number or a text such as "4" or "Score: 4". `read_judgement` reads it as an
integer score 1–5, or None when it cannot (another number, another text, a non-finite value); `judge_verifier` turns a
judge into a step verifier (`esroll.steps.verify`) whose score for step k is s_k = (score − 1) / 4 of the prefix
through step k, NaN where the judgement was unreadable (DeltaNorm then drops the row; ES's dense fitness averages
the steps that have a score, and a row with none gets 0 for that part). A model-based judge (an LLM given the
question, the reference and the prefix) registers the same way as the rule-based one.

`reference_progress`, the rule-based judge registered as the verifier `exprl` (arith_steps, GSM-Symbolic, any task
whose reference solution states its intermediate values as equations): the reference's values are the results of its
equations, in order ("97-98=-1", "-1-44=-45", "-45-25=-70": −1, −45, −70), and its final "#### n" when no equation
gives n. A prefix has reached a value when it states it as the result of an equation that holds (exactly, as the
`equations` verifier checks arithmetic) or as its "#### n"; each of the reference's values is matched at most once.
With a share p of them reached, the score is 1 + round(4p) (halves rounding up): none reached 1, all 5. A reference
with no value to read gets no judgement (None). Model output is read as text, never evaluated.
"""

from __future__ import annotations

import math
import numbers
import re
from collections import Counter
from collections.abc import Callable, Sequence
from fractions import Fraction

import numpy as np

from esroll.steps.verify import (
    _ANSWER,
    _EQUATION,
    MAX_STEP_CHARS,
    _holds,
    _number,
    parse_equation,
    register_verifier,
)

Judge = Callable[..., Sequence[object]]  # (example, prefixes: Sequence[str]) -> [judgement per prefix]
MAX_PREFIX_CHARS = 8 * MAX_STEP_CHARS  # only a prefix's last characters are read
_SCORE = re.compile(r"\s*(?:score\s*[:=]?\s*)?([1-5])\s*(?:/\s*5)?\s*\.?\s*", re.IGNORECASE)


def read_judgement(judgement: object) -> int | None:
    """An integer score 1–5 from a judge's answer: a whole real number in 1..5 (numpy's too), or a text that is
    only such a digit, optionally after "score" (with ":" or "=") and before "/5" ("4", "Score: 4", "score=4/5");
    None for anything else (another number, a bool, a longer text, NaN)."""
    if isinstance(judgement, bool | np.bool_):
        return None
    if isinstance(judgement, numbers.Real):
        if not math.isfinite(judgement) or judgement != int(judgement) or not 1 <= judgement <= 5:
            return None
        return int(judgement)
    if isinstance(judgement, str) and len(judgement) <= 64:
        m = _SCORE.fullmatch(judgement)
        return int(m.group(1)) if m else None
    return None


def _results(text: str) -> list[Fraction]:
    """The signed values a text states as results of equations that hold, and as its "#### n"."""
    values = []
    for m in _EQUATION.finditer(text):
        parsed = parse_equation(m)
        if parsed is not None and _holds(m, *parsed):
            values.append(parsed[2][0])
    for m in _ANSWER.finditer(text):
        answer = _number(m.group(1))
        if answer is not None:
            values.append(answer[0])
    return values


def reference_values(example) -> list[Fraction]:
    """The values a reference solution reaches in order: its equations' results (whether or not they hold: it is the
    reference), then its final "#### n" when no equation gives n."""
    text = str(example.solution)[-MAX_PREFIX_CHARS:]
    values = []
    for m in _EQUATION.finditer(text):
        result = _number(m.group(3))
        if result is not None:
            values.append(result[0])
    answers = [a for a in (_number(m.group(1)) for m in _ANSWER.finditer(text)) if a is not None]
    if answers and answers[-1][0] not in values:
        values.append(answers[-1][0])
    return values


def reference_progress(example, prefixes: Sequence[str]) -> list[int | None]:
    """The rule-based judge (see the module docstring): 1 + round(4 · share of the reference's values reached) per
    prefix; None for every prefix when the reference has no value to read."""
    wanted = Counter(reference_values(example))
    total = sum(wanted.values())
    judgements: list[int | None] = []
    for prefix in prefixes:
        if not total:
            judgements.append(None)
            continue
        text = prefix[-MAX_PREFIX_CHARS:] if isinstance(prefix, str) else ""
        reached = sum((Counter(_results(text)) & wanted).values())
        judgements.append(1 + math.floor(4 * Fraction(reached, total) + Fraction(1, 2)))
    return judgements


def judge_verifier(judge: Judge) -> Callable[..., list[float]]:
    """A step verifier from a prefix judge: step k scores s_k = (score − 1) / 4 of the prefix through step k (the
    steps joined as the completion wrote them), NaN where the judgement is unreadable (`read_judgement`) or missing
    (a judge that answers fewer prefixes than it was given)."""

    def verifier(example, steps: Sequence[str]) -> list[float]:
        steps = [s if isinstance(s, str) else "" for s in steps]
        prefixes = ["".join(steps[: k + 1]) for k in range(len(steps))]
        judgements = list(judge(example, prefixes))
        scores = []
        for k in range(len(steps)):
            score = read_judgement(judgements[k]) if k < len(judgements) else None
            scores.append(float("nan") if score is None else (score - 1) / 4)
        return scores

    name = getattr(judge, "__name__", "judge")
    verifier.__name__ = f"judged_by_{name}"
    verifier.__doc__ = f"Step scores s_k = (score - 1) / 4 of each prefix as {name} judges it."
    return verifier


register_verifier("exprl", judge_verifier(reference_progress))
