"""Train with ES (LOO-ROLL, EGGROLL) or GRPO from a config file; the loop lives in `esroll.train`.

    python -m experiments.train --config configs/default.py[:variant] --workdir DIR [--config.es.sigma=0.001]

Rerunning with the same --workdir resumes from its last checkpoint (a finished run is reported and left as it is);
rerunning it with a larger train.steps or train.time_budget_s continues it from there. A workdir holding a run of
another config is refused unless --overwrite is given (the old run is then moved to WORKDIR/replaced-N, never
deleted). A key set on the command line that the run would not read (a GRPO option on an ES run, a data knob its task
ignores) is refused. `--help --config=FILE` lists the config's variants and keys; `--print_config` prints the resolved
config (file, variant and overrides), marking the keys the run does not read, and exits.

Each evaluation writes a few held-out completions (agents: whole episodes) to WORKDIR/samples.jsonl;
`--show_samples` prints the first. Ctrl-C stops the run with one line saying where to resume from; an exception
raised in code outside the library (a registered environment, reward, task or estimator) ends it with one line
naming the file and line, the full traceback kept in WORKDIR/error.log.
"""

import dataclasses

from absl import flags
from ml_collections import config_flags

from esroll.config import ExperimentConfig, dotted, from_config_dict, method_switch_error
from esroll.errors import InputError
from esroll.experiment import check_names, unread_keys
from esroll.train import train_and_evaluate
from experiments._entry import load_config, override_values, run

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py[:variant]).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and the exported model.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Move a run of another config found in --workdir to replaced-N.")
_MESH_DEVICES = flags.DEFINE_integer("mesh_devices", 0, "Use only the first N devices (0 = all).")
_SHOW_SAMPLES = flags.DEFINE_bool(
    "show_samples", False, "Print the first held-out sample of each evaluation (all are in WORKDIR/samples.jsonl)."
)
_PRINT_CONFIG = flags.DEFINE_bool(
    "print_config", False, "Print the resolved config, marking the keys the run does not read, and exit (no --workdir)."
)
flags.mark_flags_as_required(["config"])


def main(argv):
    check_method_switch()
    cfg = check_names(from_config_dict(_CONFIG.value.to_dict()))
    unread = unread_keys(cfg)
    if _PRINT_CONFIG.value:
        print(resolved_config(cfg, unread))
        return
    for key in override_values():
        if key in unread:
            raise InputError(f"--config.{key}: not read by this run: {unread[key]}")
    if not _WORKDIR.value:
        raise InputError("--workdir: required (or --print_config to print the resolved config)")
    train_and_evaluate(
        cfg,
        _WORKDIR.value,
        overwrite=_OVERWRITE.value,
        mesh_devices=_MESH_DEVICES.value,
        show_samples=_SHOW_SAMPLES.value,
    )


def resolved_config(cfg: ExperimentConfig, unread: dict[str, str]) -> str:
    """Every key of the run's config with its value (defaults, then the file and variant, then the overrides), one per
    line; a key the run does not read is marked with why."""
    overrides = override_values()
    lines = [f"# {flags.FLAGS['config'].config_filename}: the resolved config; '*' marks a command-line override"]
    for key, value in dotted(dataclasses.asdict(cfg)).items():
        mark = "*" if key in overrides else " "
        note = f"  # not read: {unread[key]}" if key in unread else ""
        lines.append(f"{mark} {key} = {value!r}{note}")
    return "\n".join(lines)


def check_method_switch() -> None:
    """Refuse `--config.method=grpo` on an ES config (or the reverse) that keeps the other family's optimizer."""
    overrides = override_values()
    if "method" not in overrides:
        return
    spec = flags.FLAGS["config"].config_filename
    path, _, arg = spec.partition(":")
    module, file_cfg = load_config(spec)
    new, old = overrides["method"], file_cfg.method
    suggestion = None
    for candidate in (new, arg.replace(old, new) if old in arg else None, f"{arg},{new}" if arg else None):
        try:
            if candidate and module["get_config"](candidate).method == new:
                suggestion = f"--config={path}:{candidate}"
                break
        except (ValueError, KeyError):
            continue
    error = method_switch_error(old, overrides, suggestion)
    if error:
        raise InputError(error)


if __name__ == "__main__":
    run(main, model_path=lambda: _CONFIG.value.model.path, workdir=lambda: _WORKDIR.value)
