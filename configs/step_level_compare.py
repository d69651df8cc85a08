"""Does step-level credit pay at matched cost? Plain GRPO, its step-level estimators, Monte Carlo step values and
LOO-ROLL with and without a dense step fitness on the step task (`configs/step_level.py`), with the fair-comparison
protocol of `esroll.compare` (settings chosen on validation, fresh evaluation seeds, paired differences against plain
GRPO at matched training wall time).

    python -m experiments.compare --config configs/step_level_compare.py[:variant] --workdir runs/step_level_compare

Arms (each configs/step_level.py's setting of that name; docs/step_level.md):
    grpo               plain GRPO, AdamW lr 1e-4, 16 prompts × 8 completions
    sas ibpo graft graft_gae progpo verigate guae
                       GRPO with that step-level estimator (`grpo.advantage`)
    mc_steps           GRPO with Monte Carlo step values from branched rollouts (their decoding is charged to its
                       budget, as is every verifier call)
    looroll            LOO-ROLL, population 32, σ 0.005, Adam lr 3e-4, outcome fitness
    looroll_dense      the same with the dense step fitness, es.step_weight = 0.5 (half outcome, half the mean of the
                       step verifier's scores)

Tuning (one tuning seed, 2 settings each, the arm's own and one other, scored by validation AUC): plain GRPO tunes its
learning rate (1e-4 or 2e-4); every other GRPO arm starts from GRPO's chosen setting (`tuning.inherit`) and tunes only
its own main option: SAS's quantiles (0.2/0.8 or 0.1/0.9), IBPO's group weight (0.5 or 1), Graph GAE's λ (0.95 or
0.5), ProGPO's transition weight (1 or 0.5), VeriGate's γ (1 or 0.9), GuAE's τ (0.05 or 0.2), mc_steps' branches
per boundary (4 or 2); GRAFT has no option and runs GRPO's choice. The ES arms tune their learning rate (3e-4 or
6e-4). Then 5 evaluation seeds per arm on the test split.

Variants:
  default   arith_steps (3-4 operands, the shipped steps model starts at 39% on held-out): 11 arms; 40 s per tuning
            run, 75 s per evaluation run, an evaluation every 5 steps (0.3 s each on 2 cores); held-out 384
            questions: validation 128, test 256. 1 h 35 min on 2 CPU cores (measured: 21 tuning runs, 55
            evaluation runs, each with about 10 s of start-up and evaluation; docs/results/step_level/results.md).
  hard      the same with 5 operands (`configs/step_level.py:grpo,hard`).
  quick     seconds per run, for the test suite: grpo, verigate (inheriting GRPO's learning rate) and looroll_dense,
            one tuning seed of 2 settings, 2 evaluation seeds.
"""

from ml_collections import ConfigDict

from configs import compare, step_level

GRPO_ARMS = ("grpo", "sas", "ibpo", "graft", "graft_gae", "progpo", "verigate", "guae", "mc_steps")
ES_ARMS = ("looroll", "looroll_dense")
ARMS = GRPO_ARMS + ES_ARMS
VARIANTS = {
    "default": "11 arms on arith_steps: tuned on validation (40 s runs), then 5 seeds × 75 s on test",
    "hard": "the same with 5 operands",
    "quick": "seconds per run, for the test suite",
}
DENSE_WEIGHT = 0.5  # es.step_weight of looroll_dense

# Each GRPO arm's main option: its second tuning value (the first is the arm's own setting).
OWN_OPTION = {
    "grpo": {"optimizer": {"lr": [2e-4]}},
    "sas": {"grpo": {"adv": {"sas": {"q_low": [0.1], "q_high": [0.9]}}}},
    "ibpo": {"grpo": {"adv": {"ibpo": {"group_weight": [1.0]}}}},
    "graft": {},  # no option of its own: GRPO's chosen setting alone
    "graft_gae": {"grpo": {"adv": {"graft_gae": {"lam": [0.5]}}}},
    "progpo": {"grpo": {"adv": {"progpo": {"transition_weight": [0.5]}}}},
    "verigate": {"grpo": {"adv": {"verigate": {"gamma": [0.9]}}}},
    "guae": {"grpo": {"adv": {"guae": {"tau": [0.2]}}}},
    "mc_steps": {"steps": {"branches": [2]}},
}
ES_LR = {"optimizer": {"lr": [6e-4]}}


def _experiments(variant: str) -> dict[str, ConfigDict]:
    """Each arm's training config from configs/step_level.py (LOO-ROLL first: the comparison's base experiment)."""
    mods = {"default": "", "hard": ",hard", "quick": ",quick"}[variant]
    out = {"looroll": step_level.get_config("looroll" + mods)}
    out["looroll_dense"] = step_level.get_config("looroll" + mods)
    out["looroll_dense"].es.step_weight = DENSE_WEIGHT
    for arm in GRPO_ARMS:
        out[arm] = step_level.get_config(arm + mods)
    return out


def get_config(arg: str | None = None) -> ConfigDict:
    arg = arg or "default"
    if arg not in VARIANTS:
        raise ValueError(
            f"configs/step_level_compare.py: unknown variant {arg!r} (expected one of {', '.join(VARIANTS)})"
        )
    experiments = _experiments(arg)
    for cd in experiments.values():
        cd.train.time_budget_s = 0.0  # set by the comparison
        cd.data.eval_size = 384
        cd.data.validation_size = 128
        if arg != "quick":
            cd.train.eval_every = 5  # 0.3 s per evaluation of 256 questions: a point every ~4 s of training
    c = compare.own_option_protocol(
        experiments,
        ARMS,
        {**OWN_OPTION, "looroll": ES_LR, "looroll_dense": ES_LR},
        {arm: "grpo" for arm in GRPO_ARMS if arm != "grpo"},
        time_budget_s=75.0,
        tuning_budget_s=40.0,
    )
    if arg == "quick":
        compare.quick_arms(c, "grpo,verigate,looroll_dense", eval_size=32, validation_size=16)
    return c
