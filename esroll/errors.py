"""Errors a user can fix: each carries one line naming the config key, file or data row at fault.

The entry scripts print an `InputError` as that one line (no traceback) and exit non-zero; anything else is a bug
and keeps its traceback. Library code that reads user input (configs, model folders, data files, workdirs) runs
inside `reading(...)`, which turns the ValueError / OSError / ImportError such code raises into an InputError with
the same message.

`InputError`, `ConfigError`, `check_fields` and `unknown_key` are defined in `esroll.config`, which imports nothing
from esroll so that every module can import its configuration without a cycle; they are importable from here too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from esroll.config import ConfigError, InputError, check_fields, unknown_key

__all__ = ["ConfigError", "InputError", "check_fields", "reading", "unknown_key"]


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
