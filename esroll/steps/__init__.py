"""Reasoning steps of completions (docs/step_level.md): where each step ends, how each is scored, and rollouts
branched from the end of each.

    segment  `segment`: completions cut into steps, in characters and whole tokens (`Steps`), the one segmentation
             every step-level method reads
    verify   step verifiers (`STEP_VERIFIERS`, `register_verifier`; the built-in `equations`)
    judge    prefix judges holding the reference solution (ExpRL): `judge_verifier`, the rule-based `exprl`
    branch   `with_steps`: a rollout's completions cut and scored; `branch`: continuations from the end of each step;
             `branch_at`: from chosen token positions (APPO's)

Nothing here imports a training method: the step-level estimators live with the method that uses them
(`esroll.grpo.estimators`), and credit accuracy with them (`esroll.grpo.credit`).
"""

from esroll.steps.branch import branch, branch_at, with_steps
from esroll.steps.segment import Steps, segment, split_text
from esroll.steps.verify import STEP_VERIFIERS, equations, register_verifier
from esroll.steps.judge import judge_verifier, read_judgement, reference_progress  # noqa: E402 — registers `exprl`

__all__ = [
    "STEP_VERIFIERS",
    "Steps",
    "branch",
    "branch_at",
    "equations",
    "judge_verifier",
    "read_judgement",
    "reference_progress",
    "register_verifier",
    "segment",
    "split_text",
    "with_steps",
]
