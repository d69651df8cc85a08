"""A-GRAE: GRPO advantages, positive ones scaled by a scheduled factor, groups weighted by a difficulty focus that
moves from easy to hard over `horizon` steps. What it computes, and what its source leaves open:
docs/advantages.md."""

from __future__ import annotations

import dataclasses

import numpy as np

from esroll.baselines import grpo
from esroll.config import ConfigError, check_fields
from esroll.grpo.advantages import Estimate, Group, register_advantage, valid_rewards


def _progress(step: int, horizon: int) -> float:
    """t in [0, 1]: how far the schedules over `horizon` steps have gone (0 when there is no horizon)."""
    return min(step / horizon, 1.0) if horizon > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class AgraeOptions:
    """A-GRAE's options (`grpo.adv.agrae.*`). horizon: the steps its schedules run over (>= 1 to use it); positive /
    positive_final: the factor on positive advantages at step 0 / from the horizon on (linear in between; 1 =
    symmetric GRPO); focus: the difficulty-focus strength κ in [0, 1): a group of success rate p is weighted
    1 + κ·(1 − 2t)·(2p − 1), t = step / horizon (capped at 1): easy groups first, hard ones by the end."""

    horizon: int = 0
    positive: float = 1.0
    positive_final: float = 0.5
    focus: float = 0.5

    def __post_init__(self):
        checks = [
            ("horizon", self.horizon >= 0, ">= 0"),
            ("positive", self.positive >= 0, ">= 0"),
            ("positive_final", self.positive_final >= 0, ">= 0"),
            ("focus", 0 <= self.focus < 1, "in [0, 1)"),
        ]
        check_fields(self, checks, "AgraeOptions")

    def check(self, grpo) -> None:
        if self.horizon < 1:
            raise ConfigError("adv.agrae.horizon", self.horizon, ">= 1 for agrae (its schedules' length)")


def agrae(g: Group, o: AgraeOptions, state=None) -> Estimate:
    """A-GRAE: GRPO's advantage with positive entries scaled by β_t and each group weighted by its difficulty focus.

    β_t runs linearly from `positive` to `positive_final` over `horizon` steps; a group of success rate p
    (its mean reward, clipped to [0, 1]) is weighted 1 + κ·(1 − 2t)·(2p − 1): at t = 0 easy groups weigh up to 1 + κ
    and hard ones down to 1 − κ, at t = 1/2 all weigh 1, at t = 1 the other way round. With β = 1 and κ = 0 it is
    `grpo` exactly."""
    r, valid = valid_rewards(g)
    t = _progress(g.step, o.horizon)
    beta = o.positive + (o.positive_final - o.positive) * t
    base = np.asarray(grpo(r, valid), np.float64)
    n = np.maximum(valid.sum(1), 1)
    p = np.clip(r.sum(1) / n, 0.0, 1.0)
    weight = 1.0 + o.focus * (1.0 - 2.0 * t) * (2.0 * p - 1.0)
    adv = np.where(base > 0, beta * base, base) * weight[:, None]
    return Estimate(np.where(valid, adv, 0.0).astype(np.float32), metrics={"agrae_positive": beta, "agrae_t": t})


register_advantage("agrae", agrae, options=AgraeOptions)
