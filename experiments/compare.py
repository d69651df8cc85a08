"""Compare training methods at matched wall time, paired over seeds; the logic lives in `esroll.compare`.

    python -m experiments.compare --config configs/compare.py[:variant] --workdir DIR [--config.time_budget_s=300]

Runs every (method, seed) not yet finished in DIR/<method>/seed<k> (an interrupted comparison resumes), then writes
DIR/accuracy_vs_time.png, DIR/results.md, DIR/results.csv and DIR/runs.csv. With --report_only, only the report is
(re)written from the runs already there. `--help --config=configs/compare.py` lists the variants and keys.
"""

from absl import flags
from ml_collections import config_flags

from esroll.compare import comparison_from_dict, run_comparison
from esroll.report import write_report
from experiments._entry import run

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/compare.py[:variant]).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory holding one sub-workdir per (method, seed) and the report.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Move aside runs of another config found in the sub-workdirs.")
_MESH_DEVICES = flags.DEFINE_integer("mesh_devices", 0, "Use only the first N devices (0 = all).")
_REPORT_ONLY = flags.DEFINE_bool("report_only", False, "Do not train; write the report from the runs in --workdir.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if not _REPORT_ONLY.value:
        comparison = comparison_from_dict(_CONFIG.value.to_dict())
        run_comparison(comparison, _WORKDIR.value, overwrite=_OVERWRITE.value, mesh_devices=_MESH_DEVICES.value)
    paths = write_report(_WORKDIR.value)
    print(paths["results_md"].read_text())
    print(f"[compare] figure: {paths['figure']}")


if __name__ == "__main__":
    run(main, model_path=lambda: _CONFIG.value.experiment.model.path)
