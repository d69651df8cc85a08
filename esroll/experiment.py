"""The check of an experiment config's names against the registries of the modules that implement them.

`esroll.config` imports nothing from esroll but its leaves (`esroll.errors`, `esroll.schedules`), so `from_config_dict`
checks a config's structure and ranges but cannot see which methods, ES estimators, fitness shapings, advantage
estimators, aggregations, remat policies, tasks, rewards, prompt templates, environments, step verifiers or prefix
sources exist: each registry lives with its implementation, where later code can add to it (the public `register_*`
functions of `esroll.data`, `esroll.rewards`, `esroll.es.shaping`, `esroll.es.estimators`, `esroll.grpo`,
`esroll.agents` and `esroll.steps`), so a name registered by the user's own module before the config is checked is
accepted like a built-in one. `check_names`
checks those keys, and the options whose meaning depends on what a name implements, once the config is built. The
trainer runs it first thing (`esroll.train.train_and_evaluate`), and so does every entry point right after
`from_config_dict`, so that a bad name is refused with one line naming its key before anything runs or is written.
"""

from __future__ import annotations

import dataclasses
import json

from esroll import agents, curriculum, grpo, methods, rewards
from esroll.grpo import advantages, variants as grpo_variants
from esroll.config import (
    ConfigError,
    ExperimentConfig,
    InputError,
    check_fields,
    config_dict,
    dotted,
    from_config_dict,
    migrate,
)
from esroll.data import TASKS, TEMPLATES
from esroll.data.tasks import TASK_KNOBS
from esroll.agents import ENVIRONMENTS
from esroll.es import shaping, strategy
from esroll.steps import STEP_VERIFIERS


# The options sections of the config (`esroll.config.Options`) and the registries whose entries bring them.
OPTION_SECTIONS = (
    (("grpo", "adv"), advantages.ESTIMATORS),
    (("grpo", "variant_options"), grpo_variants.VARIANTS),
    (("es", "shaping_options"), shaping.SHAPINGS),
    (("data", "options"), TASKS),
    (("env", "options"), ENVIRONMENTS),
)


def resolve_options(cfg: ExperimentConfig) -> ExperimentConfig:
    """`cfg` with every options section complete and typed: {registered name: its options dataclass}, built from what
    the config sets (an unknown name or key refused with one line naming the nearest) and the defaults of the rest."""
    for (section, field), registry in OPTION_SECTIONS:
        part = getattr(cfg, section)
        resolved = registry.resolve(getattr(part, field))
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(part, **{field: resolved})})
    return cfg


def as_current(saved: dict) -> dict:
    """A run's saved config.json (nested dicts) as the current code reads it: keys renamed since moved to their new
    places (`esroll.config.migrate`) and the options of implementations registered since the run was saved filled in
    at their defaults, so that comparing it with the current config of the same run finds no difference. A saved
    config the current code refuses comes back migrated only (the comparison then names what differs)."""
    migrated = migrate(saved)
    try:
        cfg = check_names(from_config_dict(migrated))
    except InputError:
        return migrated
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def default_config():
    """The ConfigDict config files start from: every default of `esroll.config`, and the options of every
    registered estimator, variant and shaping at their defaults (`grpo.adv.agrae.positive`), so that a config file
    or a `--config.KEY=VALUE` override can set them. An implementation registered after this call is not in it;
    `check_names` still fills in its defaults."""
    return config_dict(resolve_options(ExperimentConfig()))


def check_names(cfg: ExperimentConfig) -> ExperimentConfig:
    """`cfg` with its options sections resolved (`resolve_options`) when every name-valued key names a registered
    implementation and the options that depend on what a name implements agree with it; else raise the one-line
    ConfigError of the first that does not, naming the key as a config file spells it ("config: invalid value for
    'es.shaping': 'foo' (expected one of ...)")."""
    cfg = resolve_options(cfg)
    task = TASKS.get(cfg.data.task)
    reward_names = rewards.reward_names()
    checks = [
        ("method", cfg.method in methods.names(), methods.expected()),
        ("data.task", task is not None, TASKS.expected()),
        ("data.template", cfg.data.template in TEMPLATES, f"one of {', '.join(TEMPLATES)}"),
        ("data.reward", cfg.data.reward in reward_names, f"one of {', '.join(reward_names)}"),
        (
            "data.reward",
            not cfg.data.label_free or task is None or task.parse_answer is not None,
            f"'gold' or a registered reward for data.task={cfg.data.task!r} (label-free rewards vote on parsed "
            "answers, and this task parses none)",
        ),
        ("env.name", not cfg.env.name or cfg.env.name in ENVIRONMENTS, f"'' (off) or {ENVIRONMENTS.expected()}"),
        ("steps.verifier", cfg.steps.verifier in STEP_VERIFIERS, STEP_VERIFIERS.expected()),
        (
            "curriculum.prefix_source",
            cfg.curriculum.prefix_source in curriculum.PREFIX_SOURCES,
            f"one of {', '.join(curriculum.PREFIX_SOURCES)}",
        ),
    ]
    check_fields(cfg, checks, "config")
    for prefix, check, section in (
        ("es.", strategy.check_es_names, cfg.es),
        ("grpo.", grpo.check_grpo_names, cfg.grpo),
    ):
        try:
            check(section)
        except ConfigError as e:
            raise e.under(prefix) from None
    methods.lookup(cfg).check(cfg)  # what the method needs of the other sections
    agents.check_config(cfg)  # what episodes need of them (env.name set)
    return cfg


def unread_keys(cfg: ExperimentConfig) -> dict[str, str]:
    """{key: why} for each config key (dotted, as a config file spells it) that the run of `cfg` never reads: the
    other method family's section, the data knobs its task does not read (`esroll.data.TaskSpec.reads`), the options
    of advantage estimators and GRPO variants it does not use, the settings of curriculum methods that are off, and
    schedule settings of constant schedules. `experiments.train` refuses such a key set on the command line (a user
    who sets it expects it to act) and `--print_config` marks the config file's. Keys whose use cannot be told from
    the registries (a user's task or estimator that declares nothing) count as read."""
    # a key, or a section ending in ".", -> why the run does not read it; first the method's own (`MethodSpec.unread`)
    rules: dict[str, str] = dict(methods.lookup(cfg).unread(cfg))
    for name in ENVIRONMENTS:
        if name != cfg.env.name:
            rules[f"env.options.{name}."] = f"only env.name {name!r} reads it, and this run's is {cfg.env.name!r}"
    if not cfg.env.name:
        for key in ("env.max_action_tokens", "env.max_observation_tokens", "env.reflect_tokens"):
            rules[key] = "only agent runs read it, and env.name is '' (off)"
    else:
        for field in dataclasses.fields(cfg.data):
            if field.name not in agents.DATA_KEYS:
                rules[f"data.{field.name}" + ("." if field.name == "options" else "")] = (
                    f"env.name {cfg.env.name!r} trains on episodes, not on data.task's questions"
                )
    for name in TASKS:
        if name != cfg.data.task:
            rules[f"data.options.{name}."] = f"only data.task {name!r} reads it, and this run's is {cfg.data.task!r}"
    task = TASKS.get(cfg.data.task)
    if task is not None and task.reads is not None and not cfg.env.name:
        for knob in TASK_KNOBS:
            if knob not in task.reads:
                rules[f"data.{knob}"] = f"data.task {cfg.data.task!r} does not read it"
    c = cfg.curriculum
    for on, part, what in ((c.ads, "ads_", "adaptive data scheduling"), (c.prefix, "prefix_", "AdaPrefix")):
        if not on:
            for field in dataclasses.fields(c):
                if field.name.startswith(part):
                    rules[f"curriculum.{field.name}"] = f"only {what} reads it, and curriculum.{part[:-1]} is False"
    o = cfg.optimizer
    if o.schedule == "constant":
        rules["optimizer.lr_final"] = "a constant optimizer.schedule does not read it"
        if not o.warmup_steps:
            rules["optimizer.horizon"] = "a constant optimizer.schedule without warm-up does not read it"
    if o.name != "adamw":
        rules["optimizer.weight_decay"] = f"only optimizer.name 'adamw' reads it, and this run's is {o.name!r}"
    unread = {}
    for key in dotted(dataclasses.asdict(cfg)):
        why = rules.get(key) or next((w for k, w in rules.items() if k.endswith(".") and key.startswith(k)), None)
        if why:
            unread[key] = why
    return unread
