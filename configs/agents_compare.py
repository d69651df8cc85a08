"""ES and turn-level policy gradient on the same agents: LOO-ROLL, GRPO, discounted per-turn returns and GiGPO on
FrozenLake or Sokoban episodes from the shipped agent model (`configs/agents.py`), with the fair-comparison protocol
of `esroll.compare` (settings chosen on validation episodes, fresh evaluation seeds, paired differences against plain
GRPO at matched training wall time).

    python -m experiments.compare --config configs/agents_compare.py:frozenlake --workdir runs/agents_frozenlake
    python -m experiments.compare --config configs/agents_compare.py:sokoban --workdir runs/agents_sokoban

Arms (each configs/agents.py's setting; docs/agents.md):
    grpo        GRPO on the episode return, 8 episodes × 8 sampled at temperature 1, AdamW lr 1e-4
    discounted  GRPO with discounted per-turn returns normalised over the group (`grpo.advantage = "discounted"`)
    gigpo       GRPO with GiGPO's episode plus anchor-state turn advantages (`grpo.advantage = "gigpo"`)
    looroll     LOO-ROLL, population 32 on 8 shared episodes played greedily, σ 0.01, Adam lr 3e-3

Tuning (one tuning seed, 2 settings each, the arm's own and one other, scored by validation AUC): plain GRPO tunes
its learning rate (1e-4 or 3e-4); discounted and GiGPO start from GRPO's chosen setting (`tuning.inherit`) and tune
their own main option (discounted: γ 0.95 or 0.8; GiGPO: ω 1 or 0.5); LOO-ROLL tunes its learning rate (3e-3 or
1e-3). Then 5 evaluation seeds per arm on the test episodes. Held-out: 192 episodes, validation 64, test 128.

Variants:
  frozenlake  FrozenLake 4 × 4 (the model solves 44% of held-out episodes greedily); 90 s per tuning run, 180 s
              per evaluation run.
  sokoban     Sokoban 6 × 6, one box (the model solves 3%); the same budgets.
  quick       seconds per run, for the test suite: GRPO, GiGPO (inheriting GRPO's setting) and LOO-ROLL on
              FrozenLake, each tuning run its own setting, 2 evaluation seeds.
"""

from ml_collections import ConfigDict

from configs import agents, compare

GRPO_ARMS = ("grpo", "discounted", "gigpo")
ARMS = GRPO_ARMS + ("looroll",)
VARIANTS = {
    "frozenlake": "4 arms on FrozenLake: tuned on validation (90 s runs), then 5 seeds × 180 s on test",
    "sokoban": "the same on Sokoban",
    "quick": "seconds per run, for the test suite",
}
# Each arm's second tuning value (the first is the arm's own setting); tuples, so that the command line can override
# them (`--config.tuning.space.looroll.optimizer.lr='(0.003,)'`).
OWN_OPTION = {
    "grpo": {"optimizer": {"lr": (3e-4,)}},
    "discounted": {"grpo": {"adv": {"discounted": {"gamma": (0.8,)}}}},
    "gigpo": {"grpo": {"adv": {"gigpo": {"omega": (0.5,)}}}},
    "looroll": {"optimizer": {"lr": (1e-3,)}},
}


def _experiments(env: str, quick: bool) -> dict[str, ConfigDict]:
    """Each arm's training config from configs/agents.py (LOO-ROLL first: the comparison's base experiment)."""
    mods = ",quick" if quick else ""
    out = {"looroll": agents.get_config(f"{env},looroll{mods}")}
    for arm in GRPO_ARMS:
        out[arm] = agents.get_config(f"{env},grpo{mods}")
        if arm != "grpo":
            out[arm].grpo.advantage = arm
    return out


def get_config(arg: str | None = None) -> ConfigDict:
    arg = arg or "frozenlake"
    if arg not in VARIANTS:
        raise ValueError(f"configs/agents_compare.py: unknown variant {arg!r} (expected one of {', '.join(VARIANTS)})")
    quick = arg == "quick"
    experiments = _experiments("frozenlake" if quick else arg, quick)
    for cd in experiments.values():
        cd.train.time_budget_s = 0.0  # set by the comparison
        if not quick:
            cd.data.eval_size = 192
            cd.data.validation_size = 64
    inherit = {arm: "grpo" for arm in GRPO_ARMS if arm != "grpo"}
    c = compare.own_option_protocol(experiments, ARMS, OWN_OPTION, inherit, time_budget_s=180.0, tuning_budget_s=90.0)
    if quick:
        c.tuning.runs = 1
        compare.quick_arms(c, "grpo,gigpo,looroll", eval_size=8, validation_size=4)
    return c
