"""Learning from a teacher at matched cost: plain GRPO, the on-policy distillation methods (docs/distillation.md) and
LOO-ROLL with and without the teacher's fitness, on the step task, with the fair-comparison protocol of
`esroll.compare` (settings chosen on validation, fresh evaluation seeds, paired differences against plain GRPO at
matched training wall time; the teacher's forward is charged to each arm that reads it, and counted in its FLOPs).

    python -m experiments.compare --config configs/distill_compare.py:steps --workdir runs/distill_steps

Arms (configs/step_level.py and configs/distill.py, the setting of that name; the teacher is
`assets/tiny-qwen3-steps-teacher`, 81% greedy against the student's 39%):
    grpo             plain GRPO (AdamW, clipped surrogate, group-normalised outcome advantage)
    opd              GRPO's sampling and update with the per-token advantage log π_T − log π_old
    gkd              the generalised JSD (β 0.5) to the teacher's whole distribution as the loss, half the steps on
                     the student's samples and half on the data's worked solutions
    gndpo            the clipped teacher log-ratio whitened over the step's tokens
    opd_plus_js      OPD+ with the Jensen–Shannon f and its exact weight
    looroll          LOO-ROLL at the step task's setting, the verifier's reward as fitness
    looroll_teacher  LOO-ROLL whose fitness is the mean teacher log-ratio of each member's own samples

Tuning (one tuning seed, 40-s runs, scored by validation AUC): GRPO and LOO-ROLL tune their learning rates (their own
and one other); each distillation arm starts from GRPO's chosen setting, and LOO-ROLL with the teacher from
LOO-ROLL's (`tuning.inherit`), with no option of its own. Then 5 evaluation seeds of 75 s per arm.

Variants:
  steps   arith_steps (3-4 operands), held-out 384 questions (validation 128, test 256).
  quick   seconds per run, for the test suite: GRPO, OPD and LOO-ROLL with the teacher.
"""

from ml_collections import ConfigDict

from configs import compare, distill, step_level

GRPO_ARMS = ("grpo", "opd", "gkd", "gndpo", "opd_plus_js")
ES_ARMS = ("looroll", "looroll_teacher")
ARMS = GRPO_ARMS + ES_ARMS
VARIANTS = {
    "steps": "7 arms on arith_steps: tuned on validation (40 s runs), then 5 seeds × 75 s on test",
    "quick": "seconds per run, for the test suite",
}
OWN_OPTION = {"grpo": {"optimizer": {"lr": (2e-4,)}}, "looroll": {"optimizer": {"lr": (6e-4,)}}}
INHERIT = {**{arm: "grpo" for arm in GRPO_ARMS[1:]}, "looroll_teacher": "looroll"}
BUDGETS = (75.0, 40.0)  # evaluation run, tuning run: seconds of training


def _experiments(quick: bool) -> dict[str, ConfigDict]:
    """Each arm's training config (LOO-ROLL first: the comparison's base experiment)."""
    mods = ",quick" if quick else ""
    out = {"looroll": step_level.get_config("looroll" + mods), "grpo": step_level.get_config("grpo" + mods)}
    for arm in ("opd", "gkd", "gndpo", "looroll_teacher"):
        out[arm] = distill.get_config(arm + mods)
    out["opd_plus_js"] = distill.get_config("opd_plus" + mods)
    out["opd_plus_js"].grpo.adv = {"opd_plus": {"divergence": "js"}}
    return out


def get_config(arg: str | None = None) -> ConfigDict:
    arg = arg or "steps"
    if arg not in VARIANTS:
        raise ValueError(f"configs/distill_compare.py: unknown variant {arg!r} (expected one of {', '.join(VARIANTS)})")
    quick = arg == "quick"
    experiments = _experiments(quick)
    for cd in experiments.values():
        cd.train.time_budget_s = 0.0  # set by the comparison
        cd.data.eval_size = 384
        cd.data.validation_size = 128
        if not quick:
            cd.train.eval_every = 5
    time_budget_s, tuning_budget_s = BUDGETS
    c = compare.own_option_protocol(
        experiments,
        ARMS,
        {arm: OWN_OPTION.get(arm, {}) for arm in ARMS},
        INHERIT,
        time_budget_s=time_budget_s,
        tuning_budget_s=tuning_budget_s,
    )
    if quick:
        compare.quick_arms(c, "grpo,opd,looroll_teacher", eval_size=32, validation_size=16)
    return c
