"""Text environments for multi-turn agents: one protocol (`TextEnv`: reset(seed) → observation text; step(action
text) → `Turn`), one registry (`ENVIRONMENTS`, `env.name`), and the built-ins, FrozenLake (through gymnasium, the
`agents` extra) and Sokoban (our own generator). See docs/agents.md."""

from esroll.envs.base import ENVIRONMENTS, MAX_ACTION_CHARS, TextEnv, Turn, make_env, parse_action, register_env
from esroll.envs.frozenlake import FrozenLake, FrozenLakeOptions
from esroll.envs.sokoban import Level, Sokoban, SokobanOptions, make_level, solve

__all__ = [
    "ENVIRONMENTS",
    "MAX_ACTION_CHARS",
    "FrozenLake",
    "FrozenLakeOptions",
    "Level",
    "Sokoban",
    "SokobanOptions",
    "TextEnv",
    "Turn",
    "make_env",
    "make_level",
    "parse_action",
    "register_env",
    "solve",
]
