"""esroll.steps.judge: the reference-holding prefix judge of ExpRL (`reference_progress`, the verifier `exprl`) on
hand-written solutions, the reading of a judge's answers, and a judge turned into a step verifier. Each expected
score is worked out by hand in the test: the reference's values, how many of them a prefix reaches, 1 + round(4p)."""

from __future__ import annotations

import builtins
import math
from fractions import Fraction

import numpy as np
import pytest

from esroll.data import Example
from esroll.steps import STEP_VERIFIERS, judge_verifier, read_judgement, reference_progress
from esroll.steps.judge import reference_values

SOLUTION = "67+56=123\n123+34=157\n157+37=194\n#### 194"
E = Example("arith_steps", "67+56+34+37=?", "194", SOLUTION, f" {SOLUTION}")


def _lines(text: str) -> list[str]:
    """A completion's steps as `segment` cuts them: each line with its newline."""
    return text.splitlines(keepends=True)


def test_reference_values_are_the_equations_results_then_an_answer_no_equation_gives():
    assert reference_values(E) == [123, 157, 194]  # "#### 194" repeats the last result
    gsm = Example("gsm8k", "q", "7", "She has 3+4=7 apples.\nShe eats none.\n#### 7", "")
    assert reference_values(gsm) == [7]
    bare = Example("gsm8k", "q", "12", "Twelve, by counting.\n#### 12", "")
    assert reference_values(bare) == [12]  # no equation: the answer alone
    signed = Example("arith_steps", "97-98-44=?", "-45", "97-98=-1\n-1-44=-45\n#### -45", "")
    assert reference_values(signed) == [Fraction(-1), Fraction(-45)]


def test_the_right_solution_climbs_one_value_at_a_time():
    """3 values: after line 1, 1/3 reached → 1 + round(4/3) = 2; after line 2, 2/3 → 1 + round(8/3) = 4; then 5."""
    assert reference_progress(E, ["67+56=123\n", "67+56=123\n123+34=157\n", SOLUTION, SOLUTION]) == [2, 4, 5, 5]
    scores = STEP_VERIFIERS.lookup("exprl")(E, _lines(SOLUTION))
    assert scores == [0.25, 0.75, 1.0, 1.0]  # (score − 1) / 4 of each prefix


def test_a_value_counts_only_from_an_equation_that_holds_or_the_answer():
    """Line 2 is wrong (123+34=158 does not hold); line 3 holds (158+37=195) but 195 is no reference value; "#### 195"
    is not one either: only 123 is reached, 1/3 → 2 on every prefix."""
    wrong = "67+56=123\n123+34=158\n158+37=195\n#### 195"
    assert reference_progress(E, ["".join(_lines(wrong)[: k + 1]) for k in range(4)]) == [2, 2, 2, 2]
    assert reference_progress(E, ["67+56=124\n"]) == [1]  # a wrong result reaches nothing
    assert reference_progress(E, ["#### 194"]) == [2]  # the answer alone reaches the last value: 1/3
    # a value written twice is matched once: 1/3; a trivial equation that holds reaches its result
    assert reference_progress(E, ["0+194=194\n#### 194"]) == [2]


def test_a_reference_value_that_repeats_is_matched_as_often_as_it_occurs():
    """Values [10, 5, 10]: a prefix reaching 10 once has 1/3 (→ 2), reaching 10 twice and 5 has 3/3 (→ 5); 2/3 → 4."""
    e = Example("arith_steps", "5+5-5+5=?", "10", "5+5=10\n10-5=5\n5+5=10\n#### 10", "")
    assert reference_progress(e, ["5+5=10\n", "5+5=10\n6+4=10\n", "5+5=10\n10-5=5\n5+5=10\n"]) == [2, 4, 5]


def test_shares_between_the_marks_round_to_the_nearest_score():
    """4 values: 1/4 → 1 + 1 = 2, 2/4 → 3, 3/4 → 4; 2 values: 1/2 → 3."""
    e4 = Example("arith_steps", "1+1+1+1+1=?", "5", "1+1=2\n2+1=3\n3+1=4\n4+1=5\n#### 5", "")
    assert reference_progress(e4, ["1+1=2\n", "1+1=2\n2+1=3\n", "1+1=2\n2+1=3\n3+1=4\n"]) == [2, 3, 4]
    e2 = Example("arith_steps", "1+1+1=?", "3", "1+1=2\n2+1=3\n#### 3", "")
    assert reference_progress(e2, ["1+1=2\n"]) == [3]


HOSTILE = [
    "__import__('os').system('rm -rf /')\n#### 194",
    "eval('67+56')=123\n",
    "9" * 5000 + "+1=" + "9" * 5000,
    "67+56=123" * 2000,
    "\x00\ufffd" * 100,
]


@pytest.mark.parametrize("text", HOSTILE)
def test_hostile_text_is_read_never_evaluated(monkeypatch, text):
    def refuse(*args, **kwargs):
        raise AssertionError("model output was evaluated")

    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    (score,) = STEP_VERIFIERS.lookup("exprl")(E, [text])
    assert 0.0 <= score <= 1.0


def test_hostile_text_scores_what_it_states_and_no_more():
    """The injection's "#### 194" reaches the last value (1/3 → s 0.25); "eval(...)=123" writes no equation."""
    assert STEP_VERIFIERS.lookup("exprl")(E, [HOSTILE[0]]) == [0.25]
    assert STEP_VERIFIERS.lookup("exprl")(E, [HOSTILE[1]]) == [0.0]


@pytest.mark.parametrize(
    "judgement, score",
    [
        (4, 4),
        (1.0, 1),
        ("4", 4),
        ("Score: 4", 4),
        ("score=5/5", 5),
        (" 2. ", 2),
        (6, None),
        (0, None),
        (4.5, None),
        (True, None),
        (math.nan, None),
        ("four", None),
        ("4 because the second line is right", None),
        ("Score: 7", None),
        ("", None),
        (None, None),
        (["4"], None),
        (np.int64(3), 3),
        (np.float32(5.0), 5),
        (np.float64(2.5), None),
        (np.bool_(True), None),
    ],
)
def test_read_judgement_takes_a_score_from_1_to_5_and_nothing_else(judgement, score):
    assert read_judgement(judgement) == score


def test_a_judge_becomes_a_verifier_with_nan_where_it_cannot_be_read():
    seen = []

    def judge(example, prefixes):
        seen.extend(prefixes)
        return ["Score: 3", "banana"]  # two judgements for three prefixes

    scores = judge_verifier(judge)(E, ["a\n", "b\n", "c"])
    assert scores[0] == 0.5 and all(math.isnan(s) for s in scores[1:])
    assert seen == ["a\n", "a\nb\n", "a\nb\nc"]  # each prefix through step k


def test_a_reference_without_values_gets_no_judgement():
    e = Example("arith_steps", "q", "", "no numbers here", "")
    assert reference_progress(e, ["1+1=2\n"]) == [None]
    assert math.isnan(STEP_VERIFIERS.lookup("exprl")(e, ["1+1=2\n"])[0])
