"""esroll.steps.verify: the `equations` step verifier on hand-written right, wrong and hostile steps, in the arith_steps
format and in GSM-Symbolic's wording, and on the reference solutions of both tasks."""

from __future__ import annotations

import re

import pytest

from esroll.data import Example
from esroll.data.synthetic import make_arith_steps
from esroll.steps.verify import STEP_VERIFIERS, equations, register_verifier

Q = Example(task="arith_steps", prompt="97-98-44-25=?", answer="-70", solution="", target_text="")


def test_a_right_worked_solution_scores_one_per_step():
    steps = ["97-98=-1\n", "-1-44=-45\n", "-45-25=-70\n", "#### -70"]
    assert equations(Q, steps) == [1.0, 1.0, 1.0, 1.0]
    for e in make_arith_steps(50, 11):  # every generated solution, line by line
        assert equations(e, e.solution.split("\n")) == [1.0] * (e.meta["difficulty"] + 1)


def test_only_the_step_that_errs_scores_zero():
    # line 2 is wrong (-1-44 is -45); line 3 computes right from the wrong -46, so it is locally right; the final
    # answer is a stated result
    assert equations(Q, ["97-98=-1\n", "-1-44=-46\n", "-46-25=-71\n", "#### -71"]) == [1.0, 0.0, 1.0, 1.0]
    assert equations(Q, ["97-99=-2\n"]) == [0.0]  # 99 is not a number of the question
    assert equations(Q, ["97-98=-1\n", "#### 12"]) == [1.0, 0.0]  # 12 was never reached
    assert equations(Q, ["97+98=195 and 3\n", "195+3=198\n"]) == [1.0, 1.0]  # prose numbers become known
    assert equations(Q, ["97+98=195\n", "195+5=200\n"]) == [1.0, 0.0]  # 5: never stated
    assert equations(Q, ["let me think\n", ""]) == [1.0, 1.0]  # nothing to check
    assert equations(Q, ["97/98=97/98\n"]) == [0.0]  # not an equation's result: the right side is a number
    division = Example(
        task="gsm_symbolic", prompt="Share 12 apples among 4 and 0 friends.", answer="3", solution="", target_text=""
    )
    assert equations(division, ["12/4=3\n", "12÷0=5\n", "3*4=12\n", "3×4=13"]) == [1.0, 0.0, 1.0, 0.0]


def test_gsm_wording_units_currency_percentages_and_precedence():
    q = Example(
        task="gsm_symbolic",
        prompt="A basket holds 34 cookies. He has 182 cookies, 5 baskets, twice as many jars (70% full), rent €1,205.50.",
        answer="12",
        solution="",
        target_text="",
    )
    steps = [
        "He can place 34 x 5 = 170 cookies.\n",  # "x" between numbers
        "So 182 cookies - 170 cookies = 12 cookies are left.\n",  # units after the numbers
        "Jars: 5 baskets * 2 jars/basket = 10 jars, and 10 * 70% = 7 are full.\n",  # "twice"; a percentage
        "It costs €1,205.50/month * 12 months = €14,466 a year\n",  # currency, commas, decimals, a conversion
        "5 + 34 * 2 = 73\n",  # × before +
        "#### 12",
    ]
    assert equations(q, steps) == [1.0] * 6
    wrong = ["34 x 5 = 160 cookies\n", "5 + 34 * 2 = 78\n", "182 / 5 = 36.4\n", "182 / 5 = 36.5\n", "9 * 3 = 27\n"]
    assert equations(q, wrong) == [0.0, 0.0, 1.0, 0.0, 0.0]  # 36.4 is 182/5 to one decimal; 9 is unknown
    assert equations(q, ["He has 182 / 5 = 36.4 cookies\n", "#### 36.4"]) == [1.0, 1.0]
    assert equations(q, ["#### 171"]) == [0.0]


def test_the_reference_solutions_of_both_tasks_verify_and_a_changed_result_does_not():
    """Every arith_steps solution scores 1 on every line; GSM-Symbolic's reference solutions mostly do (their text
    states some quantities without an equation, and a few of its templates compute wrongly, as "90 / 12 = 7 trays");
    in each solution whose steps all verify, raising one equation's result by 1 makes exactly that step score 0."""
    from esroll.data.gsm_symbolic import make_gsm_symbolic

    rows = make_gsm_symbolic(200, 0)
    verified = [e for e in rows if min(equations(e, e.solution.split("\n"))) == 1.0]
    assert len(verified) >= 0.85 * len(rows)
    changed = 0
    for e in verified + make_arith_steps(50, 3):
        lines = e.solution.split("\n")
        for i, line in enumerate(lines):
            # an equation of numbers, operators and lower-case words of unit (not "34 + T = 146 + T")
            m = re.search(
                r"[0-9](?: [a-z/]+)* ?(?: x |[-+*/×÷]) ?[$€£]?[0-9][0-9a-z ,./%$€£*+×÷-]*= ?[$€£]?(-?[0-9]+)(?![0-9.,/])",
                line,
            )
            if m is None:
                continue
            broken = line[: m.start(1)] + str(int(m.group(1)) + 1) + line[m.end(1) :]
            scores = equations(e, [*lines[:i], broken, *lines[i + 1 :]])
            assert scores[i] == 0.0 and scores[:i] == [1.0] * i, (lines, broken, scores)
            changed += 1
            break
    assert changed >= 200


@pytest.mark.parametrize(
    "hostile",
    [
        "",
        "=",
        "====",
        "1" * 5000 + "+1=2",
        "9" * 31 + "-1=9",
        "\x00\ufffd\n",
        "1e999+1=1e999",
        "-" * 10_000,
        "(1+",
        "__import__('os').system('x')=0",
        "1/0=0",
        "0.5+0.25=0.75",
    ],
)
def test_hostile_text_gets_a_score_and_never_an_exception(hostile):
    (score,) = equations(Q, [hostile])
    assert score in (0.0, 1.0)


def test_verifiers_register_by_name():
    assert STEP_VERIFIERS["equations"] is equations
    with pytest.raises(ValueError, match="already registered"):
        register_verifier("equations", lambda e, s: [1.0] * len(s))
