"""Schedules of the learning rate and of ES's σ: functions of the optimizer step with a declared horizon, never of
wall time, so that a resumed run continues them exactly and a time-budgeted run follows the same curve step by step.

    constant   the start value throughout
    linear     start → final over `horizon` steps, then final
    cosine     start → final along half a cosine over `horizon` steps, then final

A warm-up (learning rate only) rises linearly from 0 to the start value over its steps, which count toward the
horizon. Built on `optax` schedules, imported when a schedule is built (importing this module does not import JAX).
Imports nothing from esroll, so `esroll.config` can build its optimizer's schedule from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import optax

SCHEDULES = ("constant", "linear", "cosine")


def make_schedule(kind: str, start: float, final: float, horizon: int, warmup: int = 0) -> float | optax.Schedule:
    """The schedule as optax takes it (see `esroll.schedules`): a plain float when it is constant with no warm-up
    (the optimizer state is then the same as without a schedule), else a function of the step (int, traced or not)."""
    import optax  # imports JAX: not at module import (see the module docstring)

    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r} (expected one of {', '.join(SCHEDULES)})")
    if kind == "constant":
        if not warmup:
            return start
        decay = optax.constant_schedule(start)
    elif kind == "linear":
        decay = optax.linear_schedule(start, final, horizon - warmup)
    else:
        decay = optax.cosine_decay_schedule(start, horizon - warmup, alpha=final / start)
    if not warmup:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, start, warmup), decay], [warmup])
