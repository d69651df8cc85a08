"""Multi-turn agents: text environments and the episodes a model plays in them (docs/agents.md).

    base        the protocol every environment follows (`TextEnv`: reset(seed) → observation text; step(action text)
                → `Turn`), the registry that names them (`ENVIRONMENTS`, `register_env`, `env.name`), `parse_action`
    frozenlake  FrozenLake through gymnasium (the `agents` extra)
    sokoban     Sokoban from our own generator and solver
    locate      locate-and-commit: look into boxes, then answer the one that holds the target (A2Agent's game)
    rps         rock-paper-scissors against scripted opponents, a frozen player reading the agent's memory (MemoPilot's)
    multiturn   `play`: a batch of episodes in lockstep, each in one KV cache; `Turns`, the turns credit reads
    rollout     `episodes`: the rows of an agent task played and returned as the `esroll.rollout.Rollout` every
                method reads
    task        the agent task: `EnvTask` (what a rollout needs of `env.*`), episodes named by seed (`splits`), the
                prompts, and what an agent run needs of the config

A new environment is one module that registers its factory and options with `register_env` (inside the library, one
import line below). Nothing here imports a training method: what an estimator reads of episodes is checked by the
method that owns the estimator.
"""

from esroll.agents import frozenlake, locate, rps, sokoban  # noqa: F401 — the built-in environments register themselves
from esroll.agents.base import ENVIRONMENTS, MAX_ACTION_CHARS, TextEnv, Turn, make_env, parse_action, register_env
from esroll.agents.frozenlake import FrozenLake, FrozenLakeOptions
from esroll.agents.multiturn import Episodes, Turns, episode_prompt, format_observation, play
from esroll.agents.rollout import EPISODE_SCORES, episodes
from esroll.agents.sokoban import Level, Sokoban, SokobanOptions, make_level, solve
from esroll.agents.task import (
    DATA_KEYS,
    EPISODE,
    HELD_OUT,
    EnvTask,
    check_config,
    env_task,
    episode,
    prompt_multiple,
    prompt_reader,
    splits,
)

__all__ = [
    "DATA_KEYS",
    "ENVIRONMENTS",
    "EPISODE",
    "EPISODE_SCORES",
    "HELD_OUT",
    "MAX_ACTION_CHARS",
    "EnvTask",
    "Episodes",
    "FrozenLake",
    "FrozenLakeOptions",
    "Level",
    "Sokoban",
    "SokobanOptions",
    "TextEnv",
    "Turn",
    "Turns",
    "check_config",
    "env_task",
    "episode",
    "episode_prompt",
    "episodes",
    "format_observation",
    "make_env",
    "make_level",
    "parse_action",
    "play",
    "prompt_multiple",
    "prompt_reader",
    "register_env",
    "solve",
    "splits",
]
