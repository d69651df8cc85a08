"""GMAE: a response's centred advantage averaged over the group contexts (subsets of the others) it could have been
sampled into; closed form k/(k+1)·RLOO when rewards do not depend on the context. What it computes, and what its source leaves open:
docs/advantages.md."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable

import numpy as np

from esroll.baselines import rloo
from esroll.config import check_fields
from esroll.grpo.advantages import Estimate, Group, register_advantage, valid_rewards
from esroll.rewards import majority_rewards


@dataclasses.dataclass(frozen=True)
class GMAEOptions:
    """GMAE's options (`grpo.adv.gmae.*`). context: k, the other responses in a context (0: group_size // 2);
    max_contexts: above this many contexts per response, a seeded sample of them is averaged (exact enumeration
    below it)."""

    context: int = 0
    max_contexts: int = 256

    def __post_init__(self):
        checks = [
            ("context", self.context >= 0, ">= 0 (0: group_size // 2)"),
            ("max_contexts", self.max_contexts >= 1, ">= 1"),
        ]
        check_fields(self, checks, "GMAEOptions")


def gmae_contexts(M: int, k: int, i: int, max_contexts: int, rng: np.random.Generator) -> list[tuple[int, ...]]:
    """The groups T = {i} ∪ S, S a k-subset of the other M − 1 responses: all of them, or a uniform sample of
    `max_contexts` of them when there are more."""
    others = [j for j in range(M) if j != i]
    if math.comb(M - 1, k) <= max_contexts:
        subsets = list(itertools.combinations(others, k))
    else:
        subsets = [tuple(sorted(rng.choice(others, k, replace=False))) for _ in range(max_contexts)]
    return [tuple(sorted((i, *s))) for s in subsets]


def gmae_enumerate(
    M: int,
    k: int,
    context_reward: Callable[[tuple[int, ...]], np.ndarray],
    max_contexts: int = 256,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """GMAE of one group by enumeration: for each response i, the mean over its contexts T of
    r_i(T) − mean_{j∈T} r_j(T), with `context_reward(T)` the rewards of T's members when T is the group."""
    rng = rng or np.random.default_rng(0)
    out = np.zeros(M)
    for i in range(M):
        total = 0.0
        contexts = gmae_contexts(M, k, i, max_contexts, rng)
        for T in contexts:
            rT = np.asarray(context_reward(T), np.float64)
            total += rT[T.index(i)] - rT.mean()
        out[i] = total / len(contexts)
    return out


def gmae(g: Group, o: GMAEOptions, state=None) -> Estimate:
    """GMAE: a response's advantage in expectation over the group contexts it could have been sampled into.

    A context is {i} ∪ S, S a uniform k-subset of the other responses (k = `context`, default M // 2); the
    advantage in a context is Dr. GRPO's r_i(T) − mean_T r(T). When rewards do not depend on the context (gold
    labels) this is k/(k + 1)·RLOO in closed form. With label-free rewards (`Group.answers`), r_i(T) is the majority
    vote of T (`majority_rewards`), enumerated over every context (or a seeded sample of `max_contexts`)."""
    r, valid = valid_rewards(g)
    X, M = r.shape
    if g.answers is None:  # context-free rewards: the closed form
        k = o.context or M // 2
        adv = np.asarray(rloo(r, valid), np.float64)
        n = valid.sum(1, keepdims=True)
        k_eff = np.minimum(k, np.maximum(n - 1, 0))
        return Estimate(np.where(valid, k_eff / (k_eff + 1) * adv, 0.0).astype(np.float32))
    answers = np.asarray(g.answers)
    rng = np.random.default_rng([g.seed, g.step, 19])
    adv = np.zeros((X, M))
    for x in range(X):
        idx = np.flatnonzero(valid[x])
        n = len(idx)
        if n < 2:
            continue
        k = min(o.context or M // 2, n - 1)
        a = answers[x, idx]
        adv[x, idx] = gmae_enumerate(n, k, lambda T, a=a: majority_rewards(a[list(T)][None])[0], o.max_contexts, rng)
    return Estimate(adv.astype(np.float32))


register_advantage("gmae", gmae, options=GMAEOptions, needs=("answers",))
