"""Synthetic tasks, deterministic from a seed: arithmetic in the GSM8K schema, arithmetic worked in steps, Countdown.

They need no download, their difficulty is a knob, and their answers are short, so a tiny model can learn them.
"""

from typing import Sequence

import numpy as np

from esroll.data.tasks import Example

_NAMES = ("Tom", "Ana", "Li", "Sara", "Omar", "Maya", "Ben", "Zoe")
_ITEMS = ("apples", "books", "coins", "marbles", "stickers", "pencils", "cards", "shells")


def _pick(rng: np.random.Generator, options: Sequence[str]) -> str:
    return options[int(rng.integers(len(options)))]


def _operand(rng: np.random.Generator, digits: int) -> int:
    low = 10 ** (digits - 1) if digits > 1 else 1
    return int(rng.integers(low, 10**digits))


def _eval_precedence(terms: list[int], ops: list[str]) -> int:
    """Value of `t0 op0 t1 op1 ...` with * binding tighter than + and -."""
    total, sign, product = 0, 1, terms[0]
    for op, term in zip(ops, terms[1:]):
        if op == "*":
            product *= term
        else:
            total, sign, product = total + sign * product, (1 if op == "+" else -1), term
    return total + sign * product


def carries(terms: list[int]) -> int:
    """The carries of adding `terms` column by column (the difficulty bucket of a sum)."""
    count, carry, column = 0, 0, 0
    while any(t // 10**column for t in terms) or carry:
        carry = (sum(t // 10**column % 10 for t in terms) + carry) // 10
        count += carry > 0
        column += 1
    return count


def _expression_row(terms: list[int], ops: list[str]) -> tuple[str, str, int]:
    expression = " ".join([str(terms[0])] + [f"{op} {t}" for op, t in zip(ops, terms[1:])])
    value = _eval_precedence(terms, ops)
    return f"What is {expression}?", f"{expression} = {value}", value


def _word_row(rng: np.random.Generator, terms: list[int], ops: list[str]) -> tuple[str, str, int]:
    """A story read left to right; a take-away never exceeds what is held, so counts stay non-negative."""
    name, item = _pick(rng, _NAMES), _pick(rng, _ITEMS)
    sentences, steps, total = [f"{name} has {terms[0]} {item}."], [], terms[0]
    for op, term in zip(ops, terms[1:]):
        if op == "+":
            sentences.append(f"{name} gets {term} more.")
            new = total + term
        elif op == "-":
            term = min(term, total)
            sentences.append(f"{name} gives away {term}.")
            new = total - term
        else:
            sentences.append(f"{name} then has {term} times as many.")
            new = total * term
        steps.append(f"{total} {op} {term} = {new}")
        total = new
    sentences.append(f"How many {item} does {name} have now?")
    return " ".join(sentences), "\n".join(steps), total


def make_arithmetic(
    n: int,
    seed: int,
    *,
    digits: int = 2,
    ops: Sequence[str] = ("+",),
    n_terms: int = 2,
    word_problems: bool = False,
) -> list[Example]:
    """`n` arithmetic questions with `n_terms` operands of `digits` digits joined by operators drawn from `ops`.

    Plain questions ("What is 12 + 35 * 4?") use the usual precedence; word problems are stories read left to right.
    Rows are GSM8K-schema (`solution` ends in "#### <answer>"); `target_text` is just " <answer>".
    """
    if not set(ops) <= {"+", "-", "*"} or not ops:
        raise ValueError(f"ops must be a non-empty subset of '+', '-', '*', got {ops!r}")
    if n_terms < 2 or digits < 1:
        raise ValueError(f"need n_terms >= 2 and digits >= 1, got {n_terms=} {digits=}")
    rng = np.random.default_rng(seed)
    examples = []
    for _ in range(n):
        terms = [_operand(rng, digits) for _ in range(n_terms)]
        row_ops = [_pick(rng, ops) for _ in range(n_terms - 1)]
        question, work, value = _word_row(rng, terms, row_ops) if word_problems else _expression_row(terms, row_ops)
        examples.append(
            Example(
                task="arithmetic",
                prompt=question,
                answer=str(value),
                solution=f"{work}\n#### {value}",
                target_text=f" {value}",
                meta={"difficulty": carries(terms)} if set(row_ops) == {"+"} else {},
            )
        )
    return examples


def _countdown_tree(rng: np.random.Generator, numbers: list[int]) -> tuple[str, int] | None:
    """Combine the numbers pairwise at random with + - * and exact division; None if it hits a non-positive value."""
    nodes = [(str(x), x) for x in numbers]
    while len(nodes) > 1:
        i, j = (int(k) for k in rng.choice(len(nodes), size=2, replace=False))
        (a_text, a), (b_text, b) = nodes[i], nodes[j]
        op = _pick(rng, ("+", "-", "*", "/") if b and a % b == 0 else ("+", "-", "*"))
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b else 0}[op]
        if value <= 0:
            return None
        nodes = [node for k, node in enumerate(nodes) if k not in (i, j)] + [(f"({a_text} {op} {b_text})", value)]
    text, value = nodes[0]
    return (text[1:-1] if text.startswith("(") else text), value


def make_countdown(n: int, seed: int, *, n_numbers: int = 3, max_number: int = 20) -> list[Example]:
    """`n` Countdown puzzles: `n_numbers` numbers in [1, max_number] and a target reachable by construction.

    The constructing expression uses every number once, with all intermediate values positive integers; it is kept
    as `meta["expression"]` and `solution`.
    """
    if n_numbers < 1 or max_number < 1:
        raise ValueError(f"need n_numbers >= 1 and max_number >= 1, got {n_numbers=} {max_number=}")
    rng = np.random.default_rng(seed)
    examples = []
    while len(examples) < n:
        numbers = [int(x) for x in rng.integers(1, max_number + 1, size=n_numbers)]
        built = _countdown_tree(rng, numbers)
        if built is None:
            continue
        expression, target = built
        prompt = (
            f"Using the numbers {numbers}, write an arithmetic expression that equals {target}. "
            "You may use +, -, * and /, and each number at most once. "
            "Give the expression in <answer></answer> tags, for example <answer>(1 + 2) * 3</answer>."
        )
        examples.append(
            Example(
                task="countdown",
                prompt=prompt,
                answer=str(target),
                solution=expression,
                target_text=f" <answer>{expression}</answer>",
                meta={"numbers": tuple(numbers), "target": target, "expression": expression},
            )
        )
    return examples


def make_arith_steps(
    n: int, seed: int, *, min_operands: int = 3, max_operands: int = 4, digits: int = 2, ops: Sequence[str] = ("+", "-")
) -> list[Example]:
    """`n` chains of `min_operands` to `max_operands` operands of `digits` digits joined by operators drawn from `ops`
    (+ and −), read left to right, each worked one equation per line and ended by its answer:

        prompt  "97-98-44-25=?"
        target  " 97-98=-1\n-1-44=-45\n-45-25=-70\n#### -70"

    Intermediate values may be negative. `solution` is the worked solution (without the leading space);
    `meta["numbers"]` the operands, `meta["ops"]` the operators, `meta["difficulty"]` the number of equations."""
    if not ops or not set(ops) <= {"+", "-"}:
        raise ValueError(f"ops must be a non-empty subset of '+', '-', got {tuple(ops)!r}")
    if not 2 <= min_operands <= max_operands or digits < 1:
        raise ValueError(f"need 2 <= min_operands <= max_operands and digits >= 1, got {min_operands}, {max_operands}")
    rng = np.random.default_rng(seed)
    examples = []
    for _ in range(n):
        count = int(rng.integers(min_operands, max_operands + 1))
        terms = [_operand(rng, digits) for _ in range(count)]
        row_ops = [_pick(rng, ops) for _ in range(count - 1)]
        lines, total = [], terms[0]
        for op, term in zip(row_ops, terms[1:]):
            new = total + term if op == "+" else total - term
            lines.append(f"{total}{op}{term}={new}")
            total = new
        expression = str(terms[0]) + "".join(f"{op}{t}" for op, t in zip(row_ops, terms[1:]))
        work = "\n".join(lines) + f"\n#### {total}"
        examples.append(
            Example(
                task="arith_steps",
                prompt=f"{expression}=?",
                answer=str(total),
                solution=work,
                target_text=f" {work}",
                meta={"numbers": tuple(terms), "ops": tuple(row_ops), "difficulty": len(lines)},
            )
        )
    return examples
