"""GuAE (guided advantage estimation, from Faithful-Agent): GRPO's group advantage tempered toward an anchor baseline,
a running mean of past rewards, with a weight that follows the group's reward variance, so that a group whose rewards
are all equal still gets a bounded signal. What it computes, and what its source leaves open: docs/step_level.md."""

from __future__ import annotations

import dataclasses

import numpy as np

from esroll.baselines import grpo
from esroll.config import check_fields
from esroll.grpo.advantages import Estimate, Group, register_advantage, valid_rewards


@dataclasses.dataclass(frozen=True)
class GuaeOptions:
    """GuAE's options (`grpo.adv.guae.*`). rate: how fast the anchor follows the batches' mean reward (an EMA,
    b ← (1 − rate)·b + rate·mean); tau: the group variance at which the group's own advantage and the anchor's weigh
    alike (weight of the group's own w = var / (var + tau)); bound: the anchor advantage r − b is clipped to
    [−bound, bound]."""

    rate: float = 0.1
    tau: float = 0.05
    bound: float = 1.0

    def __post_init__(self):
        checks = [
            ("rate", 0 < self.rate <= 1, "in (0, 1]"),
            ("tau", self.tau > 0 and np.isfinite(self.tau), "a positive finite number"),
            ("bound", self.bound > 0 and np.isfinite(self.bound), "a positive finite number"),
        ]
        check_fields(self, checks, "GuaeOptions")


def guae_init(o: GuaeOptions) -> dict:
    """The anchor b and whether it has seen a batch yet (`seen`, 0 or 1)."""
    return {"anchor": np.zeros((), np.float32), "seen": np.zeros((), np.float32)}


def guae(g: Group, o: GuaeOptions, state: dict) -> Estimate:
    """A = w·A_grpo + (1 − w)·clip(r − b, −bound, bound), per group, with w = var / (var + tau) (var: the population
    variance of the group's valid rewards) and b the anchor before this step (on the first step, which has no past,
    this batch's mean reward). A high-variance group keeps nearly GRPO's advantage; an all-equal group (var 0) gets
    the bounded anchor advantage r − b: positive where the whole group beat the running mean, negative where it fell
    below it. Then the anchor takes in this batch's mean valid reward. Invalid entries get 0. Logs `guae_anchor` (b
    as used) and `guae_weight` (mean w over the groups)."""
    r, valid = valid_rewards(g)
    n = valid.sum(1)
    mean = r.sum(1) / np.maximum(n, 1)
    var = np.where(valid, (r - mean[:, None]) ** 2, 0.0).sum(1) / np.maximum(n, 1)
    batch_mean = r.sum() / max(int(valid.sum()), 1)
    anchor = float(state["anchor"]) if float(state["seen"]) else batch_mean
    w = var / (var + o.tau)
    own = np.asarray(grpo(r, valid), np.float64)
    anchored = np.clip(r - anchor, -o.bound, o.bound)
    adv = w[:, None] * own + (1 - w[:, None]) * anchored
    adv = np.where(valid & (n[:, None] > 0), adv, 0.0)
    new = state
    if valid.any():
        new = {
            "anchor": np.asarray((1 - o.rate) * anchor + o.rate * batch_mean, np.float32),
            "seen": np.ones((), np.float32),
        }
    return Estimate(adv.astype(np.float32), None, new, {"guae_anchor": anchor, "guae_weight": float(w.mean())})


register_advantage("guae", guae, guae_init, options=GuaeOptions)
