"""The (train, held-out) examples an experiment config names, built the same way by every method and script: the
registered task (`esroll.data.register_task`) builds them, and what every task shares is applied here."""

from __future__ import annotations

from esroll.config import DataConfig
from esroll.data.tasks import TASKS, Example, task_spec


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
    """The registered task's (train, held-out) examples (`TaskSpec.splits`), checked to be rows of registered tasks:
    scoring dispatches on each row's `task`."""
    train, held_out = task_spec(cfg.task).splits(cfg)
    stray = next((e.task for e in (*train, *held_out) if e.task not in TASKS), None)
    if stray is not None:
        raise ValueError(f"config: data.task={cfg.task!r} builds examples of task {stray!r}, which is not registered")
    return list(train), list(held_out)
