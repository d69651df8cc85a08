"""Config files to config dataclasses and back: `from_config_dict` (refusing unknown keys with the nearest one, and
ill-typed or out-of-range values with a one-line error naming the key), `config_dict`, and the refusal of a method
switch that keeps the other family's optimizer."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from esroll.config.keys import RENAMED, Options, unknown_key
from esroll.config.root import ExperimentConfig
from esroll.errors import ConfigError, InputError


def from_config_dict(cd: Any, cls: type = ExperimentConfig, prefix: str = "") -> Any:
    """Build `cls` from a (nested) mapping, refusing unknown keys and values of the wrong type or range (an
    ExperimentConfig is also `validate`d; its names are checked by `esroll.experiment.check_names`)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    values = {}
    for key, value in dict(cd).items():
        name = f"{prefix}{key}"
        if key not in fields:
            raise InputError(unknown_key(name, fields))
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            values[key] = from_config_dict(value, hint, f"{name}.")
        elif hint is Options:
            values[key] = _options(name, value)
        else:
            values[key] = _typed(name, hint, value)
    try:
        built = cls(**values)
    except ConfigError as e:
        raise e.under(prefix) from None
    return built.validate() if cls is ExperimentConfig else built


def _options(name: str, value: Any) -> Options:
    """A section of registered options as the config wrote it: {registered name: {key: value}}. What the names and
    keys must be is known only to the registries (`esroll.experiment.check_names`); the structure is checked here."""
    if not hasattr(value, "items"):
        raise InputError(f"config: key '{name}' must be a section of options ({name}.<name>.<key>), got {value!r}")
    for entry, options in value.items():
        if not hasattr(options, "items") and not dataclasses.is_dataclass(options):
            key = f"{name}.{entry}"
            if key in RENAMED:
                raise InputError(unknown_key(key, ()))
            raise InputError(f"config: key '{key}' must be the options of '{entry}' ({key}.<key>), got {options!r}")
    return Options(value)


def _typed(name: str, hint: Any, value: Any) -> Any:
    if typing.get_origin(hint) is tuple:  # tuple[str, ...]
        item = typing.get_args(hint)[0]
        if isinstance(value, (list, tuple)) and all(isinstance(v, item) for v in value):
            return tuple(value)
        raise InputError(f"config: key '{name}' must be a tuple of {item.__name__}, got {value!r}")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise InputError(f"config: key '{name}' must be {hint.__name__}, got {type(value).__name__} {value!r}")
    return value


def config_dict(cfg: Any):
    """A dataclass config as an ml-collections ConfigDict: what config files start from."""
    from ml_collections import ConfigDict

    return ConfigDict(dataclasses.asdict(cfg))


def method_switch_error(file_method: str, overrides: dict[str, Any], suggestion: str | None) -> str | None:
    """The refusal of a `--config.method` override that moves between ES and GRPO but keeps the optimizer the
    config file tuned for the other family (measured: ES's Adam lr 1e-3 drives the default GRPO run to 0%)."""
    new = overrides.get("method", file_method)
    if (new == "grpo") == (file_method == "grpo") or any(k.startswith("optimizer.") for k in overrides):
        return None
    use = f"use {suggestion}" if suggestion else "use a variant of the config file made for it"
    return (
        f"config: --config.method={new} switches a {file_method} config to {new} but keeps its optimizer, which is "
        f"set for {file_method}; {use}, or also set --config.optimizer.*"
    )
