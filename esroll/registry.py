"""The one mechanism behind every registry of named implementations (tasks, rewards, fitness shapings, ES estimators,
advantage estimators, GRPO variants, environments, step verifiers): a dict from name to implementation that knows what
it holds and which config key names it, so that registering and checking a name are the same code, and the same
messages, everywhere.

    TASKS = Registry("task", "data.task")
    TASKS.add("larger", spec)                  # ValueError if taken, unless replace=True
    TASKS.check("larger")                      # ConfigError naming data.task and the known names if unknown
    TASKS.lookup("larger")                     # the spec, or ValueError naming the known names

An entry may bring its own options: a frozen dataclass registered with it (`add(..., options=AgraeOptions)`), whose
fields are the keys of the registry's options section (`options_key`, e.g. "grpo.adv": `grpo.adv.agrae.positive`).
`resolve` turns that section as a config file wrote it into {name: options dataclass}, refusing an unknown name or
key with the nearest one and filling in the defaults of every name not set; `options_of` gives one entry's options.
So an implementation with a hyperparameter is one file and a config line: no config module lists it.

A registry is a plain dict otherwise (`name in TASKS`, iteration in registration order), so code that reads it needs
nothing of this module. It imports only `esroll.config` (for `ConfigError`), so every module can hold one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

from esroll.config import ConfigError, InputError, Options, from_config_dict, unknown_key

T = TypeVar("T")


class Registry(dict[str, T], Generic[T]):
    """Names → implementations of one kind (`what`, e.g. "task"), selected by the config key `key` ("data.task").
    `reserved` names are taken by something that is not an entry (the label-free reward mode) and cannot be added."""

    def __init__(self, what: str, key: str, reserved: tuple[str, ...] = (), options_key: str | None = None):
        super().__init__()
        self.what, self.key, self.reserved, self.options_key = what, key, reserved, options_key
        self.options: dict[str, type | None] = {}  # name -> its options dataclass (None: it takes none)

    def add(
        self,
        name: str,
        value: T,
        *,
        options: type | None = None,
        replace: bool = False,
        also_in: tuple[dict, ...] = (),
    ) -> T:
        """Register `value` as `name` and return it. A name that is not a non-empty string, is reserved, or is
        already taken here (or in one of `also_in`, registries sharing this one's names) is refused with a
        ValueError unless `replace` is set, so that two modules cannot silently shadow each other's entry.
        `options`: the entry's options, a frozen dataclass whose every field has a default (its keys in the config
        are `<options_key>.<name>.<field>`); this registry must have an `options_key`."""
        self.check_new(name, replace=replace, also_in=also_in)
        if options is not None:
            if self.options_key is None:
                raise ValueError(f"{self.what} {name!r}: this registry takes no options")
            if not (isinstance(options, type) and dataclasses.is_dataclass(options)):
                raise TypeError(f"{self.what} {name!r}: options must be a dataclass type, got {options!r}")
            if not options.__dataclass_params__.frozen:
                raise TypeError(f"{self.what} {name!r}: options {options.__name__} must be frozen (configs are)")
            try:
                options()
            except TypeError as e:
                raise TypeError(f"{self.what} {name!r}: every field of {options.__name__} needs a default") from e
        self[name] = value
        self.options[name] = options
        return value

    def __delitem__(self, name: str) -> None:
        super().__delitem__(name)
        self.options.pop(name, None)

    def options_of(self, section: Mapping[str, Any], name: str) -> Any:
        """Entry `name`'s options from `section` (the config's options section, resolved or as written): the
        dataclass found there, built from the mapping found there, or the defaults; None for an entry without
        options."""
        cls = self.options.get(name)
        if cls is None:
            return None
        given = section.get(name)
        if isinstance(given, cls):
            return given
        try:
            return from_config_dict({} if given is None else given, cls, f"{self.options_key}.{name}.")
        except ConfigError as e:  # its key is spelled in full: a plain InputError, which no caller prefixes again
            raise InputError(str(e)) from None

    def resolve(self, section: Mapping[str, Any]) -> Options:
        """The options section complete and typed: {name: its options dataclass} for every entry with options,
        those `section` sets built from it, the others at their defaults. An InputError names an unknown entry (or
        one that takes no options) with the nearest name, and an unknown key with the nearest key."""
        with_options = [name for name, cls in self.options.items() if cls is not None]
        for name in section:
            if name not in with_options:
                raise InputError(unknown_key(f"{self.options_key}.{name}", with_options))
        return Options({name: self.options_of(section, name) for name in with_options})

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
