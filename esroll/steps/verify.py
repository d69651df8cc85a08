"""Step verifiers: a score in [0, 1] for each step of a completion, behind one small interface so that a model-based
process reward model can be registered beside the rule-based one.

    verifier(example, steps) -> [score of each step]      (`steps`: the step texts, `esroll.steps.segment`)

Model output is untrusted text: a verifier reads it as a string, never evaluates or executes it, and returns a score
for every step of any text, in bounded time, without raising.

`equations` (the verifier of `arith_steps` and `gsm_symbolic`) checks the arithmetic a step states. Every equation
it writes, `a op b op ... = c` (op one of + − * / × ÷, or "x" between numbers; × and ÷ before + and −), must hold, and
every number it computes with must be known. A number may carry a sign, decimals, thousands commas, a leading
currency sign, a trailing "%", and words of unit (up to 40 characters) ("300 meters / 50 meters/minute = 6 minutes").

- Holds: exactly, in rational arithmetic, for a whole-number result; a result written with d decimals must be the
  exact value rounded to d decimals ("12 x 0.6666666666666666 = 8.0"); a percentage is read as written or as a
  fraction ("$1260 * 5% = $63", "50% * 50% = 25%").
- Known: a number of the question (its digits, a percentage also as a fraction, number words such as "twice",
  "dozen", "half" also as 1/2), a number stated earlier in the solution (worked solutions state quantities in prose:
  "The first 4 have 1200 apartments"), or a conversion a solution may bring (100, 60, 24, 7, 12, 52, 1000, 1).
- The final "#### n" must be a number of the question or one stated before it.

A step scores 1 when all of that holds, else 0; a step with no equation and no "####" scores 1 (nothing to check).
A result an earlier step states counts as known even when that step got it wrong, so only the step that makes an
error scores 0, not the steps that carry it: the worked line "-1-44=-45" after "97-98=-1" scores 1, the same line with
"=-46" scores 0, and the final "#### -45" scores 1 only when some step stated 45.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from fractions import Fraction

from esroll.registry import Registry

MAX_DIGITS = 30  # longer numbers are not numbers (bounded arithmetic on hostile text)
MAX_STEP_CHARS = 2000  # only a step's last characters are read
MAX_OPERANDS = 8  # longer chains are not read as one equation
_NUM = r"[-+−]?[$€£¥]?[0-9][0-9,]*(?:\.[0-9]+)?%?"
_UNIT = r"(?:/[A-Za-z]+)?(?:[ \t]+[A-Za-z][A-Za-z' \t/]{0,40}(?<=[A-Za-z]))?"  # words of unit after a number
_OP = r"[-+*/×÷−]|(?<=[ \t0-9])[xX](?=[ \t0-9$])"
_EQUATION = re.compile(
    rf"({_NUM}){_UNIT}((?:[ \t]*(?:{_OP})[ \t]*{_NUM}{_UNIT}){{1,{MAX_OPERANDS - 1}}})[ \t]*=[ \t]*({_NUM})"
)
_TERM = re.compile(rf"[ \t]*({_OP})[ \t]*({_NUM}){_UNIT}")
_NUMBER = re.compile(r"[0-9][0-9,]*(?:\.[0-9]+)?")
_ANSWER = re.compile(rf"####[ \t]*({_NUM})")
_WORDS = {
    "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10,
    "eleven": 11, "twelve": 12, "twice": 2, "double": 2, "doubles": 2, "half": 2, "halves": 2, "triple": 3,
    "thrice": 3, "third": 3, "thirds": 3, "quarter": 4, "quarters": 4, "dozen": 12, "dozens": 12, "percent": 100,
}  # fmt: skip
_FRACTIONS = ("half", "halves", "third", "thirds", "quarter", "quarters")  # also known as 1/2, 1/3, 1/4
_WORD = re.compile(r"[A-Za-z]+")
CONVERSIONS = (1, 100, 60, 24, 7, 12, 52, 1000)  # numbers a worked solution may bring without the question stating them
_CONVERSIONS = frozenset(Fraction(c) for c in CONVERSIONS)

Verifier = Callable[..., list[float]]  # (example, steps: Sequence[str]) -> [score per step]
STEP_VERIFIERS: Registry[Verifier] = Registry("step verifier", "steps.verifier")


def register_verifier(name: str, fn: Verifier, *, replace: bool = False) -> Verifier:
    """Register a step verifier under `name`; refused if the name is taken, unless `replace`."""
    STEP_VERIFIERS.check_new(name, replace=replace)
    if not callable(fn):
        raise TypeError(f"step verifier {name!r}: {fn!r} is not callable")
    return STEP_VERIFIERS.add(name, fn, replace=replace)


def _number(text: str) -> tuple[Fraction, int] | None:
    """(value, decimals written) of a number as the equations write it, or None past MAX_DIGITS digits."""
    negative = text.startswith(("-", "−"))
    digits = text.lstrip("+-−").lstrip("$€£¥").rstrip("%").replace(",", "")
    if not digits or len(digits.replace(".", "")) > MAX_DIGITS:
        return None
    value = Fraction(digits)
    return (-value if negative else value), len(digits.partition(".")[2])


def _evaluate(first: Fraction, terms: list[tuple[str, Fraction]]) -> Fraction | None:
    """first op b op c ... with × and ÷ before + and −, left to right; None on a division by zero."""
    sums, product = [], first
    for op, value in terms:
        if op in "*/×÷xX":
            if op in "/÷" and value == 0:
                return None
            product = product / value if op in "/÷" else product * value
        else:
            sums.append(product)
            product = value if op == "+" else -value
    return sum(sums, Fraction(0)) + product


def _right(value: Fraction | None, stated: Fraction, decimals: int) -> bool:
    """Whether `stated` (written with `decimals` decimals) is `value`: exactly, or rounded to those decimals."""
    if value is None:
        return False
    if decimals == 0:
        return value == stated
    return abs(value - stated) * 2 * 10**decimals <= 1 or abs(value - stated) <= abs(stated) * Fraction(1, 10**9)


def _known_in(question: str) -> set[Fraction]:
    """The numbers of a question: its numbers (a percentage also as a fraction) and its number words (a fraction
    word also as its fraction)."""
    known = set()
    for m in _NUMBER.finditer(question):
        n = _number(m.group())
        if n is not None:
            known.add(abs(n[0]))
            if question.startswith("%", m.end()):
                known.add(abs(n[0]) / 100)
    for word in _WORD.findall(question):
        value = _WORDS.get(word.lower())
        if value is not None:
            known.add(Fraction(value))
            if word.lower() in _FRACTIONS:
                known.add(Fraction(1, value))
    return known


def _holds(m: re.Match, first: Fraction, terms: list, result: tuple[Fraction, int]) -> bool:
    """Whether the equation `m` holds with its percentages read as written (25% as 25) or as fractions (0.25, the
    result then also in percent)."""
    value = _evaluate(first, [(op, v[0]) for op, v in terms])
    if _right(value, *result):
        return True
    if "%" not in m.group(0):
        return False
    operands = [m.group(1), *(t.group(2) for t in _TERM.finditer(m.group(2)))]
    scaled = [x / 100 if text.endswith("%") else x for x, text in zip([first, *(v[0] for _, v in terms)], operands)]
    value = _evaluate(scaled[0], [(op, x) for (op, _), x in zip(terms, scaled[1:])])
    return value is not None and (_right(value, *result) or (m.group(3).endswith("%") and _right(value * 100, *result)))


def _stated(text: str) -> set[Fraction]:
    """The numbers a text states (absolute values)."""
    return {abs(n[0]) for n in (_number(m.group()) for m in _NUMBER.finditer(text)) if n is not None}


def parse_equation(m: re.Match) -> tuple[Fraction, list, tuple[Fraction, int]] | None:
    """(first operand, [(op, (value, decimals))] of the rest, (result, decimals)) of an `_EQUATION` match, or None
    when one of its numbers does not read (past MAX_DIGITS): what `equations` and the ExpRL judge read of it."""
    first, result = _number(m.group(1)), _number(m.group(3))
    terms = [(t.group(1).replace("−", "-"), _number(t.group(2))) for t in _TERM.finditer(m.group(2))]
    if first is None or result is None or any(v is None for _, v in terms):
        return None
    return first[0], terms, result


def equations(example, steps: Sequence[str]) -> list[float]:
    """The `equations` verifier (see the module docstring)."""
    known = _known_in(str(example.prompt)[-MAX_STEP_CHARS:])
    scores = []
    for step in steps:
        text = step[-MAX_STEP_CHARS:] if isinstance(step, str) else ""
        ok, results = True, []
        for m in _EQUATION.finditer(text):
            parsed = parse_equation(m)
            if parsed is None:
                ok = False
                continue
            first, terms, result = parsed
            operands = [first, *(v[0] for _, v in terms)]
            stated = known | _CONVERSIONS | _stated(text[: m.start()])
            ok &= _holds(m, first, terms, result) and all(abs(x) in stated for x in operands)
            results.append(abs(result[0]))
        for m in _ANSWER.finditer(text):
            answer = _number(m.group(1))
            ok &= answer is not None and (abs(answer[0]) in known or abs(answer[0]) in results)
        scores.append(1.0 if ok else 0.0)
        known.update(results)
        known.update(_stated(text))
    return scores


register_verifier("equations", equations)
