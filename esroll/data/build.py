"""The (train, held-out) examples an experiment config names, built the same way by every method and script."""

from __future__ import annotations

from esroll.config import DataConfig
from esroll.data.batching import split_examples
from esroll.data.gsm8k import load_gsm8k
from esroll.data.gsm_symbolic import make_gsm_symbolic_splits
from esroll.data.synthetic import make_arithmetic, make_countdown
from esroll.data.tasks import Example


def make_splits(cfg: DataConfig) -> tuple[list[Example], list[Example]]:
    """(train, held-out): the held-out questions `cfg.eval_split` names (`held_out_splits`). With
    `cfg.min_difficulty` >= 0, both splits keep only the examples of at least that difficulty (`meta["difficulty"]`),
    taken from the unfiltered splits, so no question moves between them."""
    train, held_out = _splits(cfg)
    if cfg.min_difficulty >= 0:
        train, held_out = (_at_least(rows, cfg.min_difficulty) for rows in (train, held_out))
        if not train or len(held_out) <= cfg.validation_size:
            raise ValueError(
                f"config: data.min_difficulty={cfg.min_difficulty} leaves {len(train)} training and {len(held_out)} "
                f"held-out examples (data.validation_size={cfg.validation_size})"
            )
    validation, test = held_out_splits(held_out, cfg.validation_size)
    return train, validation if cfg.eval_split == "validation" else test


def _at_least(rows: list[Example], difficulty: int) -> list[Example]:
    missing = next((e for e in rows if "difficulty" not in e.meta), None)
    if missing is not None:
        raise ValueError(f"config: data.min_difficulty needs examples with a difficulty; {missing.task} rows have none")
    return [e for e in rows if e.meta["difficulty"] >= difficulty]


def held_out_splits(held_out: list[Example], validation_size: int) -> tuple[list[Example], list[Example]]:
    """(validation, test): the first `validation_size` held-out questions, and the rest."""
    return held_out[:validation_size], held_out[validation_size:]


def _splits(cfg: DataConfig) -> tuple[list[Example], list[Example]]:
    """Synthetic tasks are generated from `cfg.seed`; GSM8K is read from `cfg.path` (and `cfg.eval_path`).

    The held-out split never shares a prompt with the training split. GSM-Symbolic's never shares a template: its
    `cfg.n_examples` rows are `cfg.eval_size` held-out ones from templates never trained on and the rest for training.
    """
    if cfg.task == "arithmetic":
        rows = make_arithmetic(
            cfg.n_examples,
            cfg.seed,
            digits=cfg.digits,
            ops=tuple(cfg.ops),
            n_terms=cfg.n_terms,
            word_problems=cfg.word_problems,
        )
    elif cfg.task == "countdown":
        rows = make_countdown(cfg.n_examples, cfg.seed, n_numbers=cfg.countdown_numbers)
    elif cfg.task == "gsm_symbolic":  # split by template, not by prompt: see esroll.data.gsm_symbolic
        if cfg.n_examples <= cfg.eval_size:
            raise ValueError(
                f"config: data.n_examples={cfg.n_examples} leaves no training examples after "
                f"data.eval_size={cfg.eval_size} for data.task='gsm_symbolic'"
            )
        return make_gsm_symbolic_splits(cfg.n_examples - cfg.eval_size, cfg.eval_size, cfg.seed)
    elif cfg.task == "gsm8k":
        if not cfg.path:
            raise ValueError("config: 'data.path' must name a GSM8K file or dataset for data.task='gsm8k'")
        rows = load_gsm8k(cfg.path, split="train")
        if cfg.eval_path:
            held_out = load_gsm8k(cfg.eval_path, split="test")[: cfg.eval_size]
            seen = {e.prompt for e in held_out}
            return [e for e in rows if e.prompt not in seen], held_out
    else:
        raise ValueError(f"config: unknown data.task {cfg.task!r}")
    train, held_out = split_examples(rows, cfg.eval_size, cfg.seed)
    if not train:
        raise ValueError(f"config: no training examples left for data.task={cfg.task!r} after the held-out split")
    return train, held_out
