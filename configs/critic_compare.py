"""Does a learned critic pay at matched cost? Plain GRPO, PPO (GRPO's sampling and clipped update with GAE from a
learned critic, docs/critics.md), the critic-based credit methods and LOO-ROLL on the step task or on FrozenLake,
with the fair-comparison protocol of `esroll.compare` (settings chosen on validation, fresh evaluation seeds, paired
differences against plain GRPO at matched training wall time; the critic's forward and update are charged to the
budget of the arm that keeps one).

    python -m experiments.compare --config configs/critic_compare.py:steps --workdir runs/critic_steps
    python -m experiments.compare --config configs/critic_compare.py:frozenlake --workdir runs/critic_frozenlake

Arms (configs/step_level.py or configs/agents.py, the setting of that name):
    grpo      plain GRPO (AdamW, clipped surrogate, group-normalised outcome advantage)
    ppo       the same sampling and update with `grpo.advantage = "gae"`: a critic initialised from the policy, GAE
              over the generated tokens (γ 1), whitened; its own Adam (lr 1e-4) and clipped value loss (ε 0.2)
    srppo     (steps) SR-PPO: one completion per prompt, credit from a success head's pass@4
    hygae     (frozenlake) HyGAE: turn-level and token-level GAE mixed (α 0.5, γ 0.99, λ 1)
    dae       (frozenlake) DAE: a learned advantage model over the four moves (γ 0.99)
    looroll   LOO-ROLL at the task's setting

Tuning (one tuning seed, 2 settings each, the arm's own and one other, scored by validation AUC), as the step-level
and agent comparisons: GRPO tunes its learning rate; each critic arm starts from GRPO's chosen setting
(`tuning.inherit`) and tunes its own main option, the critic's learning rate (its own 1e-4, or 1e-3: at 1e-4 the
value before the first token took about 40 steps to reach the mean reward on the step task, at 1e-3 about 10);
LOO-ROLL tunes its learning rate. Then 5 evaluation seeds per arm.

Variants:
  steps       arith_steps (3-4 operands; the shipped steps model starts at 39% on held-out), the step-level
              comparison's budgets: 40 s per tuning run, 75 s per evaluation run; held-out 384 questions (validation
              128, test 256).
  frozenlake  FrozenLake 4 × 4 from the shipped agent model (44% solved greedily): 60 s per tuning run, 120 s per
              evaluation run; held-out 192 episodes (validation 64, test 128).
  quick       seconds per run, for the test suite: GRPO and PPO (inheriting GRPO's setting) on the step task.
"""

from ml_collections import ConfigDict

from configs import compare

ARMS = {"steps": ("grpo", "ppo", "srppo", "looroll"), "frozenlake": ("grpo", "ppo", "hygae", "dae", "looroll")}
VARIANTS = {
    "steps": "GRPO, PPO, SR-PPO, LOO-ROLL on arith_steps: tuned on validation (40 s runs), then 5 seeds × 75 s on test",
    "frozenlake": "GRPO, PPO, HyGAE, DAE, LOO-ROLL on FrozenLake: tuned (60 s runs), then 5 seeds × 120 s on test",
    "quick": "seconds per run, for the test suite",
}
PPO_LR = {"grpo": {"adv": {"gae": {"critic_lr": (1e-3,)}}}}
CRITIC_LR = {name: {"grpo": {"adv": {name: {"critic_lr": (1e-3,)}}}} for name in ("srppo", "hygae", "dae")}
# Each arm's second tuning value (the first is the arm's own setting), as the step-level and agent comparisons.
OWN_OPTION = {
    "steps": {
        "grpo": {"optimizer": {"lr": (2e-4,)}},
        "ppo": PPO_LR,
        "srppo": CRITIC_LR["srppo"],
        "looroll": {"optimizer": {"lr": (6e-4,)}},
    },
    "frozenlake": {
        "grpo": {"optimizer": {"lr": (3e-4,)}},
        "ppo": PPO_LR,
        "hygae": CRITIC_LR["hygae"],
        "dae": CRITIC_LR["dae"],
        "looroll": {"optimizer": {"lr": (1e-3,)}},
    },
}
BUDGETS = {"steps": (75.0, 40.0), "frozenlake": (120.0, 60.0)}  # evaluation run, tuning run: seconds of training


def get_config(arg: str | None = None) -> ConfigDict:
    arg = arg or "steps"
    if arg not in VARIANTS:
        raise ValueError(f"configs/critic_compare.py: unknown variant {arg!r} (expected one of {', '.join(VARIANTS)})")
    quick = arg == "quick"
    task = "steps" if quick else arg
    inherit = {arm: "grpo" for arm in ARMS[task] if arm not in ("grpo", "looroll")}
    c = compare.task_protocol(task, quick, ARMS[task], OWN_OPTION[task], inherit, BUDGETS[task])
    if quick:
        compare.quick_arms(c, "grpo,ppo", eval_size=32, validation_size=16)
    return c
