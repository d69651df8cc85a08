"""Typed experiment configuration. Config files are ml-collections ConfigDicts; the library takes these frozen
dataclasses, converted once at the entry point by `from_config_dict`, which refuses unknown keys and ill-typed or
out-of-range values with a one-line error naming the key."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

METHODS = ("looroll", "eggroll", "grpo")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    path: str = "assets/tiny-qwen3-arith"
    dtype: str = "float32"


@dataclasses.dataclass(frozen=True)
class DataConfig:
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
    template: str = "plain"
    system: str = ""


@dataclasses.dataclass(frozen=True)
class ESSection:
    population: int = 64
    rank: int = 1
    sigma: float = 0.005
    shaping: str = "raw"
    chunk_size: int = 0


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    name: str = "adam"
    lr: float = 1e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 0.0


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 70
    time_budget_s: float = 0.0
    prompts_per_step: int = 32
    max_new_tokens: int = 6
    temperature: float = 0.0
    eval_every: int = 10
    checkpoint_every: int = 10
    export: bool = True


@dataclasses.dataclass(frozen=True)
class GRPOSection:
    """GRPO (esroll.grpo). Each step samples group_size completions per prompt, then takes inner_iterations ×
    minibatches optimizer steps; each minibatch's gradient is summed over microbatches (a memory knob only)."""

    group_size: int = 8
    advantage: str = "grpo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    inner_iterations: int = 1
    minibatches: int = 1
    microbatches: int = 1
    beta: float = 0.0
    aggregation: str = "seq_mean_token_mean"
    temperature: float = 1.0
    remat: bool = False


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    method: str = "looroll"
    seed: int = 0
    model: ModelSpec = ModelSpec()
    data: DataConfig = DataConfig()
    es: ESSection = ESSection()
    grpo: GRPOSection = GRPOSection()
    optimizer: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    distributed: bool = False

    def validate(self) -> ExperimentConfig:
        grpo_rows = self.train.prompts_per_step * self.grpo.group_size  # completions sampled per GRPO step
        checks = [
            ("method", self.method in METHODS, f"one of {METHODS}"),
            ("model.dtype", self.model.dtype in ("float32", "bfloat16"), "float32 or bfloat16"),
            ("data.task", self.data.task in ("arithmetic", "countdown", "gsm8k"), "arithmetic, countdown or gsm8k"),
            ("data.template", self.data.template in ("plain", "chat"), "plain or chat"),
            ("data.eval_size", self.data.eval_size >= 1, ">= 1"),
            ("es.population", self.es.population >= 2, ">= 2"),
            ("es.population", self.method != "eggroll" or self.es.population % 2 == 0, "even for eggroll (antithetic pairs)"),
            ("es.rank", self.es.rank >= 1, ">= 1"),
            ("es.sigma", self.es.sigma > 0, "> 0"),
            ("es.shaping", self.es.shaping in ("raw", "zscore", "centered_ranks"), "raw, zscore or centered_ranks"),
            ("optimizer.name", self.optimizer.name in ("adam", "adamw", "sgd"), "adam, adamw or sgd"),
            ("optimizer.lr", self.optimizer.lr > 0, "> 0"),
            ("train.steps", self.train.steps >= 1, ">= 1"),
            ("train.prompts_per_step", self.train.prompts_per_step >= 1, ">= 1"),
            ("train.max_new_tokens", self.train.max_new_tokens >= 1, ">= 1"),
            ("train.temperature", self.train.temperature >= 0, ">= 0"),
            ("train.eval_every", self.train.eval_every >= 1, ">= 1"),
            ("train.checkpoint_every", self.train.checkpoint_every >= 1, ">= 1"),
            ("grpo.group_size", self.grpo.group_size >= 2, ">= 2"),
            ("grpo.advantage", self.grpo.advantage in ("grpo", "dr_grpo", "rloo"), "grpo, dr_grpo or rloo"),
            ("grpo.aggregation", self.grpo.aggregation in ("seq_mean_token_mean", "token_mean", "constant_length"),
             "seq_mean_token_mean, token_mean or constant_length"),
            ("grpo.temperature", self.grpo.temperature > 0, "> 0"),
            ("grpo.epsilon_low", 0 <= self.grpo.epsilon_low < 1, "in [0, 1)"),
            ("grpo.epsilon_high", self.grpo.epsilon_high >= 0, ">= 0"),
            ("grpo.inner_iterations", self.grpo.inner_iterations >= 1, ">= 1"),
            ("grpo.beta", self.grpo.beta >= 0, ">= 0"),
            ("grpo.minibatches", self.grpo.minibatches >= 1 and grpo_rows % self.grpo.minibatches == 0,
             f"a divisor of train.prompts_per_step × grpo.group_size = {grpo_rows}"),
            ("grpo.microbatches", self.grpo.microbatches >= 1
             and grpo_rows % (self.grpo.minibatches * self.grpo.microbatches) == 0,
             f"a divisor of the minibatch size, {grpo_rows} / grpo.minibatches"),
        ]  # fmt: skip
        for key, ok, expected in checks:
            if not ok:
                raise ValueError(f"config: invalid value for '{key}': {_get(self, key)!r} (expected {expected})")
        return self


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def from_config_dict(cd: Any, cls: type = ExperimentConfig, prefix: str = "") -> Any:
    """Build `cls` from a (nested) mapping, refusing unknown keys and values of the wrong type."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    values = {}
    for key, value in dict(cd).items():
        name = f"{prefix}{key}"
        if key not in fields:
            raise ValueError(f"config: unknown key '{name}' (known: {', '.join(sorted(fields))})")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            values[key] = from_config_dict(value, hint, f"{name}.")
            continue
        if hint is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
            raise ValueError(f"config: key '{name}' must be {hint.__name__}, got {type(value).__name__} {value!r}")
        values[key] = value
    built = cls(**values)
    return built.validate() if cls is ExperimentConfig else built
