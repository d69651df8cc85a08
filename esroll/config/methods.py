"""The sections of the two method families: ES (`ESSettings`, and `ESConfig`, what an ES step does) and GRPO
(`GRPOConfig`)."""

from __future__ import annotations

import dataclasses
import math
import re

from esroll.config.keys import Options
from esroll.errors import check_fields
from esroll.schedules import SCHEDULES


TEACHER_FITNESS = ("log_ratio", "log_likelihood")  # `ESSettings.teacher_fitness`


@dataclasses.dataclass(frozen=True)
class ESSettings:
    """The ES settings a config file's `es` section holds (the estimator, `method`, is the experiment's top level).

    These defaults are the only ones: config files start from them (`configs/default.py`) and set what differs.
    population: members M per step. rank: r of E = ABᵀ/√r. sigma: perturbation radius (member i is θ ± σ·E_i); it
    follows `sigma_schedule` (`esroll.schedules`: constant | linear | cosine) to `sigma_final` over `sigma_horizon`
    steps, the same σ_t in the members' perturbation and in the estimator's 1/σ.
    shaping: a name in `esroll.es.shaping.SHAPINGS`, applied to the fitness before the estimator (raw keeps it
    unbiased; zscore makes the update independent of the reward scale).
    How rewards become a member's fitness: each member answers each of the step's prompts `samples` times (A; more
    than 1 needs train.temperature > 0), `sample_reduce` folds the A rewards (mean, or max: max@A, pass@A on 0/1
    rewards), `prompt_shaping` (a name in `esroll.es.shaping.SHAPINGS`, across the members, prompt by prompt:
    GRPO's group-relative normalisation, with the population as the group; raw: none) and the mean over prompts.
    A prompt_shaping that divides by or ranks against the members' rewards (zscore, grpo, grpo_population_std,
    centered_ranks) makes each member's fitness depend on the other members' perturbations, which breaks the
    independence that LOO-ROLL's unbiasedness rests on (and antithetic EGGROLL's, docs/theory.md); dr_grpo and rloo
    shift every member's fitness alike (rloo also scales it by M/(M − 1) when every reward is finite), which leaves
    the estimator's weights as raw gives them. Label-free rewards (data.reward = majority) couple the members the
    same way.
    step_weight: a dense step fitness, w in [0, 1]: each row's reward becomes (1 − w)·outcome + w·(the mean of its
    steps' verifier scores; `steps.boundary`, `steps.max_steps`, `steps.verifier`; a completion with no step scores
    0), before the samples are reduced. 0: the outcome alone. The mixed reward is still a function of the member's
    own completion, so the estimators stay unbiased for the mixed objective (not for the outcome's).
    teacher_weight: a teacher fitness, w in [0, 1] (`teacher.path` names the teacher): each row's reward becomes
    (1 − w)·reward + w·(its teacher score), after `step_weight`'s mix and before the samples are reduced. The score
    is a mean over the row's completion tokens (EOS included) of `teacher_fitness`: log_ratio, log π_T − log π_i
    (π_i the member's own perturbed model at temperature 1: the negative of a one-sample reverse-KL estimate, so the
    fitness rewards members whose samples the teacher finds likely and who are not over-confident in them), or
    log_likelihood, log π_T alone. 0: no teacher. Like the step fitness, the score is a function of the member's own
    samples, so the estimators stay unbiased for the mixed objective; ES needs no gradient of it, so there is no
    stop-gradient question (docs/distillation.md).
    svm_weight: a dense fitness for episodes (env runs) from Success Visitation Matching, λ >= 0: each episode's
    return gains λ·Σ_t clip_β(f̂(s_t, a_t)), the logits of a discriminator of the state–actions that the step's
    solved episodes visit against those its others visit, fitted on the population's episodes of each seed
    (`esroll.agents.visitation`, β = its `CLIP`). 0: the return alone. The discriminator reads every member's
    episodes, so a member's fitness depends on the others' perturbations, as with `prompt_shaping`'s coupling ones.
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
    step_weight: float = 0.0
    teacher_weight: float = 0.0
    teacher_fitness: str = "log_ratio"
    svm_weight: float = 0.0
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
            ("step_weight", 0 <= self.step_weight <= 1, "in [0, 1] (the weight of the mean step score)"),
            ("teacher_weight", 0 <= self.teacher_weight <= 1, "in [0, 1] (the weight of the teacher score)"),
            ("teacher_fitness", self.teacher_fitness in TEACHER_FITNESS, f"one of {', '.join(TEACHER_FITNESS)}"),
            ("svm_weight", self.svm_weight >= 0 and math.isfinite(self.svm_weight), ">= 0 (λ of the dense reward)"),
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
    """What an ES step does: the settings plus the estimator, `method`, a name in `esroll.es.estimators.ESTIMATORS`
    ("eggroll": antithetic pairs; "looroll": one evaluation per direction, leave-one-out baseline).
    `esroll.es.make_strategy` refuses a method or shaping that names no implementation, and a population the
    estimator's members cannot fill (eggroll: odd)."""

    method: str = "looroll"

    @classmethod
    def of(cls, method: str, settings: ESSettings) -> ESConfig:
        return cls(method=method, **{f.name: getattr(settings, f.name) for f in dataclasses.fields(ESSettings)})


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
    are checked by `esroll.grpo.check_grpo_names` and `esroll.experiment.check_names`."""

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
