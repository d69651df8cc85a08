"""esroll.steps: completions cut into steps, in characters and whole tokens. Expected spans are worked out by hand
on a tokenizer whose pieces are written out below, and checked on the shipped steps model's own tokenizer."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import REPO

from esroll.data.synthetic import make_arith_steps
from esroll.steps import segment, split_text

EOS, PAD = 0, 0


class Pieces:
    """A byte-level tokenizer of fixed pieces: token i decodes to PIECES[i] (bytes), EOS (0) to nothing; decoding
    joins the bytes and replaces an incomplete character, as byte-level BPE decoders do."""

    PIECES = {1: b"ab", 2: b"c\nd", 3: b"e", 4: b"\n", 5: b"f", 6: b"\xc3", 7: b"\xa9", 8: b" ", 9: b"\n\n"}
    eos_token_id = EOS
    all_special_ids = (EOS,)

    def batch_decode(self, rows, skip_special_tokens=True):
        return [b"".join(self.PIECES.get(t, b"") for t in row).decode("utf-8", errors="replace") for row in rows]


def run(*rows, **kwargs):
    N = max(len(r) for r in rows) + 2
    tokens = np.full((len(rows), N), PAD, np.int32)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = r
    return segment(Pieces(), tokens, np.array([len(r) for r in rows]), eos_ids=[EOS], **kwargs)


def test_split_text():
    assert split_text("a\nb\nc") == [(0, 2), (2, 4), (4, 5)]
    assert split_text("a\nb\n") == [(0, 2), (2, 4)]  # a trailing boundary ends the last step
    assert split_text("a\n\n b") == [(0, 3), (3, 5)]  # a whitespace-only piece joins the step before
    assert split_text("\n\na\nb") == [(0, 4), (4, 5)]  # ... or the step after, when it comes first
    assert split_text("no boundary") == [(0, 11)] and split_text("") == []
    assert split_text("x; y; z", "; ") == [(0, 3), (3, 6), (6, 7)]
    with pytest.raises(ValueError, match="non-empty"):
        split_text("a", "")


def test_a_boundary_inside_a_token_ends_the_step_with_that_token():
    # text "abc\nde\nf": steps "abc\n", "de\n", "f"; token 2 ("c\nd") starts in step 0, so step 0 is tokens 0-1
    # and its text, as decoded from those tokens, runs through the "d"; EOS joins the last step; padding: -1.
    s = run([1, 2, 3, 4, 5, EOS])
    np.testing.assert_array_equal(s.step_BxN[0], [0, 0, 1, 1, 2, 2, -1, -1])
    assert s.count_B.tolist() == [3] and s.end == ((2, 4, 6),)
    assert s.text == (("abc\nd", "e\n", "f"),)
    rows = Pieces().batch_decode([[1, 2, 3, 4, 5, EOS][:e] for e in s.end[0]])
    assert rows == ["abc\nd", "abc\nde\n", "abc\nde\nf"]  # a prefix through step s decodes to the text through it


def test_no_boundary_empty_and_only_special_tokens():
    s = run([1, 3, 5, EOS], [], [EOS])
    assert s.count_B.tolist() == [1, 0, 1] and s.end == ((4,), (), (1,))
    assert s.text == (("abef",), (), ("",))
    np.testing.assert_array_equal(s.step_BxN[1], -1)


def test_a_character_split_over_tokens_goes_with_the_token_that_completes_it():
    # "ab\n" then "é" as two byte tokens (6 opens it, 7 completes it), then "\nf": the opening byte starts step 1
    s = run([1, 4, 6, 7, 4, 5, EOS])
    np.testing.assert_array_equal(s.step_BxN[0, :7], [0, 0, 1, 1, 1, 2, 2])
    assert s.text == (("ab\n", "é\n", "f"),)


def test_whitespace_pieces_and_the_cap_on_steps():
    s = run([1, 9, 8, 3, 4, 5, 4, 1])  # "ab\n\n e\nf\nab": the blank line joins step 0
    assert s.text == (("ab\n\n", " e\n", "f\n", "ab"),)
    capped = run([1, 9, 8, 3, 4, 5, 4, 1], max_steps=2)
    assert capped.text == (("ab\n\n", " e\nf\nab"),) and capped.end == ((2, 8),)


def test_the_shipped_steps_tokenizer_cuts_worked_solutions_into_their_lines():
    """On the tokenizer the step model writes with (where "=-" and "####" are single tokens), every line of a worked
    solution is one step, through its newline; the prefix through a step decodes to the solution through that line."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(REPO / "assets" / "tiny-qwen3-steps")
    examples = make_arith_steps(20, 3)
    rows = [tokenizer.encode(e.target_text) + [tokenizer.eos_token_id] for e in examples]
    N = max(map(len, rows))
    tokens = np.array([r + [tokenizer.eos_token_id] * (N - len(r)) for r in rows])
    s = segment(tokenizer, tokens, np.array([len(r) for r in rows]))
    for b, e in enumerate(examples):
        lines = e.target_text.split("\n")
        assert s.text[b] == tuple([line + "\n" for line in lines[:-1]] + [lines[-1]])
        through = tokenizer.batch_decode([rows[b][:end] for end in s.end[b]], skip_special_tokens=True)
        assert through == ["\n".join(lines[: k + 1]) + ("\n" if k + 1 < len(lines) else "") for k in range(len(lines))]
