"""Typed experiment configuration: every config dataclass, the only place its defaults live, and `make_optimizer`.

Config files are ml-collections ConfigDicts that start from these defaults (`config_dict(ExperimentConfig())`) and set
what their experiment changes; the library takes the frozen dataclasses, converted once at the entry point by
`from_config_dict`, which refuses unknown keys (suggesting the nearest one) and ill-typed or out-of-range values with a
one-line `ConfigError` naming the key.

This module imports nothing from esroll (only the standard library and optax), so that any module of the
library can import its configuration from here at the top of the file without an import cycle. The price: a key whose
value names an implementation registered in another module (ES methods, fitness shapings, GRPO's advantage
estimators, aggregations and remat policies, tasks, rewards, prompt templates, prefix sources) is not checked here,
where the registry is out of reach, but by `esroll.experiment.check_names`, which the trainer and the entry points run
right after `from_config_dict`, and by the factories that take a config (`esroll.es.make_strategy`, `esroll.grpo`'s
`make_update` and `make_grpo_method`). What is checked here is the structure, the ranges, and the choices this module
implements itself (optimizers, schedules, dtypes, evaluation splits).

The error types a user can fix (`InputError`, `ConfigError`) are defined here for the same reason; `esroll.errors`
re-exports them with `reading`. Importing this module does not import JAX: optax (which does) is imported when a
schedule or an optimizer is built, so that what only reads configs, errors and workdirs (`esroll.report`) stays
JAX-free.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import optax

OPTIMIZERS = ("adam", "adamw", "sgd")
LABEL_FREE = "majority"  # `data.reward`'s label-free mode (`DataConfig.label_free`), reserved in `esroll.rewards`
DTYPES = ("float32", "bfloat16")
EVAL_SPLITS = ("test", "validation")


# ---- errors a user can fix


class InputError(ValueError):
    """Bad input: a config key or value, a model folder or file, a data row, a workdir. The message is one line."""


class ConfigError(InputError):
    """A config value out of range: names the key, the value and what is expected."""

    def __init__(self, key: str, value, expected: str, where: str = "config"):
        self.key, self.value, self.expected = key, value, expected
        super().__init__(f"{where}: invalid value for '{key}': {value!r} (expected {expected})")

    def under(self, prefix: str) -> ConfigError:
        """The same error for the key as a config file spells it (`es.` + `sigma`)."""
        return ConfigError(prefix + self.key, self.value, self.expected)


def check_fields(obj, checks: Iterable[tuple[str, bool, str]], where: str) -> None:
    """Raise the ConfigError of the first failed (field, ok, expected) check of `obj` (a dotted field names a nested
    value, e.g. "adv.horizon")."""
    for field, ok, expected in checks:
        if not ok:
            value = obj
            for part in field.split("."):
                value = getattr(value, part)
            raise ConfigError(field, value, expected, where=where)


def unknown_key(key: str, known: Iterable[str]) -> str:
    """'unknown key 'es.sigmaa' (did you mean 'es.sigma'?)' — the nearest known key of the same section; for a key
    that was renamed, its new name."""
    if key in RENAMED:
        return f"config: key '{key}' is now '{RENAMED[key]}'"
    if any(k.startswith(key + ".") for k in RENAMED):
        renamed = sorted({RENAMED[k].rsplit(".", 1)[0] for k in RENAMED if k.startswith(key + ".")})
        return f"config: section '{key}' is now {', '.join(map(repr, renamed))}"
    known = sorted(known)
    prefix, _, name = key.rpartition(".")
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean '{prefix + '.' if prefix else ''}{close[0]}'?" if close else f"known: {', '.join(known)}"
    return f"config: unknown key '{key}' ({hint})"


# ---- options registered beside an implementation


class Options(dict):
    """The options of registered implementations, by name: `grpo.adv` ({estimator: its options}),
    `grpo.variant_options`, `es.shaping_options`. An implementation registers its own frozen options dataclass beside
    its code (`esroll.registry.Registry.add(..., options=)`), so adding one with a hyperparameter edits no config
    module; this module, which cannot see the registries, keeps each section as the config file wrote it (a mapping
    of mappings), and `esroll.experiment.check_names` builds every registered name's dataclass from it (refusing
    unknown names and keys with the nearest one) and fills in the defaults of those not set.

    Immutable and hashable like the frozen dataclasses around it (compiled programs are cached per config)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for key, value in dict.items(self):
            dict.__setitem__(self, key, _frozen(value))

    def __hash__(self):  # type: ignore[override]
        return hash(tuple(sorted(self.items())))

    def __reduce__(self):
        return type(self), (dict(self),)

    def _immutable(self, *args, **kwargs):
        raise TypeError("config options are immutable: build a new Options (or use dataclasses.replace)")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _immutable  # type: ignore


def _frozen(value: Any) -> Any:
    """A config file's value as an immutable one: mappings as `Options`, lists as tuples."""
    if isinstance(value, Options) or dataclasses.is_dataclass(value):
        return value
    if hasattr(value, "items"):  # a dict or an ml-collections ConfigDict
        return Options({k: v for k, v in value.items()})
    if isinstance(value, list):
        return tuple(value)
    return value


# Keys renamed when estimators and variants took their options beside their code: old dotted key -> new one. A
# config file or command line that sets an old key is refused with one line naming the new one; a run's saved
# config.json written with the old keys is read through `migrate`, so the run resumes.
RENAMED = {
    **{
        f"grpo.adv.{old}": f"grpo.adv.agrae.{new}"
        for old, new in (
            ("horizon", "horizon"),
            ("agrae_positive", "positive"),
            ("agrae_positive_final", "positive_final"),
            ("agrae_focus", "focus"),
        )
    },
    "grpo.adv.cluster_key": "grpo.adv.bv_blend.cluster_key",
    **{f"grpo.adv.bv_{k}": f"grpo.adv.bv_blend.{k}" for k in ("clusters", "decay", "blend_max", "sem", "prior_var")},
    "grpo.adv.gmae_context": "grpo.adv.gmae.context",
    "grpo.adv.gmae_max_contexts": "grpo.adv.gmae.max_contexts",
    "grpo.adv.maxpo_k": "grpo.adv.maxpo.k",
    "grpo.adv.lampo_temperature": "grpo.adv.lampo.temperature",
    **{f"grpo.adv.ntf_{k}": f"grpo.adv.ntf.{k}" for k in ("baseline", "decay", "normalize", "filter_prob")},
    **{f"grpo.adv.ddrl_{k}": f"grpo.adv.ddrl.{k}" for k in ("low", "high", "value")},
    **{
        f"grpo.stare.{k}": f"grpo.variant_options.stare.{k}"
        for k in ("quantile", "alpha", "entropy_low", "entropy_high")
    },
    **{f"grpo.acpo.{k}": f"grpo.variant_options.acpo.{k}" for k in ("edges", "scale", "min", "max")},
    "grpo.progress.coef": "grpo.variant_options.progress.coef",
}
_ADDED_SECTIONS = ("es.shaping_options", "grpo.variant_options")  # empty in a config.json that predates them


def migrate(config: dict) -> dict:
    """A saved config.json (nested dicts) with every `RENAMED` key moved to its new place and the sections added
    since present; a config without old keys comes back equal."""
    flat = dotted(config)
    if not any(k in RENAMED for k in flat):
        return config
    out = nested({RENAMED.get(key, key): value for key, value in flat.items()})
    for key in _ADDED_SECTIONS:
        section, name = key.split(".")
        out.setdefault(section, {}).setdefault(name, {})
    return out


# ---- schedules of the learning rate and of ES's σ

SCHEDULES = ("constant", "linear", "cosine")


def dotted(d: dict, prefix: str = "") -> dict[str, Any]:
    """{dotted key: leaf value} of a nested dict, keys as a config file spells them ("es.sigma")."""
    out = {}
    for k, v in d.items():
        out.update(dotted(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def nested(flat: dict[str, Any]) -> dict:
    """The inverse of `dotted`: {"optimizer.lr": 1e-3} -> {"optimizer": {"lr": 1e-3}}."""
    out: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def make_schedule(kind: str, start: float, final: float, horizon: int, warmup: int = 0) -> float | optax.Schedule:
    """The schedule as optax takes it (see `esroll.schedules`): a plain float when it is constant with no warm-up
    (the optimizer state is then the same as without a schedule), else a function of the step (int, traced or not)."""
    import optax  # imports JAX: not at module import (see the module docstring)

    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r} (expected one of {', '.join(SCHEDULES)})")
    if kind == "constant":
        if not warmup:
            return start
        decay = optax.constant_schedule(start)
    elif kind == "linear":
        decay = optax.linear_schedule(start, final, horizon - warmup)
    else:
        decay = optax.cosine_decay_schedule(start, horizon - warmup, alpha=final / start)
    if not warmup:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, start, warmup), decay], [warmup])


# ---- the sections of an experiment config


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
    scan_unroll: how many layers one iteration of the layer `lax.scan` runs (its `unroll`); 1 keeps the program one
    layer long; more can speed small models, the computed values are the same.
    decode_phases: the decode loop's phases (the KV cache grows between them)."""

    model: int = 1
    rows_per_device: int = 0
    memory_fraction: float = 0.9
    scan_unroll: int = 1
    decode_phases: int = 4


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """task: arithmetic | countdown | gsm8k | gsm_symbolic, or a task registered with `esroll.data.register_task`
    (which reads from this section what it needs). gsm8k reads `path` (a JSONL/Parquet file or a `datasets`
    name) and `eval_path` (empty: split `eval_size` rows off the training data). Synthetic tasks generate `n_examples`
    rows from `seed` with `digits`, `ops`, `n_terms`, `word_problems` (arithmetic) or `countdown_numbers`;
    gsm_symbolic generates `n_examples` GSM-Symbolic problems (reasoning-gym), `eval_size` of them from held-out
    templates. template: plain | chat (the tokenizer's chat template, with `system` as the system message).
    `seed` fixes the data and the split; `order_seed` (-1: `seed`) only the order of the training batches, so a
    comparison can vary the order without moving any question between the splits. The first `validation_size`
    held-out questions are the validation split and the rest the test split; `eval_split` (test | validation) is
    the one held-out evaluation scores (with validation_size 0, test is the whole held-out set).
    min_difficulty (-1: off) keeps only examples at least that hard in both splits (arithmetic sums: their carries).
    reward: gold (the task's own reward: its answer key or rules) | majority (label-free, test-time RL: a completion
    is rewarded for agreeing with the majority answer of the completions of its prompt; the gold answer is then used
    only for evaluation) | a reward function registered with `esroll.rewards.register_reward`. Held-out evaluation
    always scores the task's own reward. In ES the majority vote is over every member's completions, so a member's
    fitness depends on the other members' perturbations and the estimators are no longer unbiased (docs/theory.md).
    task, reward and template are names of `esroll.data.TASKS`, `esroll.rewards.REWARDS` (and majority) and
    `esroll.data.TEMPLATES`, checked by `esroll.experiment.check_names`."""

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
    def label_free(self) -> bool:
        """Whether training rewards come from a vote among a prompt's completions (`reward = "majority"`) rather than
        a reward function: the one place that decides it."""
        return self.reward == LABEL_FREE

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
    `eval_every` steps, a checkpoint every `checkpoint_every`; `export` writes the final model to workdir/final.

    diagnostics_every: every this many steps (0: never), the step also logs its estimator's diagnostics
    (`esroll.diagnostics`: split-half signal-to-noise per leaf group, ES's effective update rank); they never feed
    the update. diagnostics_pg: on those steps an ES run also samples GRPO-style completions from its current
    weights and logs the cosine between its estimate and their policy gradient (one extra rollout and backward)."""

    steps: int = 70
    time_budget_s: float = 0.0
    prompts_per_step: int = 32
    max_new_tokens: int = 6
    temperature: float = 0.0
    eval_every: int = 10
    checkpoint_every: int = 10
    export: bool = True
    diagnostics_every: int = 0
    diagnostics_pg: bool = False


@dataclasses.dataclass(frozen=True)
class ESSettings:
    """The ES settings a config file's `es` section holds (the estimator, `method`, is the experiment's top level).

    These defaults are the only ones: config files start from them (`configs/default.py`) and set what differs.
    population: members M per step. rank: r of E = ABᵀ/√r. sigma: perturbation radius (member i is θ ± σ·E_i); it
    follows `sigma_schedule` (`esroll.schedules`: constant | linear | cosine) to `sigma_final` over `sigma_horizon`
    steps, the same σ_t in the members' perturbation and in the estimator's 1/σ.
    shaping: a name in `esroll.es.shaping.SHAPINGS`, applied to the fitness before the estimator (raw keeps it
    unbiased; zscore makes the update independent of the reward scale).
    How rewards become a member's fitness: each member answers each of the step's prompts `samples` times (K; more
    than 1 needs train.temperature > 0), `sample_reduce` folds the K rewards (mean, or max: max@K, pass@K on 0/1
    rewards), `prompt_shaping` (a name in `esroll.es.shaping.SHAPINGS`, across the members, prompt by prompt:
    GRPO's group-relative normalisation, with the population as the group; raw: none) and the mean over prompts.
    A prompt_shaping that divides by or ranks against the members' rewards (zscore, grpo, grpo_population_std,
    centered_ranks) makes each member's fitness depend on the other members' perturbations, which breaks the
    independence that LOO-ROLL's unbiasedness rests on (and antithetic EGGROLL's, docs/theory.md); dr_grpo and rloo
    shift every member's fitness alike (rloo also scales it by M/(M − 1) when every reward is finite), which leaves
    the estimator's weights as raw gives them. Label-free rewards (data.reward = majority) couple the members the
    same way.
    shaping_options: the options of the shapings that registered some, by name (`es.shaping_options.<name>.<key>`).
    Leaf selection by path regex (see `esroll.es.noise`): defaults freeze embed / lm_head and vectors, perturb other
    matrices.
    chunk_size: directions per chunk when `tell` sums the update (0: all at once).
    min_valid_fraction: non-finite fitness is dropped (see `esroll.es.estimators`); a step keeping fewer members than
    this fraction of the population is skipped.
    """

    population: int = 64
    rank: int = 1
    sigma: float = 1e-3
    sigma_schedule: str = "constant"
    sigma_final: float = 0.0
    sigma_horizon: int = 0
    shaping: str = "zscore"
    samples: int = 1
    sample_reduce: str = "mean"
    prompt_shaping: str = "raw"
    shaping_options: Options = Options()
    lowrank_patterns: tuple[str, ...] = (".*",)
    dense_patterns: tuple[str, ...] = ()
    frozen_patterns: tuple[str, ...] = ("embed", "lm_head")
    chunk_size: int = 0
    min_valid_fraction: float = 0.5

    def __post_init__(self):
        checks = [
            ("population", self.population >= 2, ">= 2"),
            ("rank", self.rank >= 1, ">= 1"),
            ("sigma", self.sigma > 0 and math.isfinite(self.sigma), "a positive finite number"),
            ("sigma_schedule", self.sigma_schedule in SCHEDULES, f"one of {', '.join(SCHEDULES)}"),
            (
                "sigma_final",
                self.sigma_schedule == "constant" or (self.sigma_final > 0 and math.isfinite(self.sigma_final)),
                "a positive finite number (the estimator divides by σ)",
            ),
            ("sigma_horizon", self.sigma_schedule == "constant" or self.sigma_horizon >= 1, ">= 1 with a schedule"),
            ("samples", self.samples >= 1, ">= 1"),
            ("sample_reduce", self.sample_reduce in ("mean", "max"), "mean or max"),
            ("chunk_size", self.chunk_size >= 0, ">= 0 (0: all directions at once)"),
            ("min_valid_fraction", 0 <= self.min_valid_fraction <= 1, "in [0, 1]"),
        ]
        for field in ("lowrank_patterns", "dense_patterns", "frozen_patterns"):
            patterns = getattr(self, field)
            ok = isinstance(patterns, tuple) and all(isinstance(p, str) and _compiles(p) for p in patterns)
            checks.append((field, ok, "a tuple of valid regular expressions"))
        check_fields(self, checks, type(self).__name__)


@dataclasses.dataclass(frozen=True)
class ESConfig(ESSettings):
    """What an ES step does: the settings plus the estimator, `method`, a name in `esroll.es.estimators.METHODS`:
    "eggroll" (antithetic pairs, population even) or "looroll" (one evaluation per direction, leave-one-out
    baseline). `esroll.es.make_strategy` refuses a method or shaping that names no implementation."""

    method: str = "looroll"

    def __post_init__(self):
        super().__post_init__()
        if self.method == "eggroll" and self.population % 2:
            raise ConfigError("population", self.population, "even for eggroll (antithetic pairs)", where="ESConfig")

    @classmethod
    def of(cls, method: str, settings: ESSettings) -> ESConfig:
        return cls(method=method, **{f.name: getattr(settings, f.name) for f in dataclasses.fields(ESSettings)})

    @property
    def num_directions(self) -> int:
        """E, the directions of a step: M/2 antithetic pairs for eggroll, M for every other estimator (as
        `esroll.es.estimators.num_directions`)."""
        return self.population // 2 if self.method == "eggroll" else self.population


def _compiles(pattern: str) -> bool:
    try:
        re.compile(pattern)
    except re.error:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """GRPO settings (a config file's `grpo` section, `esroll.grpo`). Each step samples `group_size` completions per
    prompt at `temperature`, then takes `inner_iterations` (μ) passes of `minibatches` optimizer steps each; a
    minibatch's gradient is summed over `microbatches` (a memory knob only, except under ACPO, whose bounds are per
    microbatch). advantage: a registered group-advantage estimator (`esroll.grpo.advantages.ESTIMATORS`: "grpo" is TRL's
    scale_rewards="group"; rloo, dr_grpo, agrae, bv_blend, gmae, maxpo, lampo, ntf, ddrl, ...); `adv` holds the
    options of every estimator that registered some, by name (`grpo.adv.agrae.positive`), and the run's estimator
    reads its own; group_size 1 only for the single-rollout estimators (ntf). aggregation: a name of
    `esroll.grpo.AGGREGATIONS` (see `esroll.grpo.token_weights`); beta: weight of the k3 KL to the initial policy
    (0 keeps no reference model).

    variants: registered modifications of the plain step and loss (`esroll.grpo.variants.VARIANTS`), applied in this
    order: "stare" (token reweighting behind an entropy gate), "acpo" (a clip range per token group), "progress" (the
    progress advantage); their options are in `variant_options`, by name (`grpo.variant_options.stare.alpha`). None
    by default, and then the loss is bit-identical to plain GRPO's.

    Memory knobs (the update is the same whatever their values, to float rounding): remat, what the backward pass
    keeps of each decoder layer ("none": everything, including every layer's float32 attention scores; "full": only
    its input, the residual stream, recomputing the layer; "dots": that and the weight matmuls' outputs; see
    `esroll.models.transformer.REMAT_POLICIES`); logprob_chunk, the completion positions whose [rows, chunk, vocab]
    float32 logits exist at once when scoring (0 = all max_new_tokens at once).

    The names (advantage, variants, aggregation, remat), the registered options and the group size an estimator needs
    are checked by `esroll.grpo.check_names` and `esroll.experiment.check_names`."""

    group_size: int = 8
    advantage: str = "grpo"
    adv: Options = Options()
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    inner_iterations: int = 1
    minibatches: int = 1
    microbatches: int = 1
    beta: float = 0.0
    aggregation: str = "seq_mean_token_mean"
    temperature: float = 1.0
    remat: str = "full"
    logprob_chunk: int = 64
    variants: tuple[str, ...] = ()
    variant_options: Options = Options()

    def __post_init__(self):
        checks = [
            ("group_size", self.group_size >= 1, ">= 1"),
            ("variants", len(set(self.variants)) == len(self.variants), "each variant named once"),
            ("temperature", self.temperature > 0, "> 0"),
            ("epsilon_low", 0 <= self.epsilon_low < 1, "in [0, 1)"),
            ("epsilon_high", self.epsilon_high >= 0, ">= 0"),
            ("inner_iterations", self.inner_iterations >= 1, ">= 1"),
            ("minibatches", self.minibatches >= 1, ">= 1"),
            ("microbatches", self.microbatches >= 1, ">= 1"),
            ("beta", self.beta >= 0, ">= 0"),
            (
                "logprob_chunk",
                isinstance(self.logprob_chunk, int)
                and not isinstance(self.logprob_chunk, bool)
                and self.logprob_chunk >= 0,
                "an integer >= 0 (0 = all positions at once)",
            ),
        ]
        check_fields(self, checks, "GRPOConfig")


@dataclasses.dataclass(frozen=True)
class CurriculumConfig:
    """A config file's `curriculum` section (`esroll.curriculum`; both methods off by default).

    ads: adaptive data scheduling; ads_cluster_key: the clusters (`esroll.data.cluster_key`: difficulty, task or a
    meta field); ads_temperature: β of the cluster weights; ads_decay: EMA decay of the success estimates;
    ads_candidates: candidates drawn per prompt kept (boundary selection; 1: none).
    prefix: AdaPrefix; prefix_source: a name of `esroll.curriculum.PREFIX_SOURCES`, solution (the worked solution) or
    target (the direct answer, `target_text`); prefix_target: the success rate the controller holds; prefix_gain:
    tokens of prefix per unit of success error; prefix_init: the starting k as a fraction of each solution's length;
    prefix_horizon: the step from which no prefix is given (linear withdrawal from step 0).
    """

    ads: bool = False
    ads_cluster_key: str = "difficulty"
    ads_temperature: float = 2.0
    ads_decay: float = 0.8
    ads_candidates: int = 2
    prefix: bool = False
    prefix_source: str = "solution"
    prefix_target: float = 0.5
    prefix_gain: float = 2.0
    prefix_init: float = 0.0
    prefix_horizon: int = 100

    def __post_init__(self):
        checks = [
            ("ads_temperature", self.ads_temperature >= 0, ">= 0"),
            ("ads_decay", 0 <= self.ads_decay < 1, "in [0, 1)"),
            ("ads_candidates", self.ads_candidates >= 1, ">= 1"),
            ("prefix_target", 0 < self.prefix_target < 1, "in (0, 1)"),
            ("prefix_gain", self.prefix_gain > 0, "> 0"),
            ("prefix_init", 0 <= self.prefix_init <= 1, "in [0, 1]"),
            ("prefix_horizon", self.prefix_horizon >= 1, ">= 1"),
        ]
        check_fields(self, checks, "CurriculumConfig")

    @property
    def active(self) -> bool:
        return self.ads or self.prefix


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """method: an ES estimator (looroll | eggroll, settings in `es`) or grpo (settings in `grpo`). seed: the method's
    randomness (noise, sampling); `data.seed` fixes the data. curriculum: what each step trains on
    (`esroll.curriculum`: adaptive data scheduling, AdaPrefix), for every method. parallel: the device layout (mesh
    model axis, rollout chunks). distributed: start `jax.distributed` (multi-host; one process per host, see the
    README). `validate` checks structure and ranges; `esroll.experiment.check_names` the registered names."""

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
        """The ES configuration of an ES method (`method` an ES estimator)."""
        return ESConfig.of(self.method, self.es)

    def validate(self) -> ExperimentConfig:
        """`self` if its values agree with each other and lie in range; else raise the ConfigError of the first that
        does not, naming its key. Names are not checked here (`esroll.experiment.check_names`)."""
        rows = self.train.prompts_per_step * self.grpo.group_size  # completions sampled per GRPO step
        checks = [
            ("model.path", bool(self.model.path), "a local model folder (--config.model.path=DIR) or a Hub id"),
            ("model.dtype", self.model.dtype in DTYPES, f"one of {', '.join(DTYPES)}"),
            ("model.master_dtype", self.model.master_dtype in DTYPES, f"one of {', '.join(DTYPES)}"),
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
                "method",
                self.method == "grpo" or not self.grpo.variants,
                "grpo for grpo.variants (they change GRPO's step and loss; ES has neither)",
            ),
            (
                "grpo.group_size",
                self.method != "grpo" or not self.data.label_free or self.grpo.group_size >= 2,
                ">= 2 with data.reward='majority' (a vote needs a group)",
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
                self.method == "grpo" or self.es.samples == 1 or self.train.temperature > 0,
                "1 when train.temperature is 0 (greedy decoding gives K identical answers)",
            ),
            ("train.checkpoint_every", self.train.checkpoint_every >= 1, ">= 1"),
            ("train.diagnostics_every", self.train.diagnostics_every >= 0, ">= 0 (0: no diagnostics)"),
            (
                "train.diagnostics_pg",
                not self.train.diagnostics_pg or (self.method != "grpo" and self.train.diagnostics_every > 0),
                "False unless an ES method logs diagnostics (train.diagnostics_every > 0); GRPO's estimate is the "
                "policy gradient",
            ),
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
        check_fields(self, checks, "config")
        if self.method != "grpo":
            try:
                self.es_config  # what the ES method adds to the settings (eggroll: an even population)
            except ConfigError as e:
                raise e.under("es.") from None
            directions = self.es_config.num_directions
            least = 2 if self.method == "eggroll" else 4
            if self.train.diagnostics_every and (directions % 2 or directions < least):
                raise ConfigError(
                    "es.population",
                    self.es.population,
                    f"a population of an even number of directions, at least {least}, for the split-half "
                    f"diagnostics (train.diagnostics_every > 0); {self.method} has {directions}",
                )
        elif self.train.diagnostics_every and self.train.prompts_per_step < 2:
            raise ConfigError(
                "train.prompts_per_step", 1, ">= 2 for GRPO's split-half diagnostics (train.diagnostics_every > 0)"
            )
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


# ---- config files


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
