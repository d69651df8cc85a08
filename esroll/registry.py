"""The one mechanism behind every registry of named implementations (tasks, rewards, fitness shapings, advantage
estimators, GRPO variants): a dict from name to implementation that knows what it holds and which config key names
it, so that registering and checking a name are the same code, and the same messages, everywhere.

    TASKS = Registry("task", "data.task")
    TASKS.add("larger", spec)                  # ValueError if taken, unless replace=True
    TASKS.check("larger")                      # ConfigError naming data.task and the known names if unknown
    TASKS.lookup("larger")                     # the spec, or ValueError naming the known names

A registry is a plain dict otherwise (`name in TASKS`, iteration in registration order), so code that reads it needs
nothing of this module. It imports only `esroll.config` (for `ConfigError`), so every module can hold one.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from esroll.config import ConfigError

T = TypeVar("T")


class Registry(dict[str, T], Generic[T]):
    """Names → implementations of one kind (`what`, e.g. "task"), selected by the config key `key` ("data.task").
    `reserved` names are taken by something that is not an entry (the label-free reward mode) and cannot be added."""

    def __init__(self, what: str, key: str, reserved: tuple[str, ...] = ()):
        super().__init__()
        self.what, self.key, self.reserved = what, key, reserved

    def add(self, name: str, value: T, *, replace: bool = False, also_in: tuple[dict, ...] = ()) -> T:
        """Register `value` as `name` and return it. A name that is not a non-empty string, is reserved, or is
        already taken here (or in one of `also_in`, registries sharing this one's names) is refused with a
        ValueError unless `replace` is set, so that two modules cannot silently shadow each other's entry."""
        self.check_new(name, replace=replace, also_in=also_in)
        self[name] = value
        return value

    def check_new(self, name: str, *, replace: bool = False, also_in: tuple[dict, ...] = ()) -> None:
        """Raise the ValueError `add` would raise for `name`, without adding anything."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.what} name {name!r}: expected a non-empty string")
        if name in self.reserved:
            raise ValueError(f"{self.what} name {name!r} is reserved ({self.key} = {name!r} is not a registered entry)")
        if not replace and any(name in r for r in (self, *also_in)):
            raise ValueError(f"{self.what} {name!r} is already registered (pass replace=True to replace it)")

    def expected(self) -> str:
        """What a config value must be: "one of a, b, c" (the reserved names last)."""
        return f"one of {', '.join((*self, *self.reserved))}"

    def check(self, name: str, key: str | None = None) -> None:
        """Raise the one-line ConfigError of `key` (default: this registry's) when `name` is neither registered nor
        reserved, listing what is."""
        if name not in self and name not in self.reserved:
            raise ConfigError(key or self.key, name, self.expected())

    def lookup(self, name: str) -> T:
        """The entry registered as `name`; a ValueError listing the registered names when there is none."""
        if name not in self:
            raise ValueError(f"unknown {self.what} {name!r}; expected {self.expected()}")
        return self[name]
