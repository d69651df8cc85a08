"""GRPO and LOO-ROLL on worked arithmetic (`arith_steps`): the task whose completions have steps to credit, from the
shipped model that writes them (`assets/tiny-qwen3-steps`, docs/step_level.md).

    python -m experiments.train --config configs/step_level.py:grpo --workdir runs/step_grpo
    python -m experiments.train --config configs/step_level.py:looroll,hard --workdir runs/step_looroll_hard

The variant is comma-separated: one method name, then modifiers.
    grpo        GRPO (group-normalised advantages), 16 prompts × 8 completions, AdamW lr 1e-4 clipped at norm 1
    looroll     LOO-ROLL, population 32 on 16 shared prompts, σ = 0.005, raw fitness, Adam lr 3e-4
    mc_steps    GRPO with Monte Carlo step values (`grpo.advantage = "mc_steps"`, docs/step_level.md)
    sas         GRPO with SAS's step-level advantage selection (`grpo.advantage = "sas"`)
    verigate    GRPO gated to the step verifier's returns where a group's outcomes are all equal ("verigate")
    guae        GRPO with GuAE's anchor-tempered group advantages ("guae")
    ibpo        GRPO with IBPO's counterfactual-sibling step advantages ("ibpo")
    graft       GRPO with GRAFT's step credit on the group's graph of states ("graft"; graft_gae: Graph GAE on it)
    progpo      GRPO with ProGPO's exact-prefix comparison and transition credit ("progpo")
    exprl       GRPO's update with ExpRL's DeltaNorm step credit from the reference-holding judge ("exprl", its
                prefix scores as steps.verifier "exprl"; docs/step_level.md)
    appo        GRPO's update with APPO's credit: 3 branches per completion at the tokens its Branching Score picks,
                token advantages from the completions' and the branches' groups ("appo"; docs/step_level.md)
    ppo         PPO: GAE over the generated tokens from a learned critic ("gae", docs/critics.md)
    srppo       SR-PPO: one completion per prompt (128 prompts a step), token credit from a learned success head's
                pass@4 ("srppo"; it collapses on this task: docs/critics.md)
    NAME        GRPO with any other registered advantage estimator (`grpo.advantage = NAME`; docs/extending.md)
    quick       a seconds-long smoke run (tests)
    hard        5 operands to train and evaluate on, instead of 3 or 4
    exprl_fitness  (LOO-ROLL) a dense fitness: half the outcome, half the mean of the ExpRL judge's prefix scores
                (es.step_weight 0.5, steps.verifier "exprl")
Hardware: 2 CPU cores; each full run trains for 10 minutes of wall time (`train.time_budget_s`), evaluation excluded.
The measured gains over 3 seeds are in docs/results/step_level.md. Every other key starts at its default
(`esroll.experiment.default_config`).
"""

from esroll.experiment import default_config
from esroll.grpo.advantages import ESTIMATORS

METHOD_PARTS = {
    "grpo": "GRPO with group-normalised advantages",
    "looroll": "LOO-ROLL",
    "mc_steps": "GRPO with Monte Carlo step values (VinePPO)",
    "sas": "GRPO with SAS's step-level advantage selection",
    "verigate": "GRPO with VeriGate's verifier-gated step advantages",
    "guae": "GRPO with GuAE's anchor-tempered group advantages",
    "ibpo": "GRPO with IBPO's counterfactual-sibling step advantages",
    "graft": "GRPO with GRAFT's step credit on the group's state graph",
    "graft_gae": "GRPO with Graph GAE on GRAFT's state graph",
    "progpo": "GRPO with ProGPO's exact-prefix comparison and transition credit",
    "exprl": "GRPO's update with ExpRL's DeltaNorm credit from the reference-holding judge (grpo.advantage = 'exprl')",
    "appo": "GRPO's update with APPO's branching at Branching-Score tokens and two-group credit (grpo.advantage = 'appo')",
    "ppo": "PPO: GAE from a learned critic (grpo.advantage = 'gae'), GRPO's sampling and clipped update",
    "srppo": "SR-PPO: one completion per prompt, credit from a learned success head (grpo.advantage = 'srppo')",
}
ESTIMATOR_VARIANTS = tuple(m for m in METHOD_PARTS if m not in ("grpo", "looroll", "ppo"))  # grpo.advantage = m
SINGLE_ROLLOUT = ("srppo",)  # one completion per prompt, the step's rows as GRPO's: 128 prompts
MODIFIERS = {
    "quick": "a seconds-long smoke run (tests)",
    "hard": "5 operands instead of 3 or 4",
    "exprl_fitness": "(LOO-ROLL) the dense fitness: half outcome, half the ExpRL judge's mean prefix score",
}
JUDGE_WEIGHT = 0.5  # es.step_weight of exprl_fitness
VARIANTS = {
    **{f"{name} (method)": what for name, what in METHOD_PARTS.items()},
    "NAME (method)": "GRPO with any other registered advantage estimator (grpo.advantage = NAME)",
    **{f"{name} (modifier)": what for name, what in MODIFIERS.items()},
}
VARIANT_FORM = "one method, then modifiers, joined by commas (e.g. mc_steps,quick)"


def get_config(arg: str | None = None):
    parts = [p.strip() for p in (arg or "grpo").split(",") if p.strip()]
    methods = [p for p in parts if p in METHOD_PARTS or (p in ESTIMATORS and p not in MODIFIERS)]
    unknown = [p for p in parts if p not in methods and p not in MODIFIERS]
    if unknown or len(methods) != 1 or len(set(parts)) != len(parts):
        raise ValueError(
            f"configs/step_level.py: variant {arg!r} must name one method ({', '.join(METHOD_PARTS)}, or any "
            f"registered advantage estimator) and optionally modifiers ({', '.join(MODIFIERS)}), comma-separated, "
            "each once"
        )
    (method,) = methods
    c = default_config()
    c.model.path = "assets/tiny-qwen3-steps"
    c.data.task = "arith_steps"
    c.train.max_new_tokens = 48  # the longest 4-operand solution is 40 tokens
    c.train.prompts_per_step = 16
    c.train.time_budget_s = 600.0
    c.train.steps = 10_000  # the time budget ends the run
    c.train.eval_every = 20
    c.train.checkpoint_every = 20
    if method == "looroll":
        c.method = "looroll"
        c.es.population = 32
        c.es.sigma = 0.005
        c.es.shaping = "raw"
        c.optimizer.lr = 3e-4  # 1e-3 fell from 0.39 to 0.34 in 140 steps
    else:
        c.method = "grpo"
        c.grpo.group_size = 8
        c.optimizer.name = "adamw"
        c.optimizer.lr = 1e-4  # 2e-4 fell from 0.39 to 0.18 by step 100 before recovering
        c.optimizer.max_grad_norm = 1.0
        if method == "ppo":
            c.grpo.advantage = "gae"
        elif method != "grpo":
            c.grpo.advantage = method  # a built-in step estimator (ESTIMATOR_VARIANTS) or a registered one
        if method == "exprl":
            c.steps.verifier = "exprl"  # the judge's prefix scores are DeltaNorm's step scores
    if "exprl_fitness" in parts:
        if method != "looroll":
            raise ValueError(f"configs/step_level.py: variant {arg!r}: exprl_fitness is a fitness of looroll")
        c.es.step_weight = JUDGE_WEIGHT
        c.steps.verifier = "exprl"
    if "hard" in parts:
        c.data.options.arith_steps.update(min_operands=5, max_operands=5)
        c.train.max_new_tokens = 64
    if "quick" in parts:
        c.data.n_examples = 2000
        c.data.eval_size = 16
        c.train.time_budget_s = 0.0
        c.train.steps = 2
        c.train.prompts_per_step = 4
        c.train.eval_every = 2
        c.train.checkpoint_every = 2
        c.train.max_new_tokens = 40 if "hard" not in parts else 56
        c.es.population = 4
        c.grpo.group_size = 4
    if method in SINGLE_ROLLOUT:
        c.train.prompts_per_step *= c.grpo.group_size
        c.grpo.group_size = 1
    return c
