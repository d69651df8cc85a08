"""Agent tasks: training on multi-turn episodes of a text environment (`env.name`), with the loop, the methods and
the evaluation that single-turn tasks use.

An episode is a row. Its prompt is the environment's instructions and first observation; its completion is the rest
of the episode, the model's actions and the environment's answers interleaved (`esroll.agents.play`, in one KV
cache); its reward is the episode's return. The rows of a rollout (`esroll.rollout.rollout`) carry a loss mask that
is True on the model's tokens only, so GRPO gives the episode's advantage to every action token and none to the
environment's, and ES scores each member by the mean return of the episodes it played, every member playing the same
seeds. Held-out evaluation plays the held-out seeds greedily: "accuracy" is the share of episodes solved (the
environment's `solved`), beside the mean return and turns.

Episodes are named by their seed: training episodes are seeds 0 .. data.n_examples − 1, held-out ones start at
`HELD_OUT` (never trained on), split into validation and test as held-out questions are (`data.validation_size`,
`data.eval_split`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from esroll.config import ConfigError, ExperimentConfig, check_fields
from esroll.data import Example
from esroll.data.build import held_out_splits
from esroll.agents.base import ENVIRONMENTS, TextEnv
from esroll.agents.multiturn import episode_prompt
from esroll.agents.reflect import HEADER_TOKENS
from esroll.agents.rollout import episodes

HELD_OUT = 1_000_000  # the first held-out episode's seed
EPISODE = "episode"  # the `Example.task` of an episode row
# The data keys an agent task reads; the rest of `data` is not read (`esroll.experiment.unread_keys`).
DATA_KEYS = ("n_examples", "eval_size", "validation_size", "eval_split", "seed", "order_seed")


class EnvTask(NamedTuple):
    """What a rollout needs to play an environment's episodes: its registered name, options, turn limit, the token
    room of an action and of an observation, and of the reflection after a training episode (0: none) (`env.*`)."""

    name: str
    options: Any
    max_turns: int
    max_action_tokens: int
    max_observation_tokens: int
    reflect_tokens: int = 0

    def make(self) -> TextEnv:
        """A fresh environment (one per row: each holds one episode's state)."""
        return ENVIRONMENTS.lookup(self.name)(self.options)

    def rollout(self, task, params, examples, example_B, key, sampling, mesh, deltas=None, member_B=None,
                scores: bool = False):  # fmt: skip
        """The rows' episodes as a `esroll.rollout.Rollout` (`esroll.agents.episodes`): what `esroll.rollout.rollout`
        returns for an agent task."""
        return episodes(task, params, examples, example_B, key, sampling, mesh, deltas, member_B, scores)

    @property
    def max_episode_tokens(self) -> int:
        """The most tokens an episode can hold after its prompt: per turn an action and an answer, then the
        reflection's header and the reflection when there is one (`esroll.agents.reflect`)."""
        turns = self.max_turns * (self.max_action_tokens + self.max_observation_tokens)
        if not self.reflect_tokens:
            return turns
        return turns + self.max_observation_tokens + HEADER_TOKENS + self.reflect_tokens


def env_task(cfg: ExperimentConfig) -> EnvTask:
    """The `EnvTask` of `cfg.env` (its name registered, its options resolved: `esroll.experiment.check_names`)."""
    e = cfg.env
    options = ENVIRONMENTS.options_of(e.options, e.name)
    max_turns = getattr(options, "max_turns", None)
    if not isinstance(max_turns, int) or max_turns < 1:
        raise ConfigError("env.name", e.name, "an environment whose options have a max_turns >= 1 (its turn limit)")
    return EnvTask(e.name, options, max_turns, e.max_action_tokens, e.max_observation_tokens, e.reflect_tokens)


def check_config(cfg: ExperimentConfig) -> None:
    """Raise the one-line ConfigError of the first setting an agent run (`env.name` set) cannot work with: a
    completion too short for an episode, or a part of the config that reads single-turn answers (label-free votes,
    reasoning steps, the curriculum's prefixes and clusters). What a method's estimator reads of episodes is the
    method's check (`esroll.grpo.method.check_config`)."""
    if not cfg.env.name:
        return
    ENVIRONMENTS.check(cfg.env.name)
    need = env_task(cfg).max_episode_tokens
    checks = [
        (
            "train.max_new_tokens",
            cfg.train.max_new_tokens >= need,
            f">= {need} for env.name={cfg.env.name!r}: max_turns × (env.max_action_tokens + "
            "env.max_observation_tokens), the longest episode after its prompt (and its reflection's room)",
        ),
        (
            "env.reflect_tokens",
            cfg.env.reflect_tokens == 0 or cfg.method == "grpo",
            "0 unless method = 'grpo' (a reflection is trained by a policy gradient: grpo.advantage = 'repro')",
        ),
        ("data.reward", cfg.data.reward == "gold", "'gold' with env.name set (an episode's reward is its return)"),
        ("curriculum.ads", not cfg.curriculum.ads, "False with env.name set (episodes have no clusters)"),
        ("curriculum.prefix", not cfg.curriculum.prefix, "False with env.name set (episodes have no solutions)"),
        ("es.step_weight", cfg.es.step_weight == 0, "0 with env.name set (episodes have no reasoning steps)"),
        (
            "es.teacher_weight",
            cfg.es.teacher_weight == 0,
            "0 with env.name set (a teacher scores completions; an episode's environment tokens are not the model's)",
        ),
    ]
    check_fields(cfg, checks, "config")


def episode(name: str, seed: int) -> Example:
    """The row of environment `name`'s episode `seed`: what the loop batches, the curriculum orders and the rollout
    plays (`meta["seed"]`)."""
    return Example(EPISODE, f"{name} episode {seed}", "", "", "", {"seed": int(seed)})


def splits(cfg: ExperimentConfig) -> tuple[list[Example], list[Example]]:
    """(training episodes, held-out episodes of `data.eval_split`), as `esroll.data.make_splits` gives questions."""
    d = cfg.data
    train = [episode(cfg.env.name, s) for s in range(d.n_examples)]
    held_out = [episode(cfg.env.name, HELD_OUT + i) for i in range(d.eval_size)]
    validation, test = held_out_splits(held_out, d.validation_size)
    return train, validation if d.eval_split == "validation" else test


def prompt_reader(env: EnvTask, tokenizer):
    """examples -> each episode's prompt token ids (`esroll.agents.episode_prompt` of its first observation, as
    `play` writes it), cached by seed."""
    cache: dict[int, list[int]] = {}

    def prompt_ids(examples: list[Example]) -> list[list[int]]:
        out = []
        for e in examples:
            seed = e.meta["seed"]
            if seed not in cache:
                game = env.make()
                text = episode_prompt(game.instructions, game.reset(seed))
                cache[seed] = tokenizer.encode(text, add_special_tokens=False)
            out.append(cache[seed])
        return out

    return prompt_ids


def prompt_multiple(prompt_ids, train: list[Example], held_out: list[Example], sample: int = 200) -> int:
    """The padded prompt length: the longest prompt of the first `sample` training episodes and every held-out one,
    rounded up to 8 (an episode with a longer prompt pads to the next multiple and compiles once more)."""
    longest = max(len(p) for p in prompt_ids(train[:sample] + held_out))
    return 8 * -(-longest // 8)
