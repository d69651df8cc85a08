"""The check of an experiment config's names against the registries of the modules that implement them.

`esroll.config` imports nothing from esroll, so `from_config_dict` checks a config's structure and ranges but cannot
see which ES methods, fitness shapings, advantage estimators, aggregations, remat policies, tasks, rewards, prompt
templates or prefix sources exist: each registry lives with its implementation, where later code can add to it (the
public `register_*` functions of `esroll.data`, `esroll.rewards` and `esroll.advantages`), so a name registered by
the user's own module before the config is checked is accepted like a built-in one. `check_names`
checks those keys, and the options whose meaning depends on what a name implements, once the config is built. The
trainer runs it first thing (`esroll.train.train_and_evaluate`), and so does every entry point right after
`from_config_dict`, so that a bad name is refused with one line naming its key before anything runs or is written.
"""

from __future__ import annotations

from esroll import advantages, curriculum, grpo, rewards
from esroll.config import ConfigError, ExperimentConfig, check_fields
from esroll.data import TASKS, TEMPLATES
from esroll.es import estimators, strategy

METHODS = (*estimators.METHODS, "grpo")


def check_names(cfg: ExperimentConfig) -> ExperimentConfig:
    """`cfg` when every name-valued key names a registered implementation and the options that depend on what a name
    implements agree with it; else raise the one-line ConfigError of the first that does not, naming the key as a
    config file spells it ("config: invalid value for 'es.shaping': 'foo' (expected one of ...)")."""
    task = TASKS.get(cfg.data.task)
    reward_names = rewards.reward_names()
    checks = [
        ("method", cfg.method in METHODS, f"one of {', '.join(METHODS)}"),
        ("data.task", task is not None, f"one of {', '.join(TASKS)}"),
        ("data.template", cfg.data.template in TEMPLATES, f"one of {', '.join(TEMPLATES)}"),
        ("data.reward", cfg.data.reward in reward_names, f"one of {', '.join(reward_names)}"),
        (
            "data.reward",
            cfg.data.reward != rewards.LABEL_FREE or task is None or task.parse_answer is not None,
            f"'gold' or a registered reward for data.task={cfg.data.task!r} (label-free rewards vote on parsed "
            "answers, and this task parses none)",
        ),
        (
            "curriculum.prefix_source",
            cfg.curriculum.prefix_source in curriculum.PREFIX_SOURCES,
            f"one of {', '.join(curriculum.PREFIX_SOURCES)}",
        ),
    ]
    check_fields(cfg, checks, "config")
    for prefix, check, section in (("es.", strategy.check_names, cfg.es), ("grpo.", grpo.check_names, cfg.grpo)):
        try:
            check(section)
        except ConfigError as e:
            raise e.under(prefix) from None
    label_free_only = cfg.method == "grpo" and cfg.grpo.advantage in advantages.LABEL_FREE_ONLY
    if label_free_only and cfg.data.reward != "majority":
        expected = (
            f"an estimator that reads gold rewards, or data.reward='majority' ({cfg.grpo.advantage} is label-free only)"
        )
        raise ConfigError("grpo.advantage", cfg.grpo.advantage, expected)
    return cfg
