"""GSM-Symbolic problems from reasoning-gym: determinism, template-disjoint splits, GSM8K form, rewards, and the
message when reasoning-gym is missing."""

import builtins
import importlib.util
import json
import os
import subprocess
import sys
from fractions import Fraction

import pytest

from esroll import rewards
from esroll.config import from_config_dict
from esroll.data import gsm_symbolic_templates, make_gsm_symbolic, make_splits, score

needs_reasoning_gym = pytest.mark.skipif(
    importlib.util.find_spec("reasoning_gym") is None, reason="reasoning-gym is not installed"
)


def _rows(examples):
    return [[e.task, e.prompt, e.answer, e.solution, e.target_text, dict(e.meta)] for e in examples]


@pytest.mark.e2e
@needs_reasoning_gym
def test_same_seed_same_examples_across_processes():
    """Bit-identical rows in this process and in a fresh one with another hash seed; another seed differs."""
    rows = _rows(make_gsm_symbolic(120, 7))
    assert rows == _rows(make_gsm_symbolic(120, 7))
    code = "import json; from esroll.data import make_gsm_symbolic as m; print(json.dumps([[e.task, e.prompt, "
    code += "e.answer, e.solution, e.target_text, dict(e.meta)] for e in m(120, 7)]))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == rows
    other = _rows(make_gsm_symbolic(120, 8))
    assert sum(a[1] == b[1] for a, b in zip(rows, other)) < 5


@needs_reasoning_gym
def test_rows_are_gsm8k_form_and_cover_every_template():
    train_ids, held_out_ids = gsm_symbolic_templates(0)
    every = train_ids + held_out_ids
    examples = make_gsm_symbolic(3 * len(every), 0)
    assert sorted({e.meta["template"] for e in examples}) == sorted(every)  # three rows of each template
    assert len(every) > 50  # reasoning-gym 0.1.19: 85 usable of 100
    for e in examples:
        assert e.task == "gsm_symbolic" and e.prompt and e.prompt == e.prompt.strip()
        assert rewards.parse_number(e.answer) == e.answer and Fraction(e.answer) >= 0
        assert e.solution.endswith(f"\n#### {e.answer}") and e.solution.count("####") == 1
        assert e.target_text == f" {e.solution}"
        assert set(e.meta) == {"template", "draw"}


@needs_reasoning_gym
def test_gold_scores_one_and_perturbed_answer_zero():
    for e in make_gsm_symbolic(200, 3):
        wrong = Fraction(e.answer) + 1
        assert score(e, e.solution) == score(e, e.target_text) == 1.0
        assert score(e, f"Some reasoning.\n#### {e.answer}") == 1.0
        assert score(e, e.solution.rpartition("####")[0] + f"#### {wrong}") == 0.0
        assert rewards.gsm8k_reward(f"#### {wrong}", e.answer) == 0.0


@needs_reasoning_gym
def test_negative_answers_are_redrawn():
    """Template 24 sometimes asks for an age of -2 years; such draws are skipped."""
    examples = make_gsm_symbolic(100, 0, templates=[24])
    assert {e.meta["template"] for e in examples} == {24}
    assert all(not e.answer.startswith("-") for e in examples)
    assert max(e.meta["draw"] for e in examples) > 99  # some draws were rejected


@needs_reasoning_gym
def test_make_splits_holds_out_whole_templates():
    cfg = from_config_dict({"data": {"task": "gsm_symbolic", "n_examples": 300, "eval_size": 40, "seed": 1}}).data
    train, held_out = make_splits(cfg)
    assert (len(train), len(held_out)) == (260, 40)
    train_ids, held_out_ids = gsm_symbolic_templates(1)
    assert not set(train_ids) & set(held_out_ids)
    assert {e.meta["template"] for e in train} == set(train_ids)
    assert {e.meta["template"] for e in held_out} <= set(held_out_ids)
    assert len({e.meta["template"] for e in held_out}) == min(40, len(held_out_ids))
    assert not {e.prompt for e in train} & {e.prompt for e in held_out}
    assert _rows(make_splits(cfg)[1]) == _rows(held_out)
    assert gsm_symbolic_templates(2)[1] != held_out_ids


@needs_reasoning_gym
def test_bad_arguments():
    assert make_gsm_symbolic(0, 0) == []
    with pytest.raises(ValueError, match=r"non-empty subset .* unknown \[35, 1000\]"):
        make_gsm_symbolic(4, 0, templates=[1, 35, 1000])
    with pytest.raises(ValueError, match=r"held_out_fraction must be in \(0, 1\)"):
        gsm_symbolic_templates(0, held_out_fraction=1.0)
    cfg = from_config_dict({"data": {"task": "gsm_symbolic", "n_examples": 40, "eval_size": 40}}).data
    with pytest.raises(ValueError, match="data.n_examples=40 leaves no training examples"):
        make_splits(cfg)


def test_missing_reasoning_gym_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_reasoning_gym(name, *args, **kwargs):
        if name.split(".")[0] == "reasoning_gym":
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_reasoning_gym)
    with pytest.raises(ImportError, match=r"needs reasoning-gym: pip install 'esroll\[tasks\]'") as info:
        make_gsm_symbolic(4, 0)
    assert "\n" not in str(info.value)
