"""Step verifiers: a score in [0, 1] for each step of a completion, behind one small interface so that a model-based
process reward model can be registered beside the rule-based one.

    verifier(example, steps) -> [score of each step]      (`steps`: the step texts, `esroll.steps.segment`)

Model output is untrusted text: a verifier reads it as a string, never evaluates or executes it, and returns a score
for every step of any text, in bounded time, without raising.

`equations` (the verifier of `arith_steps` and `gsm_symbolic`) checks what a step states. Every equation `a op b = c`
it writes (op one of + − * / × ÷; numbers with an optional sign and decimals) must be right in exact rational
arithmetic, and every number it uses must be known: a number of the question, or the result of an equation of an
earlier step (signs aside: "97-98" in a question gives 97 and 98). A step scores 1 when all of that holds, else 0; a
step that states no number scores 1 (nothing to check). A result an earlier step states counts as known even when that
step got it wrong, so only the step that makes an error scores 0, not the steps that carry it. So the worked line
"-1-44=-45" after "97-98=-1" scores 1, the same line with "=-46" scores 0, and the final "#### -45" scores 1 only when
some step stated -45.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from fractions import Fraction

from esroll.registry import Registry

MAX_DIGITS = 30  # longer numbers are not numbers (bounded arithmetic on hostile text)
MAX_STEP_CHARS = 2000  # only a step's last characters are read
_NUM = r"[-+]?[0-9]+(?:\.[0-9]+)?"
_EQUATION = re.compile(rf"({_NUM})[ \t]*([-+*/×÷])[ \t]*({_NUM})[ \t]*=[ \t]*({_NUM})")
_NUMBER = re.compile(r"[0-9]+(?:\.[0-9]+)?")

Verifier = Callable[..., list[float]]  # (example, steps: Sequence[str]) -> [score per step]
STEP_VERIFIERS: Registry[Verifier] = Registry("step verifier", "steps.verifier")


def register_verifier(name: str, fn: Verifier, *, replace: bool = False) -> Verifier:
    """Register a step verifier under `name`; refused if the name is taken, unless `replace`."""
    STEP_VERIFIERS.check_new(name, replace=replace)
    if not callable(fn):
        raise TypeError(f"step verifier {name!r}: {fn!r} is not callable")
    return STEP_VERIFIERS.add(name, fn, replace=replace)


def _number(text: str) -> Fraction | None:
    digits = text.lstrip("+-")
    if len(digits.replace(".", "")) > MAX_DIGITS:
        return None
    return Fraction(text)


def _apply(a: Fraction, op: str, b: Fraction) -> Fraction | None:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op in "*×":
        return a * b
    return None if b == 0 else a / b


def equations(example, steps: Sequence[str]) -> list[float]:
    """The `equations` verifier (see the module docstring)."""
    known = {abs(n) for n in (_number(m.group()) for m in _NUMBER.finditer(str(example.prompt)[-MAX_STEP_CHARS:]))}
    known.discard(None)
    scores = []
    for step in steps:
        text = step[-MAX_STEP_CHARS:] if isinstance(step, str) else ""
        ok, results, used = True, [], set()
        for m in _EQUATION.finditer(text):
            a, b, c = (_number(m.group(i)) for i in (1, 3, 4))
            used.update(range(*m.span()))
            if a is None or b is None or c is None:
                ok = False
                continue
            ok &= _apply(a, m.group(2), b) == c and abs(a) in known and abs(b) in known
            results.append(c)
        for m in _NUMBER.finditer(text):  # the numbers outside equations must be known too
            if m.start() not in used:
                value = _number(m.group())
                ok &= value is not None and (value in known or any(abs(value) == abs(r) for r in results))
        scores.append(1.0 if ok else 0.0)
        known.update(abs(r) for r in results)
    return scores


register_verifier("equations", equations)
