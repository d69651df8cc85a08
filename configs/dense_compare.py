"""Does a dense process reward made from what a run already holds pay at matched cost? Plain GRPO, the dense-reward
methods and LOO-ROLL with and without the dense signal as its fitness, with the fair-comparison protocol of
`esroll.compare` (settings chosen on validation, fresh evaluation seeds, paired differences against plain GRPO at
matched training wall time; every judge call is charged to the budget of the arm that makes it).

    python -m experiments.compare --config configs/dense_compare.py:steps --workdir runs/dense_steps
    python -m experiments.compare --config configs/dense_compare.py:frozenlake --workdir runs/dense_frozenlake

Arms (configs/step_level.py's or configs/agents.py's setting of that name; docs/step_level.md, docs/agents.md):
    grpo           plain GRPO (AdamW, group-normalised outcome advantage)
    exprl          (steps) GRPO's update with ExpRL's DeltaNorm step credit from the reference-holding judge (no
                   outcome term)
    appo           (steps) GRPO's update with APPO's credit: branches at the tokens its Branching Score picks,
                   token advantages from the completions' and the branches' groups (every branch's decoding charged
                   to the arm)
    svm            (frozenlake) GRPO with Success Visitation Matching's dense turn rewards, credited per turn
    looroll        LOO-ROLL at the task's setting (raw outcome fitness)
    looroll_exprl  (steps) LOO-ROLL whose fitness is half the outcome, half the judge's mean prefix score
                   (`looroll,exprl_fitness`)
    looroll_svm    (frozenlake) LOO-ROLL whose episodes' returns gain the visitation discriminator's dense reward,
                   fitted per seed on the population's episodes (`frozenlake,looroll,svm_fitness`)

Tuning (one tuning seed, 2 settings each, the arm's own and one other, scored by validation AUC), as the step-level
and critic comparisons: GRPO tunes its learning rate (steps: 1e-4 or 2e-4; frozenlake: 1e-4 or 3e-4); ExpRL starts from GRPO's choice
(`tuning.inherit`) and tunes its first step's credit (the source's s_1 − s_K, or its rise s_1:
`grpo.adv.exprl.first_step`); APPO starts from GRPO's choice and tunes its branch points per completion (the
source's 3, or 1: `grpo.adv.appo.positions`); SVM starts from GRPO's choice and tunes λ (0.1 or 0.3); the ES arms
tune their learning rate (steps: 3e-4 or 6e-4; frozenlake: 3e-3 or 1e-3). Then 5 evaluation seeds per arm.

Variants:
  steps   arith_steps (3-4 operands; the shipped steps model starts at 39% on held-out): 40 s per tuning run, 75 s per
          evaluation run; held-out 384 questions (validation 128, test 256).
  frozenlake  FrozenLake 4 × 4 from the shipped agent model (44% solved greedily): 60 s per tuning run, 120 s per
          evaluation run; held-out 192 episodes (validation 64, test 128).
  quick   seconds per run, for the test suite: GRPO, ExpRL (inheriting GRPO's setting) and LOO-ROLL with the judge's
          fitness on the step task.
"""

from ml_collections import ConfigDict

from configs import compare

ARMS = {
    "steps": ("grpo", "exprl", "appo", "looroll", "looroll_exprl"),
    "frozenlake": ("grpo", "svm", "looroll", "looroll_svm"),
}
VARIANTS = {
    "steps": "GRPO, ExpRL, APPO, LOO-ROLL, LOO-ROLL with the judge's fitness on arith_steps: tuned (40 s runs), then 5 seeds "
    "× 75 s on test",
    "frozenlake": "GRPO, SVM, LOO-ROLL, LOO-ROLL with SVM's fitness on FrozenLake: tuned (60 s runs), then 5 seeds × "
    "120 s on test",
    "quick": "seconds per run, for the test suite",
}
ES_LR = {"optimizer": {"lr": (6e-4,)}}
# Each arm's second tuning value (the first is the arm's own setting).
OWN_OPTION = {
    "steps": {
        "grpo": {"optimizer": {"lr": (2e-4,)}},
        "exprl": {"grpo": {"adv": {"exprl": {"first_step": ("rise",)}}}},
        "appo": {"grpo": {"adv": {"appo": {"positions": (1,)}}}},
        "looroll": ES_LR,
        "looroll_exprl": ES_LR,
    },
    "frozenlake": {
        "grpo": {"optimizer": {"lr": (3e-4,)}},
        "svm": {"grpo": {"adv": {"svm": {"lam": (0.3,)}}}},
        "looroll": {"optimizer": {"lr": (1e-3,)}},
        "looroll_svm": {"optimizer": {"lr": (1e-3,)}},
    },
}
INHERIT = {"steps": {"exprl": "grpo", "appo": "grpo"}, "frozenlake": {"svm": "grpo"}}
BUDGETS = {"steps": (75.0, 40.0), "frozenlake": (120.0, 60.0)}  # evaluation run, tuning run: seconds of training
# an arm's configs/step_level.py or configs/agents.py variant, where not its name
SETTINGS = {"looroll_exprl": "looroll,exprl_fitness", "looroll_svm": "looroll,svm_fitness"}


def get_config(arg: str | None = None) -> ConfigDict:
    arg = arg or "steps"
    if arg not in VARIANTS:
        raise ValueError(f"configs/dense_compare.py: unknown variant {arg!r} (expected one of {', '.join(VARIANTS)})")
    quick = arg == "quick"
    task = "steps" if quick else arg
    c = compare.task_protocol(task, quick, ARMS[task], OWN_OPTION[task], INHERIT[task], BUDGETS[task], SETTINGS)
    if quick:
        compare.quick_arms(c, "grpo,exprl,looroll_exprl", eval_size=32, validation_size=16)
    return c
