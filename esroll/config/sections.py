"""The sections of an experiment config that every method shares: model, device layout, data, environment, steps,
optimizer, training loop and curriculum."""

from __future__ import annotations

import dataclasses

from esroll.config.keys import Options
from esroll.errors import check_fields

ATTENTION = ("auto", "xla")  # model.attention: `esroll.models.attention.SETTINGS` (tests/models/test_attention.py)
LABEL_FREE = "majority"  # `data.reward`'s label-free mode (`DataConfig.label_free`), reserved in `esroll.rewards`


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """path: a local Hugging Face folder (or a Hub id when online). dtype: the compute dtype (what rollouts decode
    and GRPO's loss runs in; also the dtype of the exported model). master_dtype: the parameters the optimizer
    updates, its state, and checkpoints (float32 masters keep small updates that bfloat16 would round away; set it
    to the same as dtype for pure low-precision training). attention: the kernel of the attention among new tokens
    (training, scoring, prefill; `esroll.models.attention`): "auto" picks it from the platform of the mesh's devices
    (splash on a TPU, cuDNN on an NVIDIA GPU, XLA's elsewhere), "xla" keeps XLA's everywhere; the values are the same
    up to float rounding."""

    path: str = "assets/tiny-qwen3-arith"
    dtype: str = "float32"
    master_dtype: str = "float32"
    attention: str = "auto"


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
    options: the options of the tasks that registered some, by name (`data.options.arith_steps.max_operands`); a task
    reads its own. task, reward and template are names of `esroll.data.TASKS`, `esroll.rewards.REWARDS` (and majority)
    and `esroll.data.TEMPLATES`, checked by `esroll.experiment.check_names`."""

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
    options: Options = Options()

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
class EnvConfig:
    """A config file's `env` section: train on multi-turn episodes of a text environment instead of single-turn
    prompts (`esroll.agents`, docs/agents.md).

    name: "" (off: prompts from `data`) or an environment of `esroll.agents.ENVIRONMENTS` (frozenlake, sokoban, or one
    registered with `register_env`); options: the environments' options by name (`env.options.frozenlake.max_turns`),
    each environment reading its own. An episode's prompt is the environment's instructions and first observation;
    each turn the model writes an action of at most `max_action_tokens` tokens (its end token included) and the
    environment answers with at most `max_observation_tokens` (a longer answer is refused naming this key). The
    reward of a row is its episode's return; held-out "accuracy" is the share of episodes solved. With `name` set,
    `data.n_examples` is the number of training episodes (seeds 0, 1, ...), `data.eval_size` the held-out ones
    (seeds from 1,000,000, never trained on), split by `data.validation_size` / `data.eval_split` as questions are,
    and `data.order_seed` (or `data.seed`) orders the training batches; the other data keys are not read.
    reflect_tokens: 0 (off), or the room of the reflection RePro trains (`grpo.advantage = "repro"`): after each
    training episode the model rates its moves in at most this many tokens (`esroll.agents.reflect`)."""

    name: str = ""
    options: Options = Options()
    max_action_tokens: int = 4
    max_observation_tokens: int = 48
    reflect_tokens: int = 0

    def __post_init__(self):
        checks = [
            ("max_action_tokens", self.max_action_tokens >= 2, ">= 2 (a word and the end token)"),
            ("max_observation_tokens", self.max_observation_tokens >= 1, ">= 1"),
            ("reflect_tokens", self.reflect_tokens >= 0, ">= 0"),
        ]
        check_fields(self, checks, "EnvConfig")


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
    The budget is checked between steps: a run stops at the end of the first step that reaches it, so it may train
    up to one step longer. Each evaluation writes its first `eval_samples` held-out rows as text to
    workdir/samples.jsonl and TensorBoard (`esroll.samples`: completions, or whole episodes).

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
    eval_samples: int = 4
    checkpoint_every: int = 10
    export: bool = True
    diagnostics_every: int = 0
    diagnostics_pg: bool = False


@dataclasses.dataclass(frozen=True)
class StepsConfig:
    """A config file's `steps` section: how a completion is cut into reasoning steps (`esroll.steps.segment`) and how
    each step is scored (`esroll.steps.verify`), read when the method asks for steps (an advantage estimator that needs
    "steps", "step_scores" or "branches").

    boundary: the text that ends a step (it belongs to the step it ends); max_steps: later steps merge into the last;
    verifier: the step verifier (a name of `esroll.steps.verify.STEP_VERIFIERS`), read for "step_scores"; branches:
    continuations sampled from the end of each step but the last (branched rollouts, `esroll.steps.branch`), read
    for "branches"."""

    boundary: str = "\n"
    max_steps: int = 16
    verifier: str = "equations"
    branches: int = 4

    def __post_init__(self):
        checks = [
            ("boundary", bool(self.boundary), "a non-empty string"),
            ("max_steps", self.max_steps >= 1, ">= 1"),
            ("branches", self.branches >= 1, ">= 1"),
        ]
        check_fields(self, checks, "StepsConfig")


@dataclasses.dataclass(frozen=True)
class TeacherConfig:
    """A config file's `teacher` section: the model whose log-probabilities score the student's samples (on-policy
    distillation, `esroll.teacher`), read when the method asks for a teacher (an advantage estimator that needs
    "teacher", or ES with `es.teacher_weight` > 0). path: a causal LM folder sharing the student's tokenizer exactly
    (`esroll.teacher.check_tokenizer`)."""

    path: str = ""


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
