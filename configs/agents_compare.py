"""ES and turn-level policy gradient on the same agents: LOO-ROLL, GRPO, discounted per-turn returns and GiGPO on
FrozenLake or Sokoban episodes from the shipped agent model (`configs/agents.py`), with the fair-comparison protocol
of `esroll.compare` (settings chosen on validation episodes, fresh evaluation seeds, paired differences against plain
GRPO at matched training wall time). The two games (rock-paper-scissors with a frozen player, locate-and-commit)
set each game's own turn-level estimator beside GRPO, GiGPO and LOO-ROLL, from the shipped games model.

    python -m experiments.compare --config configs/agents_compare.py:frozenlake --workdir runs/agents_frozenlake
    python -m experiments.compare --config configs/agents_compare.py:sokoban --workdir runs/agents_sokoban
    python -m experiments.compare --config configs/agents_compare.py:rps --workdir runs/agents_rps
    python -m experiments.compare --config configs/agents_compare.py:locate --workdir runs/agents_locate
    python -m experiments.compare --config configs/agents_compare.py:repro --workdir runs/agents_repro

Arms (each configs/agents.py's setting; docs/agents.md):
    grpo        GRPO on the episode return, 8 episodes × 8 sampled at temperature 1, AdamW lr 1e-4
    discounted  GRPO with discounted per-turn returns normalised over the group (`grpo.advantage = "discounted"`)
    gigpo       GRPO with GiGPO's episode plus anchor-state turn advantages (`grpo.advantage = "gigpo"`)
    looroll     LOO-ROLL, population 32 on 8 shared episodes played greedily, σ 0.01, Adam lr 3e-3

Tuning (one tuning seed, 2 settings each, the arm's own and one other, scored by validation AUC): plain GRPO tunes
its learning rate (1e-4 or 3e-4); discounted and GiGPO start from GRPO's chosen setting (`tuning.inherit`) and tune
their own main option (discounted: γ 0.95 or 0.8; GiGPO: ω 1 or 0.5); LOO-ROLL tunes its learning rate (3e-3 or
1e-3). Then 5 evaluation seeds per arm on the test episodes. Held-out: 192 episodes, validation 64, test 128.

Games (variants rps and locate): GRPO, GiGPO and LOO-ROLL as above, and the game's own estimator: MemoPilot on
rps (each round against the same round of the game's other episodes; tunes std: on or off) and A2Agent on locate
(returns within shared action contexts; tunes objective: "weighted" or "advantage"), both inheriting GRPO's chosen
learning rate. 60 s per tuning run, then 3 evaluation seeds × 120 s; held-out 192 episodes, validation 64, test
128. The rps score is the share of games won (more rounds won than lost), locate's the share committed to the
right box.

Variants:
  frozenlake  FrozenLake 4 × 4 (the model solves 44% of held-out episodes greedily); 90 s per tuning run, 180 s
              per evaluation run.
  sokoban     Sokoban 6 × 6, one box (the model solves 3%); the same budgets.
  rps         rock-paper-scissors against scripted opponents: GRPO, GiGPO, MemoPilot, LOO-ROLL
  locate      locate-and-commit: GRPO, GiGPO, A2Agent, LOO-ROLL
  repro       RePro against GRPO on FrozenLake, both from the reflecting agent model (`assets/tiny-qwen3-reflect`,
              the agent model taught to rate its moves after an episode), untuned: both at lr 3e-4 (GRPO's choice in
              the frozenlake variant), 3 seeds × 120 s
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
    "rps": "GRPO, GiGPO, MemoPilot, LOO-ROLL on rock-paper-scissors: tuned (60 s runs), then 3 seeds × 120 s",
    "locate": "GRPO, GiGPO, A2Agent, LOO-ROLL on locate-and-commit: the same budgets",
    "repro": "RePro against GRPO on FrozenLake from the reflecting agent model, untuned (lr 3e-4), 3 seeds × 120 s",
    "quick": "seconds per run, for the test suite",
}
# Each arm's second tuning value (the first is the arm's own setting); tuples, so that the command line can override
# them (`--config.tuning.space.looroll.optimizer.lr='(0.003,)'`).
OWN_OPTION = {
    "grpo": {"optimizer": {"lr": (3e-4,)}},
    "discounted": {"grpo": {"adv": {"discounted": {"gamma": (0.8,)}}}},
    "gigpo": {"grpo": {"adv": {"gigpo": {"omega": (0.5,)}}}},
    "looroll": {"optimizer": {"lr": (1e-3,)}},
    "memopilot": {"grpo": {"adv": {"memopilot": {"std": (False,)}}}},
    "a2agent": {"grpo": {"adv": {"a2agent": {"objective": ("advantage",)}}}},
}
GAMES = {"rps": ("grpo", "gigpo", "memopilot", "looroll"), "locate": ("grpo", "gigpo", "a2agent", "looroll")}
REPRO_ARMS = ("grpo", "repro")
REPRO_LR = 3e-4  # GRPO's choice in the FrozenLake comparison (docs/results/agents_frozenlake/results.md)
GAME_BUDGETS = (120.0, 60.0)  # seconds of training: evaluation run, tuning run


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
    if arg in GAMES or arg == "repro":
        arms = GAMES.get(arg, REPRO_ARMS)
        inherit = {arm: "grpo" for arm in arms if arm not in ("grpo", "looroll")}
        task = "frozenlake" if arg == "repro" else arg
        space = {a: OWN_OPTION.get(a, {}) for a in arms}
        c = compare.task_protocol(task, False, arms, space, inherit, GAME_BUDGETS)
        if arg == "repro":  # every arm from the reflecting model, so that the pairs differ in the method only
            c.experiment.model.path = agents.REFLECT_MODEL
            c.tuning.seeds = ()  # untuned: both at the FrozenLake comparison's chosen GRPO learning rate
            for arm in arms:
                c.overrides[arm].optimizer.lr = REPRO_LR
        c.seeds = (0, 1, 2)
        return c
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
