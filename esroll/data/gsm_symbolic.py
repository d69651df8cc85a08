"""GSM-Symbolic word problems in the GSM8K schema, generated offline by reasoning-gym, split by template.

GSM-Symbolic (Mirzadeh et al., 2024) turns GSM8K test problems into templates whose names and numbers are redrawn, so
each instance is a new GSM8K-style problem with a numeric answer and a worked solution ending in "#### n".
reasoning-gym (an optional dependency: `pip install 'esroll[tasks]'`, or `pip install reasoning-gym`) ships one
generator per template, `generate_<id>` for ids 0-99; only the ids in its `tasks_ok` list are used (85 in
reasoning-gym 0.1.19; its `tasks_need_fix` ones raise or lack a "#### n" line). The id is the template: every row
stores it as `meta["template"]`.

Split by template: `gsm_symbolic_templates(seed)` holds out a fifth of the templates (17 of 85), the first ones of a
seeded permutation, and `make_gsm_symbolic_splits` (what `make_splits` uses) draws training rows only from the others
and held-out rows only from them, so held-out problems come from templates never trained on.

Generation is fast (about 0.08 ms a problem, 0.15-0.2 s for 2000; importing reasoning-gym takes 1-2 s, once) and
makes only the rows asked for. Rows are a pure function of the seed and the reasoning-gym version: templates and per-problem streams are
seeded explicitly, never from global random state or `hash()`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from fractions import Fraction
from random import Random
from typing import Any

import numpy as np

from esroll import rewards
from esroll.data.gsm8k import example_from_gsm8k
from esroll.data.tasks import Example

HELD_OUT_FRACTION = 0.2  # of the templates, held out from training (17 of 85)
MAX_DRAWS = 100  # consecutive rejected draws of one template before giving up

Generator = Callable[[Random, float], dict[str, Any]]


def _generators() -> dict[int, Generator]:
    """reasoning-gym's usable GSM-Symbolic generators by template id, imported on first use."""
    try:
        from reasoning_gym.arithmetic.gsm_symbolic.gsm_symbolic import (
            GSMSymbolicDataset,
            GSMSymbolicDatasetConfig,
            tasks_ok,
        )
    except ImportError:
        raise ImportError(
            "data.task='gsm_symbolic' needs reasoning-gym: pip install 'esroll[tasks]' (or pip install reasoning-gym)"
        ) from None
    every = GSMSymbolicDataset(GSMSymbolicDatasetConfig(seed=0, size=1)).generators
    return {t: every[t] for t in sorted(tasks_ok)}


def gsm_symbolic_templates(seed: int, held_out_fraction: float = HELD_OUT_FRACTION) -> tuple[list[int], list[int]]:
    """(training, held-out) template ids, each sorted.

    The held-out ids are the first `max(1, round(held_out_fraction * T))` of `np.random.default_rng(seed)`'s
    permutation of the T usable ids in increasing order; the rest are for training.
    """
    if not 0 < held_out_fraction < 1:
        raise ValueError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}")
    ids = sorted(_generators())
    k = max(1, round(held_out_fraction * len(ids)))
    held_out = {ids[i] for i in np.random.default_rng(seed).permutation(len(ids))[:k]}
    return [t for t in ids if t not in held_out], sorted(held_out)


def _example(problem: dict[str, Any], template: int, draw: int) -> Example | None:
    """The Example of one generated problem, or None if it is unusable: an answer that is not a number, or negative
    (template 24 sometimes asks for an age of -2), or a worked solution whose "#### n" disagrees with the answer."""
    answer = rewards.parse_number(str(problem.get("answer", "")))
    question = str(problem.get("question", "")).strip()
    if answer is None or answer.startswith("-") or not question:
        return None
    work = str(problem.get("metadata", {}).get("answer_cot") or "")
    if "####" in work:
        work, _, final = work.rpartition("####")
        stated = rewards.parse_number(final)
        if stated is None or Fraction(stated) != Fraction(answer):
            return None
    work = work.strip()
    solution = f"{work}\n#### {answer}" if work else f"#### {answer}"  # "#### 10290.0" becomes "#### 10290"
    example = example_from_gsm8k({"question": question, "answer": solution}, f"template {template}", "gsm_symbolic")
    return dataclasses.replace(example, meta={"template": template, "draw": draw})


def make_gsm_symbolic(n: int, seed: int, *, templates: Sequence[int] | None = None) -> list[Example]:
    """`n` GSM-Symbolic problems from `templates` (default: every usable one), as GSM8K-schema Examples.

    Templates are spread evenly: the row order is one `np.random.default_rng(seed)` permutation of the (sorted)
    templates after another, so template counts differ by at most one. A template's d-th draw is its generator run
    with `random.Random(f"gsm_symbolic/{seed}/{template}/{d}")`; draws that `_example` rejects are skipped. `meta`
    holds "template" and "draw", which regenerate the row. `solution` is the worked solution ending in
    "#### <answer>" (just "#### <answer>" if the generator gives none), `answer` the canonical number, and
    `target_text` " <solution>".
    """
    generators = _generators()
    ids = sorted(set(generators if templates is None else templates))
    unknown = sorted(set(ids) - set(generators))
    if unknown or not ids:
        raise ValueError(f"templates must be a non-empty subset of reasoning-gym's usable ids, got unknown {unknown}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = np.random.default_rng(seed)
    order = [ids[i] for _ in range(-(-n // len(ids))) for i in rng.permutation(len(ids))][:n]
    draws = dict.fromkeys(ids, 0)
    examples = []
    for t in order:
        for _ in range(MAX_DRAWS):
            draw, draws[t] = draws[t], draws[t] + 1
            try:
                example = _example(generators[t](Random(f"gsm_symbolic/{seed}/{t}/{draw}"), 1.0), t, draw)
            except (ArithmeticError, ValueError):  # a generator bug hit by this draw: skip it like an unusable one
                example = None
            if example is not None:
                examples.append(example)
                break
        else:
            raise RuntimeError(f"reasoning-gym gsm_symbolic template {t}: {MAX_DRAWS} draws in a row were unusable")
    return examples


def make_gsm_symbolic_splits(
    n_train: int, n_held_out: int, seed: int, *, held_out_fraction: float = HELD_OUT_FRACTION
) -> tuple[list[Example], list[Example]]:
    """(train, held-out) problems from disjoint templates: `gsm_symbolic_templates(seed, held_out_fraction)` picks
    the held-out templates, and `make_gsm_symbolic` draws `n_train` rows from the others and `n_held_out` from them.

    Held-out accuracy thus measures transfer to problem templates never trained on, not to new numbers in a known
    template.
    """
    train_ids, held_out_ids = gsm_symbolic_templates(seed, held_out_fraction)
    train = make_gsm_symbolic(n_train, seed, templates=train_ids)
    return train, make_gsm_symbolic(n_held_out, seed, templates=held_out_ids)
