"""Errors a user can fix: each carries one line naming the config key, file or data row at fault.

The entry scripts print an `InputError` as that one line (no traceback) and exit non-zero; anything else is a bug
and keeps its traceback. Library code that reads user input (configs, model folders, data files, workdirs) runs
inside `reading(...)`, which turns the ValueError / OSError / ImportError such code raises into an InputError with
the same message. `check_fields` raises the `ConfigError` of the first failed check of a config dataclass.

Imports nothing from esroll (and no JAX), so every module, `esroll.config` first, can raise these.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

__all__ = ["ConfigError", "InputError", "check_fields", "reading"]


class InputError(ValueError):
    """Bad input: a config key or value, a model folder or file, a data row, a workdir. The message is one line."""


class ConfigError(InputError):
    """A config value out of range: names the key, the value and what is expected."""

    def __init__(self, key: str, value, expected: str, where: str = "config"):
        self.key, self.value, self.expected = key, value, expected
        super().__init__(f"{where}: invalid value for '{key}': {value!r} (expected {expected})")

    def under(self, prefix: str) -> ConfigError:
        """The same error for the key as a config file spells it (`es.` + `sigma`)."""
        return ConfigError(prefix + self.key, self.value, self.expected)


def check_fields(obj, checks: Iterable[tuple[str, bool, str]], where: str) -> None:
    """Raise the ConfigError of the first failed (field, ok, expected) check of `obj` (a dotted field names a nested
    value, e.g. "adv.horizon")."""
    for field, ok, expected in checks:
        if not ok:
            value = obj
            for part in field.split("."):
                value = getattr(value, part)
            raise ConfigError(field, value, expected, where=where)


@contextlib.contextmanager
def reading(what: str = "") -> Iterator[None]:
    """Errors raised while reading user input become InputErrors (prefixed with `what` when given)."""
    try:
        yield
    except InputError:
        raise
    except (ValueError, OSError, ImportError) as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"{what}: {message}" if what else message) from e
