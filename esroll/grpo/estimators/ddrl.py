"""DDRL (label-free only): fixed ±a advantages from the group's answer consistency, ambiguous groups excluded, positives
and negatives balanced over the batch. What it computes, and what its source leaves open:
docs/advantages.md."""

from __future__ import annotations

import dataclasses

import numpy as np

from esroll.config import check_fields
from esroll.grpo.advantages import Estimate, Group, register_advantage, valid_rewards


@dataclasses.dataclass(frozen=True)
class DDRLOptions:
    """DDRL's options (`grpo.adv.ddrl.*`). A group whose modal answer is held by a fraction ≤ low of it is all
    negative, ≥ high has its modal answers positive and the rest negative, in between it is left out; value: the fixed
    advantage a."""

    low: float = 0.3
    high: float = 0.6
    value: float = 1.0

    def __post_init__(self):
        checks = [
            ("high", 0.5 < self.high <= 1, "in (0.5, 1] (a unique modal answer)"),
            ("low", 0 <= self.low < self.high, "in [0, high)"),
            ("value", self.value > 0, "> 0"),
        ]
        check_fields(self, checks, "DDRLOptions")


def ddrl(g: Group, o: DDRLOptions, state=None) -> Estimate:
    """DDRL (label-free): fixed advantages from answer consistency, ambiguous groups left out, classes balanced.

    A group's consistency c is the fraction of it holding its modal answer. c ≥ `high`: the modal answers are
    positive (+a), the others negative (−a); c ≤ `low`: all negative (no consensus); in between, and a group of
    fewer than 2 valid responses (a lone answer is no consensus, nor its absence a disagreement): left out (0).
    Then the larger class is subsampled to the size of the smaller over the whole batch (a seeded draw from
    (seed, step)), so positives and negatives carry equal weight; a batch with no positives (or no negatives) keeps
    nothing, and its update is zero."""
    if g.answers is None:
        raise ValueError("ddrl needs the parsed answers (label-free mode: data.reward = 'majority')")
    _, valid = valid_rewards(g)
    a = np.where(valid, np.asarray(g.answers), -1)
    X, M = a.shape
    same = (a[:, :, None] == a[:, None, :]) & (a[:, None, :] >= 0)
    counts = np.where(a >= 0, same.sum(-1), 0)
    c = counts.max(1) / np.maximum(valid.sum(1), 1)
    modal = (counts == counts.max(1, keepdims=True)) & (counts > 0)
    label = np.zeros((X, M))
    enough = valid.sum(1) >= 2
    high, low = enough & (c >= o.high), enough & (c <= o.low)
    label[high] = np.where(modal[high], 1.0, -1.0)
    label[low] = -1.0
    label = np.where(valid, label, 0.0)
    rng = np.random.default_rng([g.seed, g.step, 23])
    pos, neg = np.flatnonzero(label.ravel() > 0), np.flatnonzero(label.ravel() < 0)
    keep = min(len(pos), len(neg))
    flat = np.zeros(X * M)
    flat[rng.permutation(pos)[:keep]] = o.value
    flat[rng.permutation(neg)[:keep]] = -o.value
    metrics = {
        "ddrl_excluded_groups": float(np.mean(~high & ~low)),
        "ddrl_kept_fraction": float(2 * keep / max(int(valid.sum()), 1)),
    }
    return Estimate(flat.reshape(X, M).astype(np.float32), metrics=metrics)


register_advantage("ddrl", ddrl, options=DDRLOptions, needs=("answers",), label_free_only=True)
