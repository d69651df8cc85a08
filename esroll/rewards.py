"""Rule-based rewards for GSM8K-style answers and Countdown expressions, and the registry of reward functions that
`data.reward` names (`register_reward`).

Pure Python: no JAX, and model output is never executed. Completions are hostile input, so every function here
returns within bounded time and never raises on any string:
- only the last `TAIL_CHARS` characters of a completion are searched (final answers come last), and every regex is
  linear-time;
- numbers longer than `MAX_NUMBER_DIGITS` digits are not numbers;
- Countdown expressions longer than `MAX_EXPR_CHARS` are rejected before `ast.parse`, and the tree is walked by hand.
Only ASCII digits count as digits (`str.isdigit` and `\\d` would accept '５' or Arabic-Indic digits).
"""

import ast
import collections
import operator
import re
from fractions import Fraction
from typing import Any, Callable, Sequence

import numpy as np

from esroll.config import LABEL_FREE
from esroll.registry import Registry

TAIL_CHARS = 4000
MAX_NUMBER_DIGITS = 30
MAX_EXPR_CHARS = 200

# A sign only counts when it is not glued to a preceding word or number ("3-4" is 3 and 4, "x = -4" is -4).
# Thousands separators must be well formed ("1,234,567"); a list "1,2,3" is three numbers.
_NUMBER = re.compile(r"(?:(?<![0-9A-Za-z_)\]])[-+])?[$€£]?(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]+)?%?")
_WINDOW = 40  # characters after an answer marker that may hold its number
# (marker, end of its window), in priority order; within a kind, the last marker with a number wins. The number must
# follow the marker directly, except inside a delimited window such as \boxed{...}, where it may appear anywhere.
_MARKERS = (
    (re.compile(r"####"), None),
    (re.compile(r"\\boxed\{"), "}"),
    (re.compile(r"(?i)\banswer(?:[ \t]{1,5}is\b|[ \t]{0,5}[:=])"), None),
)
_EXPR_CHARS = frozenset("0123456789+-*/() ")
_ALLOWED_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _canonical(token: str) -> str | None:
    """'-$1,234.50%' -> '-1234.5'; None when the number has too many digits."""
    negative = token.startswith("-")
    body = token.lstrip("+-").lstrip("$€£").rstrip("%").replace(",", "")
    whole, _, frac = body.partition(".")
    if len(whole) + len(frac) > MAX_NUMBER_DIGITS:
        return None
    whole, frac = whole.lstrip("0") or "0", frac.rstrip("0")
    text = whole + ("." + frac if frac else "")
    return "-" + text if negative and text != "0" else text


def parse_number(text: str) -> str | None:
    """Canonical form of `text` if it is exactly one number (decorations allowed), else None."""
    text = text.strip()
    m = _NUMBER.fullmatch(text) if len(text) <= 2 * MAX_NUMBER_DIGITS else None
    return _canonical(m.group()) if m else None


def _after_marker(tail: str, marker: re.Pattern, stop: str | None) -> str | None:
    """The number after the last `marker` that has one: directly after it, or anywhere before `stop` when the marker
    opens a delimited window (`\\boxed{...}`)."""
    for m in reversed(list(marker.finditer(tail))):
        window = tail[m.end() : m.end() + _WINDOW]
        if stop is not None:
            window = window.partition(stop)[0]
        window = window.lstrip(" \t\n:=*\\")
        first = _NUMBER.search(window) if stop is not None else _NUMBER.match(window)
        if first and (number := _canonical(first.group())) is not None:
            return number
    return None


def _last_number(tail: str) -> str | None:
    numbers = [n for m in _NUMBER.finditer(tail) if (n := _canonical(m.group())) is not None]
    return numbers[-1] if numbers else None


def extract_answer(completion: str) -> str | None:
    """The final numeric answer of a completion, canonicalised ('1,234.00' -> '1234'), or None.

    Priority: last `#### n`, last `\\boxed{n}`, last "answer is n" / "answer: n", then the last number anywhere.
    """
    if not isinstance(completion, str):
        return None
    tail = completion[-TAIL_CHARS:]
    for marker, stop in _MARKERS:
        if (number := _after_marker(tail, marker, stop)) is not None:
            return number
    return _last_number(tail)


def extract_strict(completion: str) -> str | None:
    """The number right after the last `####` (the GSM8K answer format), or None: the harnesses' strict match."""
    return _after_marker(completion[-TAIL_CHARS:], *_MARKERS[0]) if isinstance(completion, str) else None


def extract_flexible(completion: str) -> str | None:
    """The last number anywhere in the completion, or None: the harnesses' flexible extraction."""
    return _last_number(completion[-TAIL_CHARS:]) if isinstance(completion, str) else None


def parse_gold(gold: str) -> str | None:
    """Canonical gold number from a full GSM8K answer ('... #### 72') or a bare number string ('72')."""
    if "####" in gold:
        gold = gold.rpartition("####")[2]
    return parse_number(gold)


def gsm8k_reward(completion: str, gold: str, extract=extract_answer) -> float:
    """1.0 when the extracted answer equals the gold number exactly ('18' == '18.00' == '$18'), else 0.0.

    `extract` picks the answer: `extract_answer` (the reward: `####`, then other markers, then the last number),
    `extract_strict` or `extract_flexible` (the two scores GSM8K evaluations report). Raises ValueError for an
    unparseable gold, which is a data bug rather than a bad completion.
    """
    gold_number = parse_gold(gold)
    if gold_number is None:
        raise ValueError(f"gold answer is not a number: {gold[-80:]!r}")
    predicted = extract(completion)
    return float(predicted is not None and Fraction(predicted) == Fraction(gold_number))


def extract_expression(completion: str) -> tuple[str | None, bool]:
    """The proposed Countdown expression and whether it came from an `<answer>` tag.

    Prefers the content of the last `<answer>...</answer>`; otherwise the last line made only of digits, + - * / ( )
    and spaces, optionally followed by "= target". '×' and '÷' are read as '*' and '/'.
    """
    if not isinstance(completion, str):
        return None, False
    tail = completion[-TAIL_CHARS:]
    end = tail.rfind("</answer>")
    start = tail.rfind("<answer>", 0, end) if end >= 0 else -1
    if start >= 0:
        return _clean_expression(tail[start + len("<answer>") : end]), True
    for line in reversed(tail.splitlines()):
        if (expression := _clean_expression(line)) is not None:
            return expression, False
    return None, False


def _clean_expression(text: str) -> str | None:
    """'(3 + 5) × 2 = 16' -> '(3 + 5) * 2'; None unless both sides of an optional '=' are expression characters."""
    text = text.replace("×", "*").replace("÷", "/")
    expression, _, result = text.partition("=")
    expression = expression.strip()
    if expression and len(expression) <= MAX_EXPR_CHARS and set(expression) | set(result) <= _EXPR_CHARS:
        return expression
    return None


class _Illegal(Exception):
    pass


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    """Exact value of an expression tree of int literals and binary + - * /; records the literals in `used`."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _ALLOWED_OPS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise _Illegal("division by zero")
        return _ALLOWED_OPS[type(node.op)](left, right)
    raise _Illegal(type(node).__name__)


def evaluate_countdown(expression: str, numbers: Sequence[int]) -> Fraction | None:
    """Exact value of a legal Countdown expression, or None if it is illegal.

    Rules (the common TinyZero-style variant): binary + - * / over integer literals, with exact rational division
    (division by zero is illegal); no unary minus or plus, since negating a number is not a Countdown operation; each
    given number may be used at most as many times as it is given, and not all numbers need to be used.
    """
    if len(expression) > MAX_EXPR_CHARS or not set(expression) <= _EXPR_CHARS:
        return None
    used: list[int] = []
    try:
        value = _evaluate(ast.parse(expression, mode="eval").body, used)
    except (_Illegal, SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return None
    if not collections.Counter(used) <= collections.Counter(numbers):
        return None
    return value


def countdown_reward(completion: str, numbers: Sequence[int], target: int, *, format_reward: float = 0.0) -> float:
    """1.0 when the proposed expression is legal and equals `target` exactly; `format_reward` when an `<answer>` tag
    was given but its expression is wrong or illegal; else 0.0. See `evaluate_countdown` for the rules."""
    expression, tagged = extract_expression(completion)
    value = evaluate_countdown(expression, numbers) if expression is not None else None
    if value is not None and value == target:
        return 1.0
    return format_reward if tagged else 0.0


# ---- the reward registry: the names `data.reward` takes

RewardFn = Callable[[Any, str], float]
# `data.reward`'s label-free mode ("majority"): a vote among a prompt's completions, not a function
REWARDS: Registry[RewardFn] = Registry("reward", "data.reward", reserved=(LABEL_FREE,))


def register_reward(name: str, fn: RewardFn | None = None, *, replace: bool = False):
    """Make `fn` the reward that `data.reward = name` trains on (every method: ES fitness, GRPO rewards).

    fn(example, completion) -> float: the reward of one completion for one `esroll.data.Example`; `completion` is
    the example's prefix (empty unless AdaPrefix forces one) followed by the decoded generated text. Completions are
    hostile input: read them as text, never evaluate or execute them, and return a finite float in bounded time for
    every string without raising (as this module's functions do: search a bounded tail, linear-time regexes).
    Held-out evaluation does not read it: it always scores the task's own reward ("gold", `esroll.data.TaskSpec`),
    so accuracies stay comparable whatever reward trained the model.

    "gold" (the task's own reward) is registered by `esroll.data`; "majority" is not a function but the label-free
    mode and cannot be registered. A name already registered is refused unless `replace` is set, so that a typo
    cannot silently swap a reward. Returns `fn`; without `fn`, a decorator that registers what it decorates."""
    if fn is None:
        return lambda f: register_reward(name, f, replace=replace)
    REWARDS.check_new(name, replace=replace)
    if not callable(fn):
        raise TypeError(f"reward {name!r}: {fn!r} is not callable")
    return REWARDS.add(name, fn, replace=replace)


def reward_names() -> tuple[str, ...]:
    """Every value `data.reward` takes: the registered rewards and the label-free mode, "gold" first."""
    return ("gold", LABEL_FREE, *(n for n in REWARDS if n != "gold"))


def get_reward(name: str) -> RewardFn:
    """The reward function registered as `name`."""
    return REWARDS.lookup(name)


# ---- the label-free mode: votes among a prompt's completions


def majority_rewards(answers: np.ndarray) -> np.ndarray:
    """The label-free reward: 1 where a response's answer is a modal answer of its row (ties: every tied answer),
    0 elsewhere and for no answer (-1). answers [X, M] int -> [X, M] float32.

    A response's reward depends on the other responses of its row. In ES (`esroll.es.method.member_fitness`) a row
    holds every member's answers to one prompt, so member i's fitness depends on the other members' perturbations
    and theirs on member i's: LOO-ROLL's leave-one-out baseline is then not independent of member i's direction, and
    neither ES estimator is unbiased for the population field (docs/theory.md)."""
    a = np.asarray(answers)
    same = (a[:, :, None] == a[:, None, :]) & (a[:, None, :] >= 0)
    counts = same.sum(-1)  # how many responses of the row share each response's answer
    top = counts.max(1, keepdims=True)
    return ((counts == top) & (a >= 0) & (top > 0)).astype(np.float32)


def answer_id(answer: str | None) -> int:
    """A parsed answer as a stable non-negative integer below 2^52 (exact in float64, the same on every host and
    process); -1 for no answer."""
    import hashlib

    if answer is None:
        return -1
    return int(hashlib.blake2b(answer.encode(), digest_size=8).hexdigest(), 16) >> 12
