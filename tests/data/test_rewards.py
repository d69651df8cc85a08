"""Answer extraction, exact reward comparison, Countdown rules, and bounded behaviour on hostile completions."""

import subprocess
import sys
import time

import pytest

from esroll import rewards


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),
        ("#### 12\nwait, let me redo.\n#### 13", "13"),
        ("#### 1,234", "1234"),
        ("#### $18.00", "18"),
        ("#### -5", "-5"),
        ("#### +7", "7"),
        ("So the total is \\boxed{42}.", "42"),
        ("\\boxed{1} no, \\boxed{\\$2,500}", "2500"),
        ("\\boxed{\\text{18}} and then 3", "18"),
        ("The answer is 3.50.", "3.5"),
        ("the answer is: €1,000,000", "1000000"),
        ("THE ANSWER IS £12", "12"),
        ("Final Answer: **42**", "42"),
        ("answer = 0.25", "0.25"),
        ("She saves 25%. The answer is 25%.", "25"),
        ("The answer is 5. Hmm, actually the answer is 6.", "6"),
        ("#### 7\nThe answer is 8", "7"),  # "####" outranks "answer is"
        ("\\boxed{9} and the answer is 10", "9"),  # \boxed outranks "answer is"
        ("He has 3 apples, then 4 more, so 7 apples", "7"),
        ("x = -4", "-4"),
        ("between 3-4 apples", "4"),  # a hyphen glued to a number is not a sign
        ("items 1,2,3", "3"),  # not a thousands separator
        ("It costs 18.00 dollars.", "18"),
        ("007", "7"),
        ("-0.0", "0"),
        ("no number here", None),
        ("", None),
        ("５", None),  # full-width digit
        ("٣", None),  # Arabic-Indic digit
        ("#### ٤٢", None),
        ("#### ５ but 3 before", "3"),
    ],
)
def test_extract_answer(completion, expected):
    assert rewards.extract_answer(completion) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("42", "42"),
        (" -1,000.50 ", "-1000.5"),
        ("$3", "3"),
        ("12 apples", None),
        ("", None),
        ("1" * 31, None),
    ],
)
def test_parse_number(text, expected):
    assert rewards.parse_number(text) == expected


def test_parse_gold_from_full_gsm8k_answer():
    gold = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nIn total 48+24 = <<48+24=72>>72 clips.\n#### 72"
    assert rewards.parse_gold(gold) == "72"
    assert rewards.gsm8k_reward("so #### 72", gold) == 1.0
    assert rewards.gsm8k_reward("so #### 24", gold) == 0.0


@pytest.mark.parametrize("completion", ["#### 18", "\\boxed{18.00}", "The answer is $18.", "18", "#### 18.0"])
def test_gsm8k_reward_equal_forms(completion):
    assert rewards.gsm8k_reward(completion, "18") == 1.0
    assert rewards.gsm8k_reward(completion, "$18.00") == 1.0


@pytest.mark.parametrize(
    "completion, gold",
    [
        ("#### 18.01", "18"),
        ("#### 0.1", "0.10000000000000001"),
        ("#### -18", "18"),
        ("nothing", "18"),
    ],
)
def test_gsm8k_reward_exact_mismatch(completion, gold):
    assert rewards.gsm8k_reward(completion, gold) == 0.0


def test_gsm8k_reward_rejects_bad_gold():
    with pytest.raises(ValueError, match="not a number"):
        rewards.gsm8k_reward("#### 1", "#### many")


@pytest.mark.parametrize(
    "completion, numbers, target, expected",
    [
        ("<answer>(3 + 5) * 2</answer>", [3, 5, 2], 16, 1.0),
        ("<answer>3 * 5 + 2 = 17</answer>", [3, 5, 2], 17, 1.0),
        ("<answer>(3 + 5) * 2</answer>", [3, 5, 2], 17, 0.0),
        ("<answer>1</answer> no wait <answer>8 / 2</answer>", [8, 2], 4, 1.0),  # last tag wins
        ("<answer>8 / 3 * 3</answer>", [8, 3, 3], 8, 1.0),  # exact rational arithmetic
        ("<answer>7 / (3 - 3)</answer>", [7, 3, 3], 0, 0.0),  # division by zero
        ("<answer>5 + 7</answer>", [5, 7, 9], 12, 1.0),  # not every number must be used
        ("<answer>5 + 5</answer>", [5, 7], 10, 0.0),  # reuse beyond what is given
        ("<answer>5 + 5</answer>", [5, 5], 10, 1.0),  # a number given twice may be used twice
        ("<answer>5 + 8</answer>", [5, 7], 13, 0.0),  # a number not given
        ("<answer>-5 + 15</answer>", [5, 15], 10, 0.0),  # no unary minus
        ("<answer>3 ** 2</answer>", [3, 2], 9, 0.0),
        ("<answer>7 // 2</answer>", [7, 2], 3, 0.0),
        ("<answer>7 % 4</answer>", [7, 4], 3, 0.0),
        ("<answer>2.5 * 2</answer>", [2, 5], 5, 0.0),
        ("<answer>abs(4)</answer>", [4], 4, 0.0),
        ("<answer>__import__('os').system('true')</answer>", [], 0, 0.0),
        ("<answer>(4).real</answer>", [4], 4, 0.0),
        ("<answer>x</answer>", [], 0, 0.0),
        ("<answer>4 (2)</answer>", [4, 2], 4, 0.0),
        ("<answer></answer>", [1], 1, 0.0),
        ("I think\n(3 + 5) × 2 = 16\n", [3, 5, 2], 16, 1.0),  # last expression line, no tags
        ("(3 + 5) * 2\nThat works because 3 + 5 = 8.", [3, 5, 2], 16, 1.0),
        ("no expression at all", [1], 1, 0.0),
    ],
)
def test_countdown_reward(completion, numbers, target, expected):
    assert rewards.countdown_reward(completion, numbers, target) == expected


def test_countdown_format_reward_only_for_tagged_wrong_answers():
    assert rewards.countdown_reward("<answer>3 ** 2</answer>", [3, 2], 9, format_reward=0.1) == 0.1
    assert rewards.countdown_reward("<answer>3 * 3</answer>", [3, 3], 9, format_reward=0.1) == 1.0
    assert rewards.countdown_reward("3 + 4", [3, 4], 9, format_reward=0.1) == 0.0


def test_evaluate_countdown_is_exact():
    assert rewards.evaluate_countdown("1 / 3 + 1 / 3", [1, 3, 1, 3]) * 3 == 2


_HOSTILE = [
    "1" * 1_000_000,
    "#### " + "9" * 1_000_000,
    "(" * 100_000 + "1" + ")" * 100_000,
    "<answer>" + "(" * 100_000 + "1" + ")" * 100_000 + "</answer>",
    "<answer>" + "(" * 99 + "1" + ")" * 99 + "</answer>",  # deepest nesting that fits the length bound
    "<answer>" + "+".join(["1"] * 100) + "</answer>",
    "<answer>9**9**9**9</answer>",
    "<answer>9" + "*9" * 99 + "</answer>",
    "9**9**9**9",
    "<answer>" + "9" * 5000 + "</answer>",
    "1,000," * 200_000,
    "1," * 500_000 + "1111",
    "answer is " * 100_000,
    "#### " * 200_000,
    "\\boxed{" * 200_000,
    "<answer>" * 200_000,
    "</answer>" * 200_000,
    "<answer>" * 100_000 + "</answer>" * 100_000,
    "-" * 1_000_000 + "5",
    "\x00" * 100_000 + "#### 5\x00",
    "<answer>1\x00+1</answer>",
    "５" * 100_000,
    "٣" * 100_000,
    "\n" * 500_000,
    " " * 1_000_000,
    "1 + " * 250_000 + "1",
    "\ud800 #### 1",  # lone surrogate
]


@pytest.mark.parametrize("completion", _HOSTILE, ids=range(len(_HOSTILE)))
def test_hostile_completions_are_bounded_and_never_raise(completion):
    for call in (
        lambda: rewards.extract_answer(completion),
        lambda: rewards.gsm8k_reward(completion, "5"),
        lambda: rewards.countdown_reward(completion, [1, 9, 9, 9, 9], 2, format_reward=0.1),
    ):
        start = time.perf_counter()
        result = call()
        assert time.perf_counter() - start < 1.0  # a bound against catastrophic behaviour, not a benchmark
        assert result is None or isinstance(result, (str, float))


def test_non_string_completion_is_zero():
    assert rewards.gsm8k_reward(None, "1") == 0.0  # type: ignore[arg-type]
    assert rewards.countdown_reward(b"1", [1], 1) == 0.0  # type: ignore[arg-type]


@pytest.mark.e2e
def test_does_not_import_jax():
    code = "import sys, esroll.rewards; assert 'jax' not in sys.modules, 'rewards imported jax'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_strict_and_flexible_extraction():
    """The two GSM8K evaluation scores: strict reads only the number after the last `####`; flexible the last number."""
    cases = [
        ("so 3 + 4 = 7\n#### 7", "7", "7"),
        ("#### 7 apples, then 8", "7", "8"),  # strict: right after the marker; flexible: the last number
        ("The answer is 12.", None, "12"),
        ("#### $1,234.50", "1234.5", "1234.5"),
        ("#### 5\n#### 6", "6", "6"),
        ("no number here ####", None, None),
        ("####\n  -3", "-3", "-3"),
    ]
    for text, strict, flexible in cases:
        assert rewards.extract_strict(text) == strict, text
        assert rewards.extract_flexible(text) == flexible, text
    assert rewards.gsm8k_reward("The answer is 12.", "#### 12", rewards.extract_strict) == 0.0
    assert rewards.gsm8k_reward("The answer is 12.", "#### 12", rewards.extract_flexible) == 1.0
    assert rewards.gsm8k_reward("The answer is 12.", "#### 12") == 1.0  # the training reward accepts "answer is"
