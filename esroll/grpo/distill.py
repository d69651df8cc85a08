"""The token-level signals of learning from a teacher (on-policy distillation), as pure functions of log-probabilities.

- `opd_advantage`: each sampled token's advantage −(log π_S − log π_T), the per-token reverse KL's negative (the
  on-policy distillation recipe: minimise KL(π_S‖π_T) on the student's own samples).
- `gndpo_advantage`: GNDPO's clip(log π_T − log π_old, ±c) whitened over every valid token of the batch.
- `generalized_jsd`: GKD's generalised Jensen–Shannon divergence between the teacher's and the student's whole
  next-token distributions (a loss over the vocabulary, differentiated through the student's logits, not an
  advantage; it lives in `esroll.scoring`, which computes it chunk by chunk beside the head's logits).
- `f_weight`: OPD+'s per-sample weight for an f-divergence D_f(π_θ‖π_T) = Σ_y π_T(y)·f(u(y)) = E_{π_θ}[f(u)/u], with
  u = π_θ/π_T. Its exact gradient is E_{π_θ}[f'(u)·∇ log π_θ] (differentiate Σ π_T f(π_θ/π_T): π_T·f'(u)·∇π_θ/π_T =
  π_θ·f'(u)·∇ log π_θ), so the exact score-function weight is f'(u). The usual stop-gradient weight treats the
  integrand f(u)/u as a fixed reward; it misses the integrand's own dependence on θ and is biased for every f but
  reverse KL, where f(u) = u·log u gives f'(u) = log u + 1 against f(u)/u = log u: a constant apart, and a constant
  weight's expected score is 0. docs/distillation.md works these by hand.

The divergences (f convex, f(1) = 0): "reverse_kl" KL(π_θ‖π_T), f(u) = u·log u; "forward_kl" KL(π_T‖π_θ), f(u) =
−log u; "js" Jensen–Shannon, f(u) = ½[u·log u − (u + 1)·log((u + 1)/2)]; "alpha" Amari's α-divergence,
f(u) = (u^α − 1 − α(u − 1)) / (α(α − 1)), α ∉ {0, 1}.
"""

from __future__ import annotations

import numpy as np

from esroll.grpo.gae import whiten
from esroll.scoring import generalized_jsd  # GKD's divergence: computed where the head's logits are

__all__ = [
    "DIVERGENCES", "GNDPO_CLIP", "f_derivative", "f_value", "f_weight", "generalized_jsd", "gndpo_advantage",
    "opd_advantage",
]  # fmt: skip

DIVERGENCES = ("reverse_kl", "forward_kl", "js", "alpha")
GNDPO_CLIP = 5.0


def opd_advantage(logp_student_BxN: np.ndarray, logp_teacher_BxN: np.ndarray, mask_BxN: np.ndarray) -> np.ndarray:
    """[B, N]: log π_T − log π_S of each sampled token on the mask, 0 elsewhere."""
    return np.where(mask_BxN, np.asarray(logp_teacher_BxN, np.float64) - logp_student_BxN, 0.0)


def gndpo_advantage(
    logp_teacher_BxN: np.ndarray, logp_old_BxN: np.ndarray, mask_BxN: np.ndarray, clip: float = GNDPO_CLIP
) -> np.ndarray:
    """[B, N]: clip(log π_T − log π_old, −clip, clip), whitened over the valid tokens of the whole batch
    (`esroll.grpo.gae.whiten`: mean and Bessel-corrected variance), 0 elsewhere. Shifting every teacher
    log-probability by one constant changes nothing while no ratio reaches the clip."""
    ratio = np.clip(np.asarray(logp_teacher_BxN, np.float64) - logp_old_BxN, -clip, clip)
    return whiten(ratio, mask_BxN)


def f_value(name: str, u: np.ndarray, alpha: float = 0.5) -> np.ndarray:
    """f(u) of divergence `name` (u = π_θ/π_T > 0)."""
    u = np.asarray(u, np.float64)
    if name == "reverse_kl":
        return u * np.log(u)
    if name == "forward_kl":
        return -np.log(u)
    if name == "js":
        return 0.5 * (u * np.log(u) - (u + 1) * np.log((u + 1) / 2))
    if name == "alpha":
        return (u**alpha - 1 - alpha * (u - 1)) / (alpha * (alpha - 1))
    raise ValueError(f"f-divergence {name!r} (expected one of {', '.join(DIVERGENCES)})")


def f_derivative(name: str, u: np.ndarray, alpha: float = 0.5) -> np.ndarray:
    """f'(u) of divergence `name`."""
    u = np.asarray(u, np.float64)
    if name == "reverse_kl":
        return np.log(u) + 1
    if name == "forward_kl":
        return -1 / u
    if name == "js":
        return 0.5 * np.log(2 * u / (u + 1))
    if name == "alpha":
        return (u ** (alpha - 1) - 1) / (alpha - 1)
    raise ValueError(f"f-divergence {name!r} (expected one of {', '.join(DIVERGENCES)})")


def f_weight(name: str, log_u: np.ndarray, exact: bool = True, alpha: float = 0.5) -> np.ndarray:
    """The score-function weight of a sample with log u = log π_θ − log π_T: f'(u) (`exact`, unbiased) or the
    stop-gradient f(u)/u. E_{π_θ}[weight·∇ log π_θ] is then ∇ D_f (exact) or a biased estimate of it; as an
    advantage to maximise, negate it."""
    u = np.exp(np.asarray(log_u, np.float64))
    if alpha in (0.0, 1.0) and name == "alpha":
        raise ValueError("f_weight: alpha must not be 0 or 1 (those are the two KLs)")
    return f_derivative(name, u, alpha) if exact else f_value(name, u, alpha) / u
