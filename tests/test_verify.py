"""esroll.verify: the `equations` step verifier on hand-written right, wrong and hostile steps."""

from __future__ import annotations

import pytest

from esroll.data import Example
from esroll.data.synthetic import make_arith_steps
from esroll.verify import STEP_VERIFIERS, equations, register_verifier

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
    assert equations(Q, ["97+98=195 and 3\n"]) == [0.0]  # a number from nowhere
    assert equations(Q, ["let me think\n", ""]) == [1.0, 1.0]  # nothing to check
    assert equations(Q, ["97/98=97/98\n"]) == [0.0]  # not an equation's result: the right side is a number
    division = Example(
        task="gsm_symbolic", prompt="Share 12 apples among 4 and 0 friends.", answer="3", solution="", target_text=""
    )
    assert equations(division, ["12/4=3\n", "12÷0=5\n", "3*4=12\n", "3×4=13"]) == [1.0, 0.0, 1.0, 0.0]


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
