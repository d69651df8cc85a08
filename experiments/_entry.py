"""What the absl entry scripts share: one CPU device per core, quiet orbax logs, a
`--help` that lists the config's variants and keys, and expected errors printed as one line.

    if __name__ == "__main__":
        run(main)

Expected errors are `esroll.errors.InputError`s (config keys and values; anything raised while reading the model
folder, the data or the workdir, see `esroll.errors.reading`) and flag-parsing errors: each is printed as one line on
stderr and the process exits with status 2 (command line) or 1 (input). Anything else keeps its traceback;
`--debug` keeps the traceback of expected errors too.
"""

from __future__ import annotations

import os
import runpy
import sys
import textwrap
from collections.abc import Callable
from typing import Any

from absl import app, flags, logging
from ml_collections import config_flags

from esroll import parallel, quiet_tpu_probe
from esroll.config import unknown_key
from esroll.errors import InputError, Interrupted, outside_code
from esroll.models import ModelConfig, count_params

_DEBUG = flags.DEFINE_bool("debug", False, "Show the traceback of expected errors (bad config, model, data, workdir).")


def run(main, model_path: Callable[[], str] | None = None, workdir: Callable[[], str | None] | None = None) -> None:
    """`app.run(main)` with this module's help and error handling. `model_path()` (read once the flags are parsed)
    names the model the run loads: a large one keeps one CPU device (`parallel.use_cpu_cores_as_devices`).
    `workdir()` names the folder whose error.log keeps the full traceback of an error raised in a user's own code
    (`esroll.errors.outside_code`), which is otherwise printed as one line; Ctrl-C prints one line too."""
    argv = sys.argv
    if any(a in ("-h", "--help", "-help", "--helpshort", "--helpfull") for a in argv[1:]):
        print(help_text(argv))
        sys.exit(0)
    try:
        check_config_flag(argv)
    except InputError as e:
        _fail(e, 2, "--debug" in argv)

    def parse(args):
        try:
            return flags.FLAGS(args)
        except Exception as e:  # noqa: BLE001 — any flag-parsing failure is the command line's fault
            _fail(InputError(_first_line(e)), 2, "--debug" in args)

    def guarded(args):
        quiet_tpu_probe()
        parallel.use_cpu_cores_as_devices(_model_params(model_path() if model_path else ""))
        logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
        if len(args) > 1:
            _fail(InputError(f"unexpected arguments: {' '.join(args[1:])}"), 2, _DEBUG.value)
        try:
            return main(args)
        except InputError as e:
            _fail(e, 1, _DEBUG.value)
        except KeyboardInterrupt as e:
            if _DEBUG.value:
                raise
            print(f"[esroll] {_first_line(e) if isinstance(e, Interrupted) else 'interrupted'}", file=sys.stderr)
            sys.exit(130)
        except Exception as e:
            where = outside_code(e)
            if where is None or _DEBUG.value:
                raise
            log = _keep_traceback(e, workdir() if workdir else None)
            kept = f"; the full traceback is in {log}" if log else ""
            _fail(InputError(f"{type(e).__name__} raised at {where}: {_first_line(e)}{kept}"), 1, False)

    app.run(guarded, flags_parser=parse)


def _model_params(path: str) -> int:
    """Parameters of the model in local folder `path` from its config.json; 0 when it cannot be read here (a Hub id,
    a missing folder: the run reports those itself)."""
    try:
        return count_params(ModelConfig.from_json_file(os.path.join(path, "config.json")))
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _keep_traceback(error: Exception, workdir: str | None) -> str | None:
    """Append `error`'s traceback to WORKDIR/error.log (a local workdir: the folder is made if need be); its path, or
    None where it could not be written."""
    import datetime
    import traceback

    if not workdir or "://" in workdir:
        return None
    try:
        os.makedirs(workdir, exist_ok=True)
        path = os.path.join(workdir, "error.log")
        with open(path, "a") as f:
            f.write(f"---- {datetime.datetime.now().isoformat(timespec='seconds')}\n")
            f.write("".join(traceback.format_exception(error)))
        return path
    except OSError:
        return None


def _fail(error: Exception, status: int, debug: bool):
    if debug:
        raise error
    print(f"error: {_first_line(error)}", file=sys.stderr, flush=True)
    sys.exit(status)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ---- the config file named by --config


def _config_arg(argv: list[str], name: str = "config") -> str | None:
    for i, a in enumerate(argv):
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
        if a == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def load_config(spec: str) -> tuple[Any, Any]:
    """(config module namespace, ConfigDict) for 'path/to/file.py[:variant]', with one-line errors."""
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise InputError(f"--config: {path}: no such config file")
    module = runpy.run_path(path)
    if "get_config" not in module:
        raise InputError(f"--config: {path} defines no get_config(arg)")
    try:
        return module, module["get_config"](arg or None)
    except (ValueError, KeyError) as e:
        raise InputError(_first_line(e)) from None


def check_config_flag(argv: list[str]) -> None:
    """Refuse, before absl parses them, a missing config file or variant and `--config.KEY` overrides of keys the
    config does not have (naming the nearest one)."""
    spec = _config_arg(argv)
    if spec is None:
        return
    _, cd = load_config(spec)
    for a in argv:
        if not a.startswith("--config."):
            continue
        key = a[len("--config.") :].split("=", 1)[0]
        node, parts = cd, key.split(".")
        for i, part in enumerate(parts):
            if not hasattr(node, "keys") or part not in node:
                raise InputError(unknown_key(".".join(parts[: i + 1]), node.keys() if hasattr(node, "keys") else []))
            node = node[part]


def override_values(flag: str = "config") -> dict[str, Any]:
    return config_flags.get_override_values(flags.FLAGS[flag])


def help_text(argv: list[str]) -> str:
    """The entry script's docstring and flags; with --config, the config's variants and every key with its value."""
    main = sys.modules["__main__"]
    parts = [(main.__doc__ or "").strip(), "", "flags:", flags.FLAGS.module_help(main).strip() or "  (none)"]
    parts += ["", flags.FLAGS.module_help(__name__).strip()]
    spec = _config_arg(argv)
    if spec is None:
        parts += ["", "Add --config=FILE[:variant] to --help to list that config's variants and keys."]
        return "\n".join(parts)
    try:
        module, cd = load_config(spec)
    except InputError as e:
        return "\n".join(parts + ["", f"error: {e}"])
    variants = module.get("VARIANTS")
    if variants:
        form = module.get("VARIANT_FORM")
        parts += ["", f"variants of {spec.partition(':')[0]} (--config=FILE:variant{'; ' + form if form else ''}):"]
        width = min(max(map(len, variants)), 22) + 2
        for name, what in variants.items():  # a name too long for the column gets its description on the next line
            text = textwrap.wrap(what, 118 - width) or [""]
            head = [f"  {name:<{width}}{text[0]}"] if len(name) < width else [f"  {name}", f"  {'':<{width}}{text[0]}"]
            parts += head + [f"  {'':<{width}}{line}" for line in text[1:]]
        parts += ["", "--print_config with --config (and any --config.KEY=VALUE) prints the resolved values."]
    parts += ["", f"keys of {spec} (override with --config.KEY=VALUE):"]
    parts += [f"  {key} = {value!r}" for key, value in _flatten(cd.to_dict())]
    return "\n".join(parts)


def _flatten(d: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in d.items():
        if isinstance(v, dict) and v and k != "overrides":  # a comparison's overrides read best as one dict
            out += _flatten(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", v))
    return out
