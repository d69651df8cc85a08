"""Errors a user can fix: each carries one line naming the config key, file or data row at fault.

The entry scripts print an `InputError` as that one line (no traceback) and exit non-zero; anything else is a bug
and keeps its traceback. Library code that reads user input (configs, model folders, data files, workdirs) runs
inside `reading(...)`, which turns the ValueError / OSError / ImportError such code raises into an InputError with
the same message. `check_fields` raises the `ConfigError` of the first failed check of a config dataclass.

Imports nothing from esroll (and no JAX), so every module, `esroll.config` first, can raise these.
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
import traceback
from collections.abc import Iterable, Iterator

__all__ = ["ConfigError", "InputError", "Interrupted", "check_fields", "outside_code", "reading"]


class InputError(ValueError):
    """Bad input: a config key or value, a model folder or file, a data row, a workdir. The message is one line."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) during a run; the message is the one line that says where the run can resume from."""


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


_OURS = tuple(
    os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep + d + os.sep
    for d in ("esroll", "experiments")
)
_INSTALLED = tuple(
    {
        os.path.realpath(p) + os.sep
        for p in (sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib"))
    }
    | {os.path.realpath(sys.prefix) + os.sep, os.path.realpath(sys.base_prefix) + os.sep}
)


def outside_code(error: BaseException) -> str | None:
    """Where `error` was raised, as "file:line, in function", when that is a user's own code (a registered
    environment, reward, task or estimator; a config file) rather than esroll's or an installed package's: the
    innermost frame of its traceback that is not in an installed package or the standard library, when that frame
    is not esroll's. None when the error comes from esroll itself (a bug: it keeps its traceback)."""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        path = os.path.realpath(frame.filename)
        if path.startswith(_OURS):
            return None
        if frame.filename.startswith("<") or path.startswith(_INSTALLED):
            continue
        return f"{frame.filename}:{frame.lineno}, in {frame.name}"
    return None
