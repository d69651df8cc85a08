"""Typed experiment configuration: every config dataclass, the only place its defaults live, and `make_optimizer`.

Config files are ml-collections ConfigDicts that start from these defaults (`esroll.experiment.default_config()`,
which adds the options registered implementations bring) and set what their experiment changes; the library takes
the frozen dataclasses, converted once at the entry point by `from_config_dict`, which refuses unknown keys
(suggesting the nearest one) and ill-typed or out-of-range values with a one-line `ConfigError` naming the key.

    sections   model, device layout, data, optimizer, training loop, curriculum (what every method shares)
    methods    ES's settings and `ESConfig`; `GRPOConfig`
    root       `ExperimentConfig`, `make_optimizer`
    keys       dotted keys, the `Options` sections of registered implementations, renamed keys and `migrate`
    files      `from_config_dict`, `config_dict`

This package imports nothing from esroll but the leaves `esroll.errors` and `esroll.schedules`, so that any module
of the library can import its configuration at the top of the file without an import cycle. The price: a key whose
value names an implementation registered in another module (ES methods, fitness shapings, GRPO's advantage
estimators, aggregations and remat policies, tasks, rewards, prompt templates, prefix sources), the options such an
implementation registers, and what a method needs of the other sections are not checked here, where the registries
are out of reach, but by `esroll.experiment.check_names`, which the trainer and the entry points run right after
`from_config_dict`, and by the factories that take a config (`esroll.es.make_strategy`, `esroll.grpo`'s
`make_update` and `make_grpo_method`). What is checked here is the structure, the ranges, and the choices this
package implements itself (optimizers, schedules, dtypes, evaluation splits). Importing it does not import JAX: optax
(which does) is imported when a schedule or an optimizer is built, so that what only reads configs, errors and
workdirs (`esroll.report`) stays JAX-free.
"""

from esroll.config.files import config_dict, from_config_dict, method_switch_error
from esroll.config.keys import RENAMED, Options, dotted, migrate, nested, unknown_key
from esroll.config.methods import ESConfig, ESSettings, GRPOConfig
from esroll.config.root import DTYPES, EVAL_SPLITS, OPTIMIZERS, ExperimentConfig, make_optimizer
from esroll.config.sections import (
    LABEL_FREE,
    CurriculumConfig,
    DataConfig,
    EnvConfig,
    ModelSpec,
    OptimConfig,
    ParallelConfig,
    StepsConfig,
    TeacherConfig,
    TrainConfig,
)
from esroll.errors import ConfigError, InputError, check_fields
from esroll.schedules import SCHEDULES, make_schedule

__all__ = [
    "DTYPES",
    "EVAL_SPLITS",
    "LABEL_FREE",
    "OPTIMIZERS",
    "RENAMED",
    "SCHEDULES",
    "ConfigError",
    "CurriculumConfig",
    "DataConfig",
    "EnvConfig",
    "ESConfig",
    "ESSettings",
    "ExperimentConfig",
    "GRPOConfig",
    "InputError",
    "ModelSpec",
    "OptimConfig",
    "StepsConfig",
    "TeacherConfig",
    "Options",
    "ParallelConfig",
    "TrainConfig",
    "check_fields",
    "config_dict",
    "dotted",
    "from_config_dict",
    "make_optimizer",
    "make_schedule",
    "method_switch_error",
    "migrate",
    "nested",
    "unknown_key",
]
