"""Schedules of the learning rate and of ES's σ: functions of the optimizer step with a declared horizon, never of
wall time, so that a resumed run continues them exactly and a time-budgeted run follows the same curve step by step.

    constant   the start value throughout
    linear     start → final over `horizon` steps, then final
    cosine     start → final along half a cosine over `horizon` steps, then final

A warm-up (learning rate only) rises linearly from 0 to the start value over its steps, which count toward the
horizon. Built on `optax` schedules. `SCHEDULES` and `make_schedule` are defined in `esroll.config`, whose
`make_optimizer` needs them and which imports nothing from esroll; they are importable from here too.
"""

from __future__ import annotations

from esroll.config import SCHEDULES, make_schedule

__all__ = ["SCHEDULES", "make_schedule"]
