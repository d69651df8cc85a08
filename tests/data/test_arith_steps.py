"""The arith_steps task: chains worked one equation per line ending in "#### n", its options (`data.options`), its
scorer, and the shipped model that writes such solutions (`assets/tiny-qwen3-steps`)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from configs.default import get_config
from esroll.config import InputError, from_config_dict
from esroll.data import make_splits, score
from esroll.data.synthetic import make_arith_steps
from esroll.experiment import check_names, unread_keys

from conftest import REPO, load_steps_task

STEPS_MODEL = REPO / "assets" / "tiny-qwen3-steps"
TEACHER = REPO / "assets" / "tiny-qwen3-steps-teacher"  # the same build carried on to 75% exact match


def _chain(prompt: str) -> tuple[list[int], list[str]]:
    """Operands and operators of "97-98+44=?", read by hand (digits and signs), never evaluated."""
    body = prompt.removesuffix("=?")
    numbers = [int(n) for n in re.findall(r"\d+", body)]
    ops = re.findall(r"(?<=\d)[+-]", body)
    return numbers, ops


def test_rows_are_worked_left_to_right_one_equation_per_line():
    rows = make_arith_steps(300, 7)
    for e in rows:
        numbers, ops = _chain(e.prompt)
        assert 3 <= len(numbers) <= 4 and all(10 <= n <= 99 for n in numbers) and len(ops) == len(numbers) - 1
        lines = e.solution.split("\n")
        assert e.target_text == " " + e.solution and lines[-1] == f"#### {e.answer}"
        total = numbers[0]
        for line, op, n in zip(lines[:-1], ops, numbers[1:]):
            new = total + n if op == "+" else total - n
            assert line == f"{total}{op}{n}={new}"
            total = new
        assert int(e.answer) == total and e.meta["difficulty"] == len(numbers) - 1
    assert any(int(e.answer) < 0 for e in rows) and {len(_chain(e.prompt)[0]) for e in rows} == {3, 4}
    assert make_arith_steps(5, 7) == rows[:5]  # deterministic from the seed


def test_the_answer_after_the_marker_is_what_scores():
    (e,) = make_arith_steps(1, 3)
    assert score(e, e.target_text) == 1.0
    last_line = e.solution.split("\n")[-2]  # the final equation states the answer too, but no "####" follows
    assert score(e, " " + last_line) == 0.0
    assert score(e, f" 1+1=2\n#### {e.answer}") == 1.0  # a wrong line does not change the final answer's score
    for hostile in ("", "####", "#### --5", "\x00" * 10_000, "#### 1e9999", "9" * 5000):
        assert score(e, hostile) == 0.0


def test_options_shape_the_chains_and_are_checked():
    cd = get_config("quick")
    cd.data.task = "arith_steps"
    cd.data.options.arith_steps.update(min_operands=5, max_operands=5)
    cfg = check_names(from_config_dict(cd.to_dict()))
    train, held_out = make_splits(cfg.data)
    assert {e.meta["difficulty"] for e in train + held_out} == {4}
    unread = unread_keys(cfg)
    assert "data.digits" in unread and "data.options.arith_steps.max_operands" not in unread
    cd.data.options.arith_steps.min_operands = 1
    with pytest.raises(InputError, match=r"^config: invalid value for 'data.options.arith_steps.min_operands': 1"):
        check_names(from_config_dict(cd.to_dict()))
    other = check_names(from_config_dict(get_config("quick").to_dict()))  # arithmetic does not read them
    assert unread_keys(other)["data.options.arith_steps.ops"].startswith("only data.task 'arith_steps' reads it")


def test_the_teacher_shares_the_students_tokenizer_exactly():
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (TEACHER / name).read_bytes() == (STEPS_MODEL / name).read_bytes(), name


@pytest.mark.e2e
@pytest.mark.parametrize("model, band", [(STEPS_MODEL, (0.3, 0.6)), (TEACHER, (0.75, 1.0))], ids=["student", "teacher"])
def test_the_shipped_steps_models_write_worked_solutions_at_their_accuracy(model, band):
    """Greedy held-out accuracy of each shipped model, by the task's scorer through the trainer's evaluation, lies in
    the band it was built for (the student partial, the teacher at least 0.75), and its completions are worked in
    lines ending in "####"."""
    import jax

    from esroll.rollout import Sampling, rollout
    from esroll.train import evaluate

    task, params, held_out, mesh = load_steps_task(model, 8000, 256)
    scores = evaluate(task, params, held_out, Sampling(48), mesh)
    assert band[0] <= scores["eval_accuracy"] <= band[1], scores
    out = rollout(task, mesh, params, held_out[:16], np.arange(16), jax.random.key(0), Sampling(48), completions=True)
    texts = task.texts(out.tokens_BxN, out.length_B)
    assert sum("\n" in t and "####" in t for t in texts) >= 12, texts
