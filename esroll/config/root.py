"""The whole experiment config (`ExperimentConfig`) and the optimizer it names (`make_optimizer`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from esroll.config.methods import ESConfig, ESSettings, GRPOConfig
from esroll.config.sections import (
    ATTENTION,
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
from esroll.errors import check_fields
from esroll.schedules import SCHEDULES, make_schedule

if TYPE_CHECKING:
    import optax

OPTIMIZERS = ("adam", "adamw", "sgd")
DTYPES = ("float32", "bfloat16")
EVAL_SPLITS = ("test", "validation")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """method: an ES estimator (looroll | eggroll, settings in `es`) or grpo (settings in `grpo`). seed: the method's
        randomness (noise, sampling); `data.seed` fixes the data. curriculum: what each step trains on
        (`esroll.curriculum`: adaptive data scheduling, AdaPrefix), for every method. parallel: the device layout (mesh
        model axis, rollout chunks). distributed: start `jax.distributed` (multi-host; one process per host, see the
        README). steps: how completions are cut into reasoning steps and scored step by step, for the methods that read
    steps. teacher: the model that scores the student's samples, for the methods that read one. env: train on multi-turn episodes of a text environment instead of `data`'s prompts (off by default).
    `validate` checks structure and ranges; `esroll.experiment.check_names` the registered names."""

    method: str = "looroll"
    seed: int = 0
    model: ModelSpec = ModelSpec()
    data: DataConfig = DataConfig()
    env: EnvConfig = EnvConfig()
    es: ESSettings = ESSettings()
    grpo: GRPOConfig = GRPOConfig()
    steps: StepsConfig = StepsConfig()
    teacher: TeacherConfig = TeacherConfig()
    curriculum: CurriculumConfig = CurriculumConfig()
    optimizer: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    parallel: ParallelConfig = ParallelConfig()
    distributed: bool = False

    @property
    def es_config(self) -> ESConfig:
        """The ES configuration of an ES method (`method` an ES estimator)."""
        return ESConfig.of(self.method, self.es)

    def validate(self) -> ExperimentConfig:
        """`self` if its values agree with each other and lie in range; else raise the ConfigError of the first that
        does not, naming its key. Names, and what the method needs of the other sections, are checked by
        `esroll.experiment.check_names` (each method's `esroll.methods.MethodSpec.check`)."""
        checks = [
            ("model.path", bool(self.model.path), "a local model folder (--config.model.path=DIR) or a Hub id"),
            ("model.dtype", self.model.dtype in DTYPES, f"one of {', '.join(DTYPES)}"),
            ("model.master_dtype", self.model.master_dtype in DTYPES, f"one of {', '.join(DTYPES)}"),
            ("model.attention", self.model.attention in ATTENTION, f"one of {', '.join(ATTENTION)}"),
            ("parallel.model", self.parallel.model >= 1, ">= 1"),
            ("parallel.rows_per_device", self.parallel.rows_per_device >= 0, ">= 0 (0: as many as fit)"),
            ("parallel.memory_fraction", 0 < self.parallel.memory_fraction <= 1, "in (0, 1]"),
            ("parallel.scan_unroll", self.parallel.scan_unroll >= 1, ">= 1"),
            ("parallel.decode_phases", self.parallel.decode_phases >= 1, ">= 1"),
            ("data.eval_size", self.data.eval_size >= 1, ">= 1"),
            (
                "data.validation_size",
                0 <= self.data.validation_size < self.data.eval_size,
                ">= 0 and below data.eval_size (the rest is the test split)",
            ),
            ("data.eval_split", self.data.eval_split in EVAL_SPLITS, f"one of {', '.join(EVAL_SPLITS)}"),
            (
                "data.eval_split",
                self.data.eval_split == "test" or self.data.validation_size > 0,
                "'test' when data.validation_size is 0 (there is no validation split)",
            ),
            ("optimizer.name", self.optimizer.name in OPTIMIZERS, f"one of {', '.join(OPTIMIZERS)}"),
            ("optimizer.lr", self.optimizer.lr > 0, "> 0"),
            ("optimizer.max_grad_norm", self.optimizer.max_grad_norm >= 0, ">= 0"),
            ("optimizer.schedule", self.optimizer.schedule in SCHEDULES, f"one of {', '.join(SCHEDULES)}"),
            ("optimizer.lr_final", self.optimizer.lr_final >= 0, ">= 0"),
            ("optimizer.warmup_steps", self.optimizer.warmup_steps >= 0, ">= 0"),
            (
                "optimizer.horizon",
                self.optimizer.horizon > self.optimizer.warmup_steps
                or (self.optimizer.schedule == "constant" and self.optimizer.warmup_steps == 0),
                "more steps than optimizer.warmup_steps (a schedule or a warm-up needs its horizon declared)",
            ),
            ("train.steps", self.train.steps >= 1, ">= 1"),
            ("train.time_budget_s", self.train.time_budget_s >= 0, ">= 0"),
            ("train.prompts_per_step", self.train.prompts_per_step >= 1, ">= 1"),
            ("train.max_new_tokens", self.train.max_new_tokens >= 1, ">= 1"),
            ("train.temperature", self.train.temperature >= 0, ">= 0"),
            ("train.eval_every", self.train.eval_every >= 1, ">= 1"),
            ("train.eval_samples", self.train.eval_samples >= 0, ">= 0 (0: no samples.jsonl)"),
            ("train.checkpoint_every", self.train.checkpoint_every >= 1, ">= 1"),
            ("train.diagnostics_every", self.train.diagnostics_every >= 0, ">= 0 (0: no diagnostics)"),
        ]
        check_fields(self, checks, "config")
        return self


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """The optax optimizer `cfg` names at its learning-rate schedule (global-norm clipping first when
    `max_grad_norm` > 0)."""
    import optax  # imports JAX: not at module import (see the module docstring)

    lr = make_schedule(cfg.schedule, cfg.lr, cfg.lr_final, cfg.horizon, cfg.warmup_steps)
    if cfg.name == "sgd":
        opt = optax.sgd(lr)
    elif cfg.name == "adamw":
        opt = optax.adamw(lr, weight_decay=cfg.weight_decay)
    else:
        opt = optax.adam(lr)
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), opt) if cfg.max_grad_norm > 0 else opt
