"""Multi-turn agents: ES and GRPO on FrozenLake and Sokoban episodes, from the shipped agent model
(`assets/tiny-qwen3-agent`), and on the two games, rock-paper-scissors with a frozen player and locate-and-commit,
from the shipped games model (`assets/tiny-qwen3-games`; docs/agents.md).

    python -m experiments.train --config configs/agents.py:frozenlake --workdir runs/agents_frozenlake
    python -m experiments.train --config configs/agents.py:sokoban,grpo --workdir runs/agents_sokoban_grpo
    python -m experiments.train --config configs/agents.py:quick --workdir runs/agents_quick

The variant is comma-separated, each part at most once: an environment, a method and modifiers.
    frozenlake  FrozenLake 4 × 4, at most 8 turns (the default)
    sokoban     Sokoban 6 × 6 with one box, at most 10 turns
    rps         rock-paper-scissors, 6 rounds against a seeded scripted opponent; the agent writes a one-line memory
                each round and a frozen player plays what beats the move it predicts (the games model)
    locate      locate-and-commit: 4 boxes, at most 4 turns of `look N` / `answer N` (the games model)
    NAME        any other registered environment (`esroll.agents.register_env`, docs/extending.md), e.g. one a config
                file of yours imports before it offers this one
    looroll     LOO-ROLL (the default): population 32 on 8 shared episodes, greedy, σ = 0.01, raw fitness, Adam lr 3e-3
    eggroll     antithetic EGGROLL, otherwise as looroll
    grpo        GRPO: 8 episodes × 8 sampled at temperature 1, AdamW clipped at norm 1
    discounted  GRPO with discounted per-turn returns normalised over the group (γ 0.95)
    gigpo       GiGPO: GRPO with the episode's group advantage plus anchor-state turn advantages (ω 1, γ 0.95)
    ppo         PPO: as grpo, with GAE over the actions from a learned critic (docs/critics.md)
    hygae       HyGAE: as ppo, with turn-level and token-level GAE mixed (α 0.5, γ 0.99, λ 1; docs/critics.md)
    dae         DAE: as ppo, with a learned advantage model over the environment's actions (γ 0.99; docs/critics.md)
    svm         Success Visitation Matching: as grpo, each turn's reward plus λ·clip(logit) of a discriminator of
                successful against failed episodes' state-actions, credited per turn (λ 0.1, β 2, γ 0.95; agents.md)
    memopilot   MemoPilot: as grpo, each round's reward against the same round of the game's other episodes
    a2agent     A2Agent: as grpo, turn returns compared within groups sharing the last k actions and the episode's,
                trained by advantage-weighted reinforcement of each action (docs/agents.md)
    quick       a seconds-long smoke run (tests)
    svm_fitness (LOO-ROLL, EGGROLL) each episode's fitness gains λ·Σ_t clip(logit) of the same discriminator, fitted
                on the population's episodes of each seed (es.svm_weight 0.1)
A row is one episode: its reward is the episode's return (ES: a member's fitness is the mean return of its episodes;
GRPO: the return's group advantage on every action token, none on the environment's). Held-out "accuracy" is the
share of 128 held-out episodes solved, played greedily. Hardware: 2 CPU cores; a full run trains for 10 minutes of
wall time (`train.time_budget_s`), evaluation excluded. Every other key starts at its default
(`esroll.experiment.default_config`).
"""

from esroll.agents import ENVIRONMENTS
from esroll.agents.reflect import HEADER_TOKENS, reflection_room
from esroll.experiment import default_config

ENVS = {
    "frozenlake": "FrozenLake 4 × 4, 8 turns",
    "sokoban": "Sokoban 6 × 6, one box, 10 turns",
    "rps": "rock-paper-scissors with a frozen player, 6 rounds",
    "locate": "locate-and-commit, 4 boxes, 4 turns",
}
REFLECT_MODEL = "assets/tiny-qwen3-reflect"  # the agent model taught the reflection's format (`repro`)
GAMES_MODEL = {"rps", "locate"}  # played by assets/tiny-qwen3-games; the others by assets/tiny-qwen3-agent
METHOD_PARTS = {
    "looroll": "LOO-ROLL",
    "eggroll": "antithetic EGGROLL",
    "grpo": "GRPO on the episode return",
    "discounted": "GRPO with discounted per-turn returns (grpo.advantage = 'discounted')",
    "gigpo": "GiGPO: episode plus anchor-state turn advantages (grpo.advantage = 'gigpo')",
    "ppo": "PPO: GAE over the actions from a learned critic (grpo.advantage = 'gae')",
    "hygae": "HyGAE: turn-level and token-level GAE mixed, one critic (grpo.advantage = 'hygae')",
    "dae": "DAE: a learned advantage model over the environment's actions (grpo.advantage = 'dae')",
    "svm": "Success Visitation Matching: turn rewards densified by a discriminator (grpo.advantage = 'svm')",
    "memopilot": "MemoPilot: each round's reward against the same round's (grpo.advantage = 'memopilot')",
    "a2agent": "A2Agent: turn returns within shared action contexts, weighted (grpo.advantage = 'a2agent')",
    "repro": "RePro: the model rates its moves after each episode; ratings as turn credit (grpo.advantage = 'repro')",
}
# GRPO's sampling and update with another advantage estimator
ESTIMATOR_METHODS = {
    "discounted": "discounted",
    "gigpo": "gigpo",
    "ppo": "gae",
    "hygae": "hygae",
    "dae": "dae",
    "svm": "svm",
    "memopilot": "memopilot",
    "a2agent": "a2agent",
    "repro": "repro",
}
MODIFIERS = {
    "quick": "a seconds-long smoke run (tests)",
    "svm_fitness": "(ES) each episode's fitness gains Success Visitation Matching's dense reward (es.svm_weight 0.1)",
}
SVM_WEIGHT = 0.1  # es.svm_weight of svm_fitness: λ, as grpo.adv.svm.lam
VARIANTS = {
    **{f"{name} (environment)": what for name, what in ENVS.items()},
    "NAME (environment)": "any other registered environment (docs/extending.md)",
    **{f"{name} (method)": what for name, what in METHOD_PARTS.items()},
    **{f"{name} (modifier)": what for name, what in MODIFIERS.items()},
}
VARIANT_FORM = (
    "parts joined by commas, each at most once: an environment, a method, modifiers (e.g. sokoban,grpo,quick)"
)
# The room an episode takes in the model's context: per turn an action of at most 4 tokens (the end token included)
# and an answer of at most 24, the room the agent model was built with (`experiments.pretrain_agent`: its tokenizer
# writes each answer of its 8,000 training episodes in at most 16 tokens; a longer one is refused, naming the key).
ACTION_TOKENS, OBSERVATION_TOKENS = 4, 24


def get_config(arg: str | None = None):
    parts = [p.strip() for p in (arg or "frozenlake").split(",") if p.strip()]
    unknown = [p for p in parts if p not in ENVIRONMENTS and p not in METHOD_PARTS and p not in MODIFIERS]
    envs, methods = [p for p in parts if p in ENVIRONMENTS], [p for p in parts if p in METHOD_PARTS]
    if unknown or len(envs) > 1 or len(methods) > 1 or len(set(parts)) != len(parts):
        raise ValueError(
            f"configs/agents.py: variant {arg!r} must name at most one environment ({', '.join(ENVIRONMENTS)}), at "
            f"most one method ({', '.join(METHOD_PARTS)}) and modifiers ({', '.join(MODIFIERS)}), comma-separated, "
            "each once"
        )
    env = envs[0] if envs else "frozenlake"
    method = methods[0] if methods else "looroll"
    c = default_config()
    c.model.path = "assets/tiny-qwen3-games" if env in GAMES_MODEL else "assets/tiny-qwen3-agent"
    if method == "repro":
        if env in GAMES_MODEL:
            raise ValueError(f"configs/agents.py: variant {arg!r}: repro plays the reflecting agent model, which knows "
                             "FrozenLake and Sokoban (the games' progress has no planner to rate it by)")  # fmt: skip
        c.model.path = REFLECT_MODEL
    c.env.name = env
    c.env.max_action_tokens = ACTION_TOKENS
    c.env.max_observation_tokens = OBSERVATION_TOKENS
    # The room of the longest episode, a reference: `--config.env.options.<env>.max_turns=…` (or a new token room)
    # on the command line resizes it; setting train.max_new_tokens itself replaces it.
    room = c.env.get_ref("max_action_tokens") + c.env.get_ref("max_observation_tokens")
    c.train.max_new_tokens = c.env.options[env].get_ref("max_turns") * room
    if method == "repro":  # the reflection's header (the final observation and the outcome) and its ratings
        c.env.reflect_tokens = reflection_room(c.env.options[env].get_ref("max_turns"))
        reflection = c.env.get_ref("max_observation_tokens") + HEADER_TOKENS + c.env.get_ref("reflect_tokens")
        c.train.max_new_tokens = c.env.options[env].get_ref("max_turns") * room + reflection
    c.data.n_examples = 100_000  # training episodes: seeds 0 .. 99,999
    c.data.eval_size = 128  # held-out episodes: seeds from 1,000,000
    c.train.prompts_per_step = 8
    c.train.time_budget_s = 600.0
    c.train.steps = 10_000  # the time budget ends the run
    c.train.eval_every = 10
    c.train.checkpoint_every = 10
    c.method = "grpo" if method in ESTIMATOR_METHODS else method
    if method == "grpo" or method in ESTIMATOR_METHODS:
        if method in ESTIMATOR_METHODS:
            c.grpo.advantage = ESTIMATOR_METHODS[method]
        c.grpo.group_size = 8
        c.grpo.temperature = 1.0
        c.optimizer.name = "adamw"
        c.optimizer.lr = 1e-4
        c.optimizer.max_grad_norm = 1.0
    else:
        c.es.population = 32
        # On FrozenLake (docs/agents.md): at σ 0.005 (the default experiment's) all 32 members played the same greedy
        # episodes on every step (fitness std 0, no update); at 0.05 most actions failed to parse; at 0.02 the members
        # differ but 10 minutes gain nothing; at 0.01 with lr 3e-3 they are 10 points up within 10 minutes on 3 of 3
        # seeds, LOO-ROLL and EGGROLL alike. On Sokoban, which the model almost never solves, the members still play
        # alike at 0.01.
        c.es.sigma = 0.01
        c.es.shaping = "raw"
        c.optimizer.lr = 3e-3
    if "svm_fitness" in parts:
        if c.method not in ("looroll", "eggroll"):
            raise ValueError(f"configs/agents.py: variant {arg!r}: svm_fitness is a fitness of looroll or eggroll")
        c.es.svm_weight = SVM_WEIGHT
    if "quick" in parts:
        c.data.n_examples = 200
        c.data.eval_size = 8
        c.train.time_budget_s = 0.0
        c.train.steps = 2
        c.train.prompts_per_step = 2
        c.train.eval_every = 2
        c.train.checkpoint_every = 2
        c.es.population = 4
        c.grpo.group_size = 4
    return c
