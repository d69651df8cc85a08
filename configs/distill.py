"""On-policy distillation on the step task: the shipped steps model (`assets/tiny-qwen3-steps`, 39% held-out) learns
from its teacher (`assets/tiny-qwen3-steps-teacher`, 81% greedy, the same tokenizer) by GRPO's sampling and clipped
update with a per-token advantage from the teacher's log-probabilities of the student's own samples
(docs/distillation.md).

    python -m experiments.train --config configs/distill.py:opd --workdir runs/distill_opd
    python -m experiments.train --config configs/distill.py:quick,gndpo --workdir runs/distill_quick   # seconds

The variant is comma-separated: one method, then modifiers (`quick` first or last).
    opd       −(log π_old − log π_T) per token (`grpo.advantage = "opd"`)
    gndpo     GNDPO: the clipped teacher log-ratio whitened over the step's tokens ("gndpo")
    opd_plus  OPD+: the exact f-divergence weight, reverse KL unless `grpo.adv.opd_plus.divergence` says otherwise
              ("opd_plus")
    gkd       GKD: the generalised JSD (β 0.5) to the teacher's whole next-token distribution at every token, half
              the steps on the student's samples and half on the data's worked solutions ("gkd")
    looroll_teacher  LOO-ROLL whose fitness is the teacher's: each row's mean log π_T − log π_i over its tokens
                     (`es.teacher_weight` 1; `es.teacher_fitness`); the verifier's reward is mixed in below 1
    eggroll_teacher  the same with EGGROLL's antithetic pairs
    quick     a seconds-long smoke run (tests)
Each GRPO-side run is `configs/step_level.py:grpo` with the estimator swapped and `teacher.path` set: 16 prompts × 8
completions at temperature 1, AdamW lr 1e-4, 10 minutes of wall time on 2 CPU cores, no verifier reward in the
advantage (`grpo.adv.<name>.reward_weight` mixes GRPO's in). Each ES run is `configs/step_level.py:looroll`
(population 32 on 16 prompts, σ 0.005, Adam lr 3e-4) with the teacher as its whole fitness.
"""

from configs import step_level

METHODS = {
    "opd": "on-policy distillation: the per-token teacher log-ratio",
    "gndpo": "GNDPO: the clipped teacher log-ratio whitened over the batch's tokens",
    "opd_plus": "OPD+: the exact score-function weight of an f-divergence to the teacher",
    "gkd": "GKD: the generalised JSD to the teacher's whole next-token distributions, as a loss",
    "looroll_teacher": "LOO-ROLL with the teacher's fitness (es.teacher_weight = 1)",
    "eggroll_teacher": "EGGROLL with the teacher's fitness (es.teacher_weight = 1)",
}
ES_TEACHER = {"looroll_teacher": "looroll", "eggroll_teacher": "eggroll"}  # the ES methods with the teacher fitness
MODIFIERS = {"quick": "a seconds-long smoke run (tests)"}
VARIANTS = {
    **{f"{name} (method)": what for name, what in METHODS.items()},
    **{f"{name} (modifier)": what for name, what in MODIFIERS.items()},
}
VARIANT_FORM = "one method, then modifiers, joined by commas (e.g. quick,opd)"
TEACHER = "assets/tiny-qwen3-steps-teacher"


def get_config(arg: str | None = None):
    parts = [p.strip() for p in (arg or "opd").split(",") if p.strip()]
    methods = [p for p in parts if p in METHODS]
    if len(methods) != 1 or any(p not in METHODS and p not in MODIFIERS for p in parts) or len(set(parts)) < len(parts):
        raise ValueError(
            f"configs/distill.py: variant {arg!r} must name one method ({', '.join(METHODS)}) and optionally "
            f"{', '.join(MODIFIERS)}"
        )
    (method,) = methods
    modifiers = [p for p in parts if p in MODIFIERS]
    c = step_level.get_config(",".join(["looroll" if method in ES_TEACHER else method, *modifiers]))
    if method in ES_TEACHER:
        c.method = ES_TEACHER[method]
        c.es.teacher_weight = 1.0
    c.teacher.path = TEACHER
    return c
