"""GSM8K loading and validation, synthetic tasks, prompts, scoring, splits and resumable batching."""

import json
import re
import sys
import types

import numpy as np
import pytest

from esroll import data, rewards
from esroll.data import Example

GSM8K_ROW = {
    "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
}


def _write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# ---------------------------------------------------------------- GSM8K loading


def test_load_gsm8k_jsonl(tmp_path):
    path = _write_lines(tmp_path / "train.jsonl", [json.dumps(GSM8K_ROW), "", json.dumps(GSM8K_ROW)])
    examples = data.load_gsm8k(path)
    assert len(examples) == 2  # the blank line is skipped
    example = examples[0]
    assert (example.task, example.prompt, example.answer) == ("gsm8k", GSM8K_ROW["question"], "72")
    assert example.solution == GSM8K_ROW["answer"]
    assert "<<" not in example.target_text and example.target_text.endswith("#### 72")
    assert data.score(example, example.target_text) == 1.0


@pytest.mark.parametrize(
    "line, problem",
    [
        ("{not json", "invalid JSON"),
        ('["question", "answer"]', "expected an object"),
        ('{"question": "q?"}', "missing key 'answer'"),
        ('{"answer": "#### 1"}', "missing key 'question'"),
        ('{"question": 3, "answer": "#### 1"}', "'question' must be a non-empty string"),
        ('{"question": "q?", "answer": null}', "'answer' must be a non-empty string"),
        ('{"question": "  ", "answer": "#### 1"}', "'question' must be a non-empty string"),
        ('{"question": "q?", "answer": "it is 4"}', "must end in '#### <number>'"),
        ('{"question": "q?", "answer": "#### four"}', "must end in '#### <number>'"),
        ('{"question": "q?", "answer": "#### 4 apples"}', "must end in '#### <number>'"),
    ],
)
def test_load_gsm8k_names_file_and_line_of_bad_row(tmp_path, line, problem):
    path = _write_lines(tmp_path / "bad.jsonl", [json.dumps(GSM8K_ROW), "", line, json.dumps(GSM8K_ROW)])
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}:3: .*{re.escape(problem)}") as info:
        data.load_gsm8k(path)
    assert "\n" not in str(info.value)


def test_load_gsm8k_empty_file(tmp_path):
    path = _write_lines(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(ValueError, match=re.escape(f"{path}: no examples")):
        data.load_gsm8k(path)


def test_load_gsm8k_missing_local_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        data.load_gsm8k(tmp_path / "absent.jsonl")


def test_load_gsm8k_directory_picks_split(tmp_path):
    (tmp_path / "main").mkdir()
    _write_lines(tmp_path / "main" / "train-00000-of-00001.jsonl", [json.dumps(GSM8K_ROW)] * 3)
    _write_lines(tmp_path / "main" / "test-00000-of-00001.jsonl", [json.dumps(GSM8K_ROW)])
    assert len(data.load_gsm8k(tmp_path, "train")) == 3
    assert len(data.load_gsm8k(tmp_path, "test")) == 1
    with pytest.raises(ValueError, match="expected one 'validation"):
        data.load_gsm8k(tmp_path, "validation")


def test_load_gsm8k_parquet_round_trip(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist([GSM8K_ROW, GSM8K_ROW]), path)
    assert [e.answer for e in data.load_gsm8k(path)] == ["72", "72"]
    pq.write_table(pa.Table.from_pylist([GSM8K_ROW, {"question": "q?", "answer": "no marker"}]), path)
    with pytest.raises(ValueError, match=re.escape(f"{path}: row 2: ")):
        data.load_gsm8k(path)


def test_load_gsm8k_parquet_without_pyarrow(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = tmp_path / "test.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(ImportError, match="needs pyarrow"):
        data.load_gsm8k(path)


def test_load_gsm8k_by_name_without_datasets(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="needs `datasets`"):
        data.load_gsm8k("openai/gsm8k")


def test_load_gsm8k_by_name_offline_and_online(monkeypatch):
    def load_dataset(name, config, split):
        if name != "openai/gsm8k":
            raise ConnectionError("Couldn't reach the Hub\nlong traceback")
        assert (config, split) == ("main", "test")
        return [GSM8K_ROW, {"question": "q?"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    with pytest.raises(RuntimeError, match="^could not load 'other/name' .*Couldn't reach the Hub; when offline"):
        data.load_gsm8k("other/name", "test")
    with pytest.raises(ValueError, match=re.escape("openai/gsm8k[test] row 2: missing key 'answer'")):
        data.load_gsm8k("openai/gsm8k", "test")


# ---------------------------------------------------------------- synthetic arithmetic


def test_arithmetic_rows_are_correct_and_follow_the_knobs():
    examples = data.make_arithmetic(200, seed=1, digits=3, ops=("+", "-", "*"), n_terms=3)
    for example in examples:
        terms = [int(t) for t in re.findall(r"[0-9]+", example.prompt)]
        assert len(terms) == 3 and all(100 <= t <= 999 for t in terms)
        assert set(re.findall(r"[-+*]", example.prompt)) <= {"+", "-", "*"}
        expression = example.prompt.removeprefix("What is ").removesuffix("?")
        assert rewards.evaluate_countdown(expression, terms) == int(example.answer)  # usual precedence
        assert example.target_text == f" {example.answer}"
        assert example.solution.endswith(f"#### {example.answer}")
        assert data.score(example, example.target_text) == 1.0
        assert data.score(example, f" {int(example.answer) + 1}") == 0.0
    assert {op for e in examples for op in re.findall(r" ([-+*]) ", e.prompt)} == {"+", "-", "*"}


def test_arithmetic_default_is_two_digit_addition():
    for example in data.make_arithmetic(50, seed=0):
        a, b = (int(t) for t in re.fullmatch(r"What is ([0-9]+) \+ ([0-9]+)\?", example.prompt).groups())
        assert 10 <= a <= 99 and 10 <= b <= 99 and example.answer == str(a + b)


def test_arithmetic_word_problems():
    examples = data.make_arithmetic(100, seed=2, ops=("+", "-", "*"), n_terms=3, word_problems=True)
    for example in examples:
        assert example.prompt.endswith("have now?") and "What is" not in example.prompt
        steps = example.solution.splitlines()
        assert steps[-1] == f"#### {example.answer}" and len(steps) == 3
        assert int(example.answer) >= 0  # a take-away never exceeds what is held
    tom = data.make_arithmetic(500, seed=3, word_problems=True)
    assert any(e.prompt.startswith("Tom has") for e in tom)


def test_synthetic_is_deterministic_from_seed():
    assert data.make_arithmetic(20, seed=5, ops=("+", "*")) == data.make_arithmetic(20, seed=5, ops=("+", "*"))
    assert data.make_arithmetic(20, seed=5) != data.make_arithmetic(20, seed=6)
    assert data.make_countdown(20, seed=5) == data.make_countdown(20, seed=5)
    assert data.make_countdown(20, seed=5) != data.make_countdown(20, seed=6)


def test_synthetic_jsonl_round_trip(tmp_path):
    examples = data.make_arithmetic(30, seed=0, ops=("+", "-"), word_problems=True)
    path = tmp_path / "synthetic.jsonl"
    data.write_jsonl(examples, path)
    loaded = data.load_gsm8k(path)
    assert [(e.prompt, e.answer, e.solution) for e in loaded] == [(e.prompt, e.answer, e.solution) for e in examples]
    assert all(e.task == "gsm8k" and data.to_gsm8k_dict(e) == data.to_gsm8k_dict(s) for e, s in zip(loaded, examples))


def test_arithmetic_rejects_unknown_ops():
    with pytest.raises(ValueError, match="ops"):
        data.make_arithmetic(1, seed=0, ops=("/",))


# ---------------------------------------------------------------- Countdown


@pytest.mark.parametrize("n_numbers, max_number", [(1, 5), (3, 20), (4, 10), (6, 100)])
def test_countdown_targets_are_reachable(n_numbers, max_number):
    for example in data.make_countdown(100, seed=0, n_numbers=n_numbers, max_number=max_number):
        numbers, target = example.meta["numbers"], example.meta["target"]
        assert len(numbers) == n_numbers and all(1 <= x <= max_number for x in numbers)
        assert target > 0 and example.answer == str(target)
        assert rewards.countdown_reward(example.target_text, numbers, target) == 1.0
        assert data.score(example, f"<answer>{example.meta['expression']}</answer>") == 1.0
        assert "<answer></answer>" in example.prompt and str(target) in example.prompt


def test_countdown_uses_division():
    expressions = [e.meta["expression"] for e in data.make_countdown(300, seed=0, n_numbers=4)]
    assert any("/" in x for x in expressions) and any("-" in x for x in expressions)


# ---------------------------------------------------------------- prompts and scoring


class _FakeTokenizer:
    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, **kwargs):
        self.kwargs = kwargs
        return repr(messages)


def test_format_prompt_plain():
    assert data.format_prompt("What is 1 + 2?") == "Question: What is 1 + 2?\nAnswer:"
    assert data.format_prompt("Q", system="Be brief.") == "Be brief.\n\n" + data.PLAIN_TEMPLATE.format(question="Q")


def test_format_prompt_chat_passes_non_thinking_flag():
    tokenizer = _FakeTokenizer()
    text = data.format_prompt("Q", tokenizer, template="chat", system="S")
    assert text == repr([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}])
    assert tokenizer.kwargs == {"tokenize": False, "add_generation_prompt": True, "enable_thinking": False}


def test_format_prompt_chat_with_transformers_template():
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    word_level = tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(word_level))
    with pytest.raises(ValueError, match="chat template"):
        data.format_prompt("Q", tokenizer, template="chat")
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
    )
    assert data.format_prompt("Q", tokenizer, template="chat") == "<|user|>Q\n<|assistant|><think></think>"


def test_format_prompt_errors():
    with pytest.raises(ValueError, match="chat template"):
        data.format_prompt("Q", None, template="chat")
    with pytest.raises(ValueError, match="unknown prompt template"):
        data.format_prompt("Q", template="fancy")  # type: ignore[arg-type]


def test_score_dispatches_on_task():
    example = Example(
        task="countdown",
        prompt="p",
        answer="4",
        solution="8 / 2",
        target_text="",
        meta={"numbers": (8, 2), "target": 4},
    )
    assert data.score(example, "<answer>8 / 2</answer>") == 1.0
    assert data.score(example, "#### 4") == 0.0  # a number is not an expression
    with pytest.raises(ValueError, match="unknown task"):
        data.score(Example(task="chess", prompt="p", answer="1", solution="", target_text=""), "1")


# ---------------------------------------------------------------- splits and batching


def test_split_is_deterministic_and_disjoint():
    examples = data.make_arithmetic(300, seed=0, digits=1)  # one-digit sums repeat, so prompts have duplicates
    distinct = len({e.prompt for e in examples})
    assert distinct < 300
    train, held_out = data.split_examples(examples, n_eval=20, seed=7)
    assert len(held_out) == 20 and len({e.prompt for e in held_out}) == 20
    assert not {e.prompt for e in train} & {e.prompt for e in held_out}
    assert {e.prompt for e in train} | {e.prompt for e in held_out} == {e.prompt for e in examples}
    assert (train, held_out) == data.split_examples(examples, n_eval=20, seed=7)
    assert held_out != data.split_examples(examples, n_eval=20, seed=8)[1]
    with pytest.raises(ValueError, match="n_eval"):
        data.split_examples(examples, n_eval=distinct + 1, seed=0)


def reference_stream(n_examples, seed, epochs):
    """The documented prompt stream, built independently of esroll: one numpy permutation per epoch, seeded (seed, e)."""
    return np.concatenate([np.random.default_rng([seed, e]).permutation(n_examples) for e in range(epochs)])


@pytest.mark.parametrize("n, batch_size, seed", [(10, 4, 3), (7, 7, 0), (5, 3, 12), (3, 7, 1), (1, 2, 5), (23, 5, 11)])
def test_batches_are_windows_of_the_per_epoch_permutation_stream(n, batch_size, seed):
    steps = 9
    stream = reference_stream(n, seed, epochs=-(-steps * batch_size // n))
    for step in range(steps):
        batch = data.batch_indices(n, batch_size, seed=seed, step=step)
        assert batch.shape == (batch_size,) and batch.dtype.kind == "i"
        np.testing.assert_array_equal(batch, stream[step * batch_size : (step + 1) * batch_size], err_msg=f"{step=}")
    far = 10_000  # a late step needs no history: its epochs are drawn directly
    start = far * batch_size
    late = [np.random.default_rng([seed, p // n]).permutation(n)[p % n] for p in range(start, start + batch_size)]
    np.testing.assert_array_equal(data.batch_indices(n, batch_size, seed=seed, step=far), late)


def test_epoch_permutation_is_the_seeded_numpy_permutation():
    for seed, epoch in [(0, 0), (3, 1), (7, 12)]:
        expected = np.random.default_rng([seed, epoch]).permutation(10)
        np.testing.assert_array_equal(data.epoch_permutation(10, seed=seed, epoch=epoch), expected)


def test_batches_cover_each_epoch_once_and_wrap_across_epochs():
    n, batch_size = 10, 4
    stream = np.concatenate([data.batch_indices(n, batch_size, seed=3, step=s) for s in range(5)])  # 2 epochs
    assert sorted(stream[:n]) == list(range(n)) and sorted(stream[n:]) == list(range(n))  # each example once an epoch
    assert not np.array_equal(stream[:n], stream[n:])  # a fresh order each epoch
    # step 2 holds positions 8..11: the last two of epoch 0's permutation, then the first two of epoch 1's
    epoch0, epoch1 = (np.random.default_rng([3, e]).permutation(n) for e in (0, 1))
    np.testing.assert_array_equal(data.batch_indices(n, batch_size, seed=3, step=2), [*epoch0[8:], *epoch1[:2]])
    other_seed = np.concatenate([data.batch_indices(n, batch_size, seed=4, step=s) for s in range(5)])
    assert not np.array_equal(stream, other_seed)


def test_batch_larger_than_dataset():
    """Positions 7..13 of a 3-example stream: the last two of epoch 2, all of epoch 3, the first two of epoch 4."""
    perm = {e: np.random.default_rng([0, e]).permutation(3) for e in (2, 3, 4)}
    batch = data.batch_indices(3, 7, seed=0, step=1)
    np.testing.assert_array_equal(batch, [*perm[2][1:], *perm[3], *perm[4][:2]])
    assert sorted(batch[2:5]) == [0, 1, 2]


def test_resuming_from_a_step_gives_the_same_batches():
    examples = data.make_arithmetic(23, seed=0)
    run = [data.get_batch(examples, 5, seed=11, step=s) for s in range(8)]
    saved_step = 5  # a checkpoint after 5 batches stores only the step
    resumed = [data.get_batch(list(examples), 5, seed=11, step=s) for s in range(saved_step, saved_step + 3)]
    assert resumed == run[5:8]
    assert data.get_batch(examples, 5, seed=12, step=5) != run[5]


def test_batch_indices_validates():
    for n_examples, batch_size, seed, step in [(0, 4, 0, 0), (10, 0, 0, 0), (10, 4, -1, 0), (10, 4, 0, -1)]:
        detail = f"{n_examples=} {batch_size=} {seed=} {step=}"
        with pytest.raises(ValueError, match=re.escape(f"need positive sizes, non-negative seed, step: {detail}")):
            data.batch_indices(n_examples, batch_size, seed, step)
