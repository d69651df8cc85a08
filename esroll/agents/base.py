"""The protocol every text environment follows, the registry that names them, and the reading of an action.

    env = make_env("frozenlake", {"size": 4, "max_turns": 8})
    observation = env.reset(seed)                   # text; the same seed, the same episode
    turn = env.step(action_text)                    # Turn(observation, reward, done, valid)

An episode is deterministic from its seed: `reset(seed)` builds the level from the seed alone, and `step` draws no
randomness. The model's action is untrusted text: `parse_action` reads at most `MAX_ACTION_CHARS` of it, never
evaluates it, and a text that names no action is a malformed action, which the environment answers with a penalised
no-op (`Turn.valid` False), never an exception. An episode ends when the task is solved or failed, or after
`max_turns` turns (malformed ones included); `step` after the end raises (a caller's bug, not the model's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from esroll.registry import Registry

MAX_ACTION_CHARS = 64  # an action is a word; longer text is read only this far


@dataclasses.dataclass(frozen=True)
class Turn:
    """What one `step` returns: the next observation (text), the turn's reward, whether the episode has ended, and
    whether the action named one of the environment's actions (a malformed one is a no-op)."""

    observation: str
    reward: float
    done: bool
    valid: bool


class TextEnv(Protocol):
    """A text environment: `actions` are the words an action may be; `instructions` one line that states the task
    (what an agent's prompt starts with); `reset(seed)` starts the seed's episode and returns its first
    observation; `step(action)` plays one turn; `solved` says whether the current episode's task is done (what
    held-out success counts). Implementations hold one episode's state."""

    actions: tuple[str, ...]
    instructions: str

    @property
    def solved(self) -> bool: ...

    def reset(self, seed: int) -> str: ...

    def step(self, action: str) -> Turn: ...


# name -> factory(options) -> a fresh environment; options: the entry's frozen dataclass (`env.options.<name>.*`)
ENVIRONMENTS: Registry[Callable[[Any], TextEnv]] = Registry("environment", "env.name", options_key="env.options")


def register_env(name: str, factory: Callable[[Any], TextEnv], *, options: type, replace: bool = False):
    """Register the environment `env.name = name` selects: `factory(options)` returns a fresh environment, its
    options a frozen dataclass with a default for every field (keys `env.options.<name>.<field>`)."""
    return ENVIRONMENTS.add(name, factory, options=options, replace=replace)


def make_env(name: str, options: Mapping[str, Any] | Any | None = None) -> TextEnv:
    """A fresh environment `name` with `options` (its options dataclass, or a mapping of some of its fields;
    None: the defaults). An unknown name or option is refused naming the nearest one."""
    factory = ENVIRONMENTS.lookup(name)
    return factory(ENVIRONMENTS.options_of({name: options} if options is not None else {}, name))


def action_word(text: str) -> str:
    """The word an action text names, as `parse_action` reads it: the text up to its first newline (at most
    `MAX_ACTION_CHARS` characters), stripped of spaces and of one trailing ".", in lower case ("" for a non-text)."""
    if not isinstance(text, str):
        return ""
    return text[:MAX_ACTION_CHARS].split("\n", 1)[0].strip().lower().removesuffix(".").strip()


def parse_action(text: str, actions: tuple[str, ...]) -> int | None:
    """The index in `actions` of the action `text` names, or None when it names none: its `action_word`, in any
    case, must be one of the words. Anything else, whatever it holds, is malformed."""
    word = action_word(text)
    return actions.index(word) if word in actions else None
