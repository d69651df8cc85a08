"""On-policy distillation as advantage estimators: a teacher scores every token the student samples
(`esroll.teacher`), and the GRPO step's clipped update follows the per-token advantage it gives. Each reads
"teacher" (the `teacher` config section names the model) and the token log-probabilities the rollout saw.

    opd       −(log π_old − log π_T) per token: the per-token reverse KL's negative (the on-policy distillation recipe)
    gndpo     GNDPO: clip(log π_T − log π_old, ±clip) whitened over every valid token of the step
    opd_plus  OPD+: −f'(u), u = π_old/π_T, the exact score-function weight of the f-divergence D_f(π‖π_T)
              (`divergence`, `alpha`); `exact = False` gives the usual stop-gradient weight −f(u)/u, biased for
              every f but reverse KL
    gkd       GKD: no advantage of its own; the update adds the generalised JSD_β between the teacher's and the
              student's whole next-token distributions at every trained token (`beta`), on the student's own
              samples for a `student_fraction` of the steps and on the data's target completions for the rest

Each may add the verifier's signal, `reward_weight` times GRPO's group-normalised reward advantage on every token of
a completion (users combine them; 0, the default, distils alone). The formulas, worked by hand: docs/distillation.md.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from esroll import baselines
from esroll.config import check_fields
from esroll.grpo.advantages import Estimate, Group, register_advantage, valid_rewards
from esroll.grpo.distill import DIVERGENCES, GNDPO_CLIP, f_weight, gndpo_advantage, opd_advantage


@dataclasses.dataclass(frozen=True)
class OpdOptions:
    """`grpo.adv.opd.*`. reward_weight: the weight of GRPO's group-normalised reward advantage added to every token's
    teacher advantage (0: distillation alone)."""

    reward_weight: float = 0.0

    def __post_init__(self):
        check_fields(self, [("reward_weight", self.reward_weight >= 0, ">= 0")], type(self).__name__)


@dataclasses.dataclass(frozen=True)
class GndpoOptions(OpdOptions):
    """`grpo.adv.gndpo.*`. clip: the bound of the teacher log-ratio before whitening (GNDPO's 5); reward_weight: as
    `opd`'s."""

    clip: float = GNDPO_CLIP

    def __post_init__(self):
        super().__post_init__()
        check_fields(self, [("clip", self.clip > 0, "> 0")], "GndpoOptions")


@dataclasses.dataclass(frozen=True)
class OpdPlusOptions(OpdOptions):
    """`grpo.adv.opd_plus.*`. divergence: the f of D_f(π‖π_T) (`esroll.grpo.distill.DIVERGENCES`); alpha: the
    α-divergence's α (not 0 or 1); exact: the exact weight f'(u) (True) or the stop-gradient f(u)/u; reward_weight:
    as `opd`'s."""

    divergence: str = "reverse_kl"
    alpha: float = 0.5
    exact: bool = True

    def __post_init__(self):
        super().__post_init__()
        checks = [
            ("divergence", self.divergence in DIVERGENCES, f"one of {', '.join(DIVERGENCES)}"),
            ("alpha", self.alpha not in (0.0, 1.0), "not 0 or 1 (those are the two KLs)"),
        ]
        check_fields(self, checks, "OpdPlusOptions")


@dataclasses.dataclass(frozen=True)
class GkdOptions(OpdOptions):
    """`grpo.adv.gkd.*`. beta: the generalised JSD's β (0: forward KL(π_T‖π_θ), 1: reverse KL(π_θ‖π_T), 0.5: JSD;
    TRL's default 0.5); student_fraction: the share of steps trained on the student's own samples, the rest on the
    data's target completions (GKD's λ; TRL's default 0.5); reward_weight: as `opd`'s (on the student's steps)."""

    beta: float = 0.5
    student_fraction: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        checks = [
            ("beta", 0 <= self.beta <= 1, "in [0, 1]"),
            ("student_fraction", 0 <= self.student_fraction <= 1, "in [0, 1]"),
        ]
        check_fields(self, checks, "GkdOptions")


def _mask(g: Group) -> np.ndarray:
    """[X, M, N]: the tokens of valid completions."""
    _, valid = valid_rewards(g)
    return np.asarray(g.token_mask, bool) & valid[..., None]


def _with_reward(g: Group, teacher_XxMxN: np.ndarray, mask: np.ndarray, o: OpdOptions) -> Estimate:
    """The teacher's per-token advantage plus `reward_weight` × GRPO's advantage; logs the mean teacher log-ratio
    log π_T − log π_old over the valid tokens (minus the sampled tokens' reverse KL estimate)."""
    adv = np.where(mask, teacher_XxMxN, 0.0)
    if o.reward_weight:
        r, valid = valid_rewards(g)
        adv = adv + o.reward_weight * np.where(mask, np.asarray(baselines.grpo(r, valid))[..., None], 0.0)
    ratio = np.asarray(g.teacher_logp, np.float64) - g.token_logp
    metrics = {"teacher_log_ratio": float(ratio[mask].mean()) if mask.any() else 0.0}
    return Estimate(adv.astype(np.float32), metrics=metrics)


def opd(g: Group, o: OpdOptions, state=None) -> Estimate:
    """Per token: log π_T(y_t) − log π_old(y_t) (`esroll.grpo.distill.opd_advantage`)."""
    mask = _mask(g)
    return _with_reward(g, opd_advantage(g.token_logp, g.teacher_logp, mask), mask, o)


def gndpo(g: Group, o: GndpoOptions, state=None) -> Estimate:
    """Per token: clip(log π_T − log π_old, ±clip), whitened over the step's valid tokens
    (`esroll.grpo.distill.gndpo_advantage`)."""
    mask = _mask(g)
    X, M, N = mask.shape
    flat = gndpo_advantage(
        np.asarray(g.teacher_logp).reshape(X * M, N), np.asarray(g.token_logp).reshape(X * M, N),
        mask.reshape(X * M, N), o.clip,
    )  # fmt: skip
    return _with_reward(g, flat.reshape(X, M, N), mask, o)


def opd_plus(g: Group, o: OpdPlusOptions, state=None) -> Estimate:
    """Per token: −f'(u) (exact) or −f(u)/u (stop-gradient), log u = log π_old − log π_T
    (`esroll.grpo.distill.f_weight`)."""
    mask = _mask(g)
    log_u = np.where(mask, np.asarray(g.token_logp, np.float64) - g.teacher_logp, 0.0)
    return _with_reward(g, -f_weight(o.divergence, log_u, o.exact, o.alpha), mask, o)


def gkd(g: Group, o: GkdOptions, state=None) -> Estimate:
    """GKD's signal is a loss, not an advantage: the update adds β's generalised JSD between the teacher's and the
    student's whole next-token distributions at every trained token ("teacher_distributions",
    `esroll.grpo.distill.generalized_jsd`), weighted as the surrogate's tokens are. The advantage is
    `reward_weight` × GRPO's (0 by default: distillation alone)."""
    mask = _mask(g)
    return _with_reward(g, np.zeros(mask.shape), mask, o)


NEEDS = ("teacher", "logprobs")
register_advantage("opd", opd, options=OpdOptions, needs=NEEDS, single_rollout=True)
register_advantage("gndpo", gndpo, options=GndpoOptions, needs=NEEDS, single_rollout=True)
register_advantage("opd_plus", opd_plus, options=OpdPlusOptions, needs=NEEDS, single_rollout=True)
register_advantage("gkd", gkd, options=GkdOptions, needs=(*NEEDS, "teacher_distributions"), single_rollout=True)
