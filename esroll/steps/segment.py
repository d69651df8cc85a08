"""Reasoning steps of completions: where each step of a generated row ends, in characters and in whole tokens, the one
segmentation every step-level method reads (step advantages, branched rollouts, step verifiers), so that they all
agree on where a step ends.

A completion's text is cut right after each occurrence of the boundary string (a newline by default): the boundary
belongs to the step it ends. A whitespace-only piece joins the step before it (the step after it when it comes
first); a text without a boundary is one step; an empty completion has none. Steps beyond `max_steps` are merged into
the last.

In tokens, a step is the whole tokens that cover it. A token belongs to the step of its first character, so a
boundary inside a multi-character token ("\\n#" as one token) ends the step with that token; the first bytes of a
character that a later token completes go with that token; a special token (adding no text) goes with the token
before it, and EOS with the last step; positions past a row's length belong to no step (-1). So
`tokens[b, :end[b][s]]` is the completion through step s, a prefix a rollout can continue from, and its decoded text
(special tokens skipped, as rewards read completions) is the completion's text through that step.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

_INCOMPLETE = "\ufffd"  # what a byte-level decoder writes for the bytes of a character a later token completes


class Steps(NamedTuple):
    """The steps of B completions of N token positions."""

    step_BxN: np.ndarray  # [B, N] int32: the step of each completion token; -1 past the completion's length
    count_B: np.ndarray  # [B] int32: steps of each completion (0 for an empty one)
    end: tuple[tuple[int, ...], ...]  # end[b][s]: the tokens of row b through step s
    text: tuple[tuple[str, ...], ...]  # text[b][s]: the decoded text of step s of row b, its boundary included


def split_text(text: str, boundary: str = "\n") -> list[tuple[int, int]]:
    """Character spans (start, end) of the steps of `text`, covering it contiguously ([] for an empty text)."""
    if not boundary:
        raise ValueError("a step boundary must be a non-empty string")
    cuts, at = [], text.find(boundary)
    while at >= 0:
        cuts.append(at + len(boundary))
        at = text.find(boundary, at + len(boundary))
    edges = [0, *(c for c in cuts if c < len(text)), len(text)]
    pieces = [(a, b) for a, b in itertools.pairwise(edges) if b > a]
    spans: list[list[int]] = []
    for a, b in pieces:
        # a whitespace-only piece joins the step before; a first step that is whitespace only takes the next piece
        if spans and (not text[a:b].strip() or not text[spans[-1][0] : spans[-1][1]].strip()):
            spans[-1][1] = b
        else:
            spans.append([a, b])
    return [(a, b) for a, b in spans]


def segment(
    tokenizer: Any,
    tokens_BxN: np.ndarray,
    length_B: np.ndarray,
    *,
    eos_ids: Sequence[int] = (),
    boundary: str = "\n",
    max_steps: int = 64,
) -> Steps:
    """The steps of each row's completion `tokens_BxN[b, :length_B[b]]` (see the module docstring). `eos_ids`: the
    end-of-sequence ids (default: the tokenizer's); they and the tokenizer's other special tokens add no text."""
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    tokens_BxN = np.asarray(tokens_BxN)
    B, N = tokens_BxN.shape
    length_B = np.clip(np.asarray(length_B).reshape(B), 0, N)
    eos = {int(e) for e in eos_ids} or {int(tokenizer.eos_token_id)}
    silent = eos | {int(i) for i in getattr(tokenizer, "all_special_ids", None) or ()}
    step_BxN = np.full((B, N), -1, np.int32)
    ends, texts = [], []
    for b in range(B):
        row = [int(t) for t in tokens_BxN[b, : length_B[b]]]
        steps, end, text = _segment_row(tokenizer, row, silent, eos, boundary, max_steps)
        step_BxN[b, : len(steps)] = steps
        ends.append(end)
        texts.append(text)
    return Steps(step_BxN, np.array([len(e) for e in ends], np.int32), tuple(ends), tuple(texts))


def _decode(tokenizer: Any, ids: list[list[int]]) -> list[str]:
    return list(tokenizer.batch_decode(ids, skip_special_tokens=True)) if ids else []


def _reached(tokenizer: Any, ids: list[int], full: str) -> list[int]:
    """For each of `ids` (text tokens), the character of `full` (their decoded text) reached after it: from each
    token's own text when those concatenate to `full`, else from decoding every prefix (characters split over
    tokens, tokenizers that decode in context), counting only the characters a prefix shares with `full`."""
    pieces = _decode(tokenizer, [[t] for t in ids])
    if "".join(pieces) == full and not any(_INCOMPLETE in p for p in pieces):
        return list(np.cumsum([len(p) for p in pieces], dtype=int)) if pieces else []
    reached, out = 0, []
    for prefix in _decode(tokenizer, [ids[: k + 1] for k in range(len(ids))]):
        n = 0
        while n < min(len(prefix), len(full)) and prefix[n] == full[n]:
            n += 1
        reached = max(reached, n)
        out.append(reached)
    return out


def _segment_row(
    tokenizer: Any, row: list[int], silent: set[int], eos: set[int], boundary: str, max_steps: int
) -> tuple[list[int], tuple[int, ...], tuple[str, ...]]:
    """One row: the step of each of its tokens, each step's end (a token count) and text."""
    if not row:
        return [], (), ()
    text_ids = [t for t in row if t not in silent]
    (full,) = _decode(tokenizer, [text_ids])
    spans = split_text(full, boundary)
    if not spans:  # no text at all (only special tokens): one step
        return [0] * len(row), (len(row),), ("",)
    span_ends = [b for _, b in spans]
    reached = iter(_reached(tokenizer, text_ids, full))
    raw, start, before, current, pending = [], [], 0, 0, []
    for i, t in enumerate(row):
        if t not in silent:
            after = next(reached)
            if after > before:  # adds text: the step of its first character, and so the bytes it completes
                current = min(bisect.bisect_right(span_ends, before), len(spans) - 1)
                start.append((current, before))
                for j in pending:
                    raw[j] = current
                pending = []
            else:
                pending.append(i)
            before = after
        raw.append(current)
    raw = [raw[-1] if t in eos else s for t, s in zip(row, raw)]  # EOS: with the last step
    # Number the steps that hold a token 0, 1, ... (a step inside one token joins that token's), then cap them.
    kept = sorted(set(raw))
    steps = [min(kept.index(s), max_steps - 1) for s in raw]
    count = max(steps) + 1
    end = tuple(max(i for i, s in enumerate(steps) if s == g) + 1 for g in range(count))
    first_char = {}
    for s, c in start:
        first_char.setdefault(min(kept.index(s), max_steps - 1), c)
    first_char[0] = 0
    bounds = [first_char.get(g, 0) for g in range(count)] + [len(full)]
    text = tuple(full[bounds[g] : bounds[g + 1]] for g in range(count))
    return steps, end, text
