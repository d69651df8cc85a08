"""Train with ES (LOO-ROLL, EGGROLL) or GRPO from a config file; the loop lives in `esroll.train`.

    python -m experiments.train --config configs/default.py[:variant] --workdir DIR [--config.es.sigma=0.001]

Rerunning with the same --workdir resumes from its last checkpoint. A workdir holding a run of another config is
refused unless --overwrite is given (the old run is then moved aside, never deleted).
"""

from absl import app, flags
from ml_collections import config_flags

from esroll.config import from_config_dict
from esroll.train import train_and_evaluate
from experiments._entry import start

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py[:variant]).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and the exported model.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Move aside a run of another config found in --workdir.")
_MESH_DEVICES = flags.DEFINE_integer("mesh_devices", 0, "Use only the first N devices (0 = all).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    start(argv)
    cfg = from_config_dict(_CONFIG.value.to_dict())
    train_and_evaluate(cfg, _WORKDIR.value, overwrite=_OVERWRITE.value, mesh_devices=_MESH_DEVICES.value)


if __name__ == "__main__":
    app.run(main)
