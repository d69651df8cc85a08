"""Typed experiment configuration, and the only place its defaults live.

Config files are ml-collections ConfigDicts that start from these defaults (`config_dict(ExperimentConfig())`) and set
what their experiment changes; the library takes the frozen dataclasses, converted once at the entry point by
`from_config_dict`, which refuses unknown keys (suggesting the nearest one) and ill-typed or out-of-range values with a
one-line `esroll.errors.ConfigError` naming the key. The sets of allowed names come from the modules that implement
them (`esroll.es.estimators.METHODS`, `esroll.advantages.SHAPINGS`, `esroll.grpo.AGGREGATIONS`, `esroll.data.TASKS`).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import optax

from esroll.advantages import LABEL_FREE_ONLY
from esroll.curriculum import CurriculumConfig
from esroll.data.tasks import NUMERIC_TASKS, TASKS, TEMPLATES
from esroll.errors import ConfigError, InputError, unknown_key
from esroll.es.estimators import METHODS as ES_METHODS
from esroll.es.strategy import ESConfig, ESSettings
from esroll.grpo import GRPOConfig
from esroll.schedules import SCHEDULES, make_schedule

METHODS = (*ES_METHODS, "grpo")
OPTIMIZERS = ("adam", "adamw", "sgd")
DTYPES = ("float32", "bfloat16")
DECODE_LAYERS = ("auto", "scan", "unrolled")
EVAL_SPLITS = ("test", "validation")
REWARDS = ("gold", "majority")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """path: a local Hugging Face folder (or a Hub id when online). dtype: the compute dtype (what rollouts decode
    and GRPO's loss runs in; also the dtype of the exported model). master_dtype: the parameters the optimizer
    updates, its state, and checkpoints (float32 masters keep small updates that bfloat16 would round away; set it
    to the same as dtype for pure low-precision training)."""

    path: str = "assets/tiny-qwen3-arith"
    dtype: str = "float32"
    master_dtype: str = "float32"


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How a step is laid out on the devices (`esroll.parallel`, `esroll.sharding`, `esroll.memory`).

    model: devices along the mesh's model axis: attention heads, MLP columns and the vocabulary are split over them
    (tensor parallelism) and rows over the rest (the data axis); 1 keeps a whole model per device.
    rows_per_device: rows each device decodes at once; a rollout decodes its rows in chunks of (data-axis size ×
    rows_per_device), the KV cache sized to the chunk. 0 picks the most that fit in `memory_fraction` of the
    device's memory (all rows at once on a CPU, whose memory JAX does not report).
    decode_layers: auto | scan | unrolled — how the decode loop runs the layers (`esroll.sampling.generate`; auto:
    unrolled on a CPU, where it is faster, scan on accelerators, where compile time then does not grow with depth).
    decode_phases: the decode loop's phases (the KV cache grows between them)."""

    model: int = 1
    rows_per_device: int = 0
    memory_fraction: float = 0.9
    decode_layers: str = "auto"
    decode_phases: int = 4


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """task: arithmetic | countdown | gsm8k | gsm_symbolic. gsm8k reads `path` (a JSONL/Parquet file or a `datasets`
    name) and `eval_path` (empty: split `eval_size` rows off the training data). Synthetic tasks generate `n_examples`
    rows from `seed` with `digits`, `ops`, `n_terms`, `word_problems` (arithmetic) or `countdown_numbers`;
    gsm_symbolic generates `n_examples` GSM-Symbolic problems (reasoning-gym), `eval_size` of them from held-out
    templates. template: plain | chat (the tokenizer's chat template, with `system` as the system message).
    `seed` fixes the data and the split; `order_seed` (-1: `seed`) only the order of the training batches, so a
    comparison can vary the order without moving any question between the splits. The first `validation_size`
    held-out questions are the validation split and the rest the test split; `eval_split` (test | validation) is
    the one held-out evaluation scores (with validation_size 0, test is the whole held-out set).
    min_difficulty (-1: off) keeps only examples at least that hard in both splits (arithmetic sums: their carries).
    reward: gold (the answer key) | majority (label-free, test-time RL: a completion is rewarded for agreeing with
    the majority answer of the completions of its prompt; the gold answer is then used only for evaluation)."""

    task: str = "arithmetic"
    path: str = ""
    eval_path: str = ""
    n_examples: int = 8000
    digits: int = 2
    ops: str = "+"
    n_terms: int = 2
    word_problems: bool = False
    countdown_numbers: int = 3
    eval_size: int = 256
    seed: int = 0
    order_seed: int = -1
    validation_size: int = 0
    eval_split: str = "test"
    min_difficulty: int = -1
    reward: str = "gold"
    template: str = "plain"
    system: str = ""

    @property
    def batch_seed(self) -> int:
        """The seed of the training batches' order."""
        return self.seed if self.order_seed < 0 else self.order_seed


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """An optax optimizer: name adam | adamw | sgd; max_grad_norm 0 = no clipping. The learning rate follows
    `schedule` (`esroll.schedules`: constant | linear | cosine) from `lr` to `lr_final` over `horizon` optimizer
    steps (a declared number: the schedule is a function of the step, so resume is exact and a time-budgeted run
    needs no guess of its length), after `warmup_steps` of linear warm-up from 0."""

    name: str = "adam"
    lr: float = 1e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 0.0
    schedule: str = "constant"
    lr_final: float = 0.0
    horizon: int = 0
    warmup_steps: int = 0


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """steps: optimizer steps; time_budget_s: stop after this much training wall time (0 = no limit; evaluation is
    not counted). Each step uses `prompts_per_step` prompts and up to `max_new_tokens` generated tokens per row;
    `temperature` is the ES members' sampling temperature (0 = greedy; GRPO has its own). Held-out evaluation every
    `eval_every` steps, a checkpoint every `checkpoint_every`; `export` writes the final model to workdir/final."""

    steps: int = 70
    time_budget_s: float = 0.0
    prompts_per_step: int = 32
    max_new_tokens: int = 6
    temperature: float = 0.0
    eval_every: int = 10
    checkpoint_every: int = 10
    export: bool = True


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """method: looroll | eggroll (ES, settings in `es`) or grpo (settings in `grpo`). seed: the method's randomness
    (noise, sampling); `data.seed` fixes the data. curriculum: what each step trains on (`esroll.curriculum`: adaptive
    data scheduling, AdaPrefix), for every method. parallel: the device layout (mesh model axis, rollout chunks).
    distributed: start `jax.distributed` (multi-host; one process per host, see the README)."""

    method: str = "looroll"
    seed: int = 0
    model: ModelSpec = ModelSpec()
    data: DataConfig = DataConfig()
    es: ESSettings = ESSettings()
    grpo: GRPOConfig = GRPOConfig()
    curriculum: CurriculumConfig = CurriculumConfig()
    optimizer: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    parallel: ParallelConfig = ParallelConfig()
    distributed: bool = False

    @property
    def es_config(self) -> ESConfig:
        """The ES configuration of an ES method (`method` in looroll | eggroll)."""
        return ESConfig.of(self.method, self.es)

    def validate(self) -> ExperimentConfig:
        rows = self.train.prompts_per_step * self.grpo.group_size  # completions sampled per GRPO step
        checks = [
            ("method", self.method in METHODS, f"one of {', '.join(METHODS)}"),
            ("model.path", bool(self.model.path), "a local model folder (--config.model.path=DIR) or a Hub id"),
            ("model.dtype", self.model.dtype in DTYPES, f"one of {', '.join(DTYPES)}"),
            ("model.master_dtype", self.model.master_dtype in DTYPES, f"one of {', '.join(DTYPES)}"),
            ("parallel.model", self.parallel.model >= 1, ">= 1"),
            ("parallel.rows_per_device", self.parallel.rows_per_device >= 0, ">= 0 (0: as many as fit)"),
            ("parallel.memory_fraction", 0 < self.parallel.memory_fraction <= 1, "in (0, 1]"),
            (
                "parallel.decode_layers",
                self.parallel.decode_layers in DECODE_LAYERS,
                f"one of {', '.join(DECODE_LAYERS)}",
            ),
            ("parallel.decode_phases", self.parallel.decode_phases >= 1, ">= 1"),
            ("data.task", self.data.task in TASKS, f"one of {', '.join(TASKS)}"),
            ("data.template", self.data.template in TEMPLATES, f"one of {', '.join(TEMPLATES)}"),
            ("data.eval_size", self.data.eval_size >= 1, ">= 1"),
            (
                "data.validation_size",
                0 <= self.data.validation_size < self.data.eval_size,
                ">= 0 and below data.eval_size (the rest is the test split)",
            ),
            ("data.eval_split", self.data.eval_split in EVAL_SPLITS, f"one of {', '.join(EVAL_SPLITS)}"),
            ("data.reward", self.data.reward in REWARDS, f"one of {', '.join(REWARDS)}"),
            (
                "data.reward",
                self.data.reward == "gold" or self.data.task in NUMERIC_TASKS,
                f"'gold' for data.task={self.data.task!r} (label-free rewards vote on numeric answers)",
            ),
            (
                "method",
                self.method == "grpo"
                or not (self.grpo.stare_quantile > 0 or self.grpo.acpo or self.grpo.progress_coef > 0),
                "grpo for grpo.stare_quantile, grpo.acpo and grpo.progress_coef (token-level methods: ES has no "
                "per-token log-probabilities)",
            ),
            (
                "grpo.group_size",
                self.method != "grpo" or self.data.reward == "gold" or self.grpo.group_size >= 2,
                ">= 2 with data.reward='majority' (a vote needs a group)",
            ),
            (
                "grpo.advantage",
                self.method != "grpo" or self.grpo.advantage not in LABEL_FREE_ONLY or self.data.reward == "majority",
                "an estimator that reads gold rewards, or data.reward='majority' (ddrl is label-free only)",
            ),
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
            (
                "es.samples",
                self.method not in ES_METHODS or self.es.samples == 1 or self.train.temperature > 0,
                "1 when train.temperature is 0 (greedy decoding gives K identical answers)",
            ),
            ("train.checkpoint_every", self.train.checkpoint_every >= 1, ">= 1"),
            (
                "grpo.minibatches",
                rows % self.grpo.minibatches == 0,
                f"a divisor of train.prompts_per_step × grpo.group_size = {rows}",
            ),
            (
                "grpo.microbatches",
                rows % (self.grpo.minibatches * self.grpo.microbatches) == 0,
                f"a divisor of the minibatch size, {rows} / grpo.minibatches",
            ),
        ]
        for key, ok, expected in checks:
            if not ok:
                raise ConfigError(key, _get(self, key), expected)
        if self.method in ES_METHODS:
            try:
                self.es_config
            except ConfigError as e:
                raise e.under("es.") from None
        return self


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """The optax optimizer `cfg` names at its learning-rate schedule (global-norm clipping first when
    `max_grad_norm` > 0)."""
    lr = make_schedule(cfg.schedule, cfg.lr, cfg.lr_final, cfg.horizon, cfg.warmup_steps)
    if cfg.name == "sgd":
        opt = optax.sgd(lr)
    elif cfg.name == "adamw":
        opt = optax.adamw(lr, weight_decay=cfg.weight_decay)
    else:
        opt = optax.adam(lr)
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), opt) if cfg.max_grad_norm > 0 else opt


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def from_config_dict(cd: Any, cls: type = ExperimentConfig, prefix: str = "") -> Any:
    """Build `cls` from a (nested) mapping, refusing unknown keys and values of the wrong type or range."""
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
        else:
            values[key] = _typed(name, hint, value)
    try:
        built = cls(**values)
    except ConfigError as e:
        raise e.under(prefix) from None
    return built.validate() if cls is ExperimentConfig else built


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
