"""SAS (step-level advantage selection): GRPO's advantage, withheld from the steps whose confidence says they did not
earn it: the least confident steps of correct completions and the most confident steps of failed ones. What it
computes, and what its source leaves open: docs/step_level.md."""

from __future__ import annotations

import dataclasses

import numpy as np

from esroll.baselines import grpo
from esroll.config import check_fields
from esroll.grpo.advantages import Estimate, Group, per_token, register_advantage, step_means, valid_rewards


@dataclasses.dataclass(frozen=True)
class SasOptions:
    """SAS's options (`grpo.adv.sas.*`). q_low: the quantile of the correct completions' step confidences below which
    a correct completion's step gets no advantage; q_high: the quantile of the failed completions' step confidences
    above which a failed completion's step gets none (0 and 1 withhold nothing); correct: the reward at or above
    which a completion counts as correct (the others as failed)."""

    q_low: float = 0.2
    q_high: float = 0.8
    correct: float = 1.0

    def __post_init__(self):
        checks = [
            ("q_low", 0 <= self.q_low <= 1, "in [0, 1]"),
            ("q_high", 0 <= self.q_high <= 1, "in [0, 1]"),
            ("correct", np.isfinite(self.correct), "a finite number"),
        ]
        check_fields(self, checks, "SasOptions")


def step_confidence(g: Group) -> np.ndarray:
    """[X, M, J]: the mean log-probability (under the sampling policy) of each step's tokens; NaN past a completion's
    steps. J is the most steps of any completion."""
    return step_means(g, g.token_logp)


def sas(g: Group, o: SasOptions, state=None) -> Estimate:
    """Per-token advantages: GRPO's group advantage on every token of a completion, except the steps SAS withholds.

    The confidences of all steps of the batch's correct completions are pooled, and a correct completion's step
    whose confidence is below their `q_low` quantile (numpy's linear interpolation) gets 0; likewise a failed
    completion's step above the `q_high` quantile of the failed completions' steps. Invalid completions and tokens
    past a completion's end get 0. Logs `sas_withheld_correct` and `sas_withheld_failed`: the fraction of the
    correct (failed) completions' steps withheld."""
    r, valid = valid_rewards(g)
    base = np.asarray(grpo(r, valid), np.float64)  # 0 on invalid entries
    conf = step_confidence(g)
    known = ~np.isnan(conf)
    correct = (valid & (r >= o.correct))[..., None] & known
    failed = (valid & (r < o.correct))[..., None] & known
    withheld = np.zeros(conf.shape, bool)
    metrics = {}
    for name, steps, q, side in (("correct", correct, o.q_low, -1), ("failed", failed, o.q_high, 1)):
        if steps.any():
            cut = np.quantile(conf[steps], q)
            withheld |= steps & (side * (conf - cut) > 0)
        metrics[f"sas_withheld_{name}"] = float(withheld[steps].mean()) if steps.any() else 0.0
    return Estimate(per_token(g, np.where(withheld, 0.0, base[..., None])), metrics=metrics)


register_advantage("sas", sas, options=SasOptions, needs=("logprobs", "steps"))
