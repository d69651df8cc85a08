"""Train with ES (LOO-ROLL, EGGROLL) or GRPO from a config file; the loop lives in `esroll.train`.

    python -m experiments.train --config configs/default.py[:variant] --workdir DIR [--config.es.sigma=0.001]

Rerunning with the same --workdir resumes from its last checkpoint (a finished run is reported and left as it is).
A workdir holding a run of another config is refused unless --overwrite is given (the old run is then moved aside,
never deleted). `--help --config=FILE` lists the config's variants and keys.
"""

from absl import flags
from ml_collections import config_flags

from esroll.config import from_config_dict, method_switch_error
from esroll.errors import InputError
from esroll.experiment import check_names
from esroll.train import train_and_evaluate
from experiments._entry import load_config, override_values, run

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py[:variant]).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and the exported model.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Move aside a run of another config found in --workdir.")
_MESH_DEVICES = flags.DEFINE_integer("mesh_devices", 0, "Use only the first N devices (0 = all).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    check_method_switch()
    cfg = check_names(from_config_dict(_CONFIG.value.to_dict()))
    train_and_evaluate(cfg, _WORKDIR.value, overwrite=_OVERWRITE.value, mesh_devices=_MESH_DEVICES.value)


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
    run(main, model_path=lambda: _CONFIG.value.model.path)
