"""What every method shares to turn prompts into rewards: the model, tokenizer, prompt formatting and scoring."""

from __future__ import annotations

import json
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from esroll import sharding
from esroll.advantages import answer_id
from esroll.config import ExperimentConfig
from esroll.data import Example, eval_scores, format_prompt, parse_answer, score, task_spec
from esroll.models import load_hf, param_shapes
from esroll.models.hf import resolve
from esroll.rewards import LABEL_FREE, get_reward


class Task(NamedTuple):
    """Everything a method needs to turn prompts into rewards. `reward_fn` is the training reward (`data.reward`'s
    function, `esroll.rewards.register_reward`); held-out evaluation scores the task's own (`eval_scores`)."""

    cfg: Any  # ModelConfig
    tokenizer: Any
    prompt_ids: Callable[[list[Example]], list[list[int]]]
    eos_ids: tuple[int, ...]
    pad_id: int
    prompt_multiple: int
    reward_fn: Callable[[Example, str], float] = score

    def rewards(self, examples: list[Example], tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Training reward of each generated row; row j answers examples[j] (an example's prefix and the completion
        are scored as one answer)."""
        texts = self.answers(examples, tokens, lengths)
        return np.array([self.reward_fn(e, s) for e, s in zip(examples, texts)], np.float32)

    def answer_ids(self, examples: list[Example], tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """[rows] int64: each row's parsed answer (`esroll.data.parse_answer`) as `esroll.advantages.answer_id`
        (-1: none), what label-free rewards vote on."""
        texts = self.answers(examples, tokens, lengths)
        return np.array([answer_id(parse_answer(e, s)) for e, s in zip(examples, texts)], np.int64)

    def eval_scores(self, examples: list[Example], tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """[rows, scores]: `esroll.data.eval_scores` of each generated row (the task's reward as accuracy, then its
        other eval scores)."""
        texts = self.answers(examples, tokens, lengths)
        return np.array([eval_scores(e, s) for e, s in zip(examples, texts)], np.float32).reshape(len(examples), -1)

    def texts(self, tokens: np.ndarray, lengths: np.ndarray) -> list[str]:
        return self.tokenizer.batch_decode([t[:n] for t, n in zip(tokens, lengths)], skip_special_tokens=True)

    def answers(self, examples: list[Example], tokens: np.ndarray, lengths: np.ndarray) -> list[str]:
        """Each row's whole answer: its example's prefix (if any) followed by the generated text."""
        return [e.prefix + s for e, s in zip(examples, self.texts(tokens, lengths))]


class Method(NamedTuple):
    """A training method: its initial state and one step. `step` returns (params, state, metrics, tokens generated)."""

    init: Callable[[dict, jax.Array], Any]
    step: Callable[..., tuple[dict, Any, dict, int]]


def load_task(cfg: ExperimentConfig, train: list[Example], held_out: list[Example], mesh=None) -> tuple[Task, dict]:
    """The task and the model's parameters in `model.master_dtype`: on `mesh`, each device reads only its shard of
    each weight (`esroll.sharding.master_shardings`); without a mesh, host arrays in `model.dtype`."""
    from transformers import AutoTokenizer

    try:
        path = resolve(cfg.model.path)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"config: 'model.path': {e}") from None
    if mesh is None:
        model_cfg, params = load_hf(path, dtype=jnp.dtype(cfg.model.dtype))
    else:
        model_cfg, params = load_hf(
            path,
            dtype=jnp.dtype(cfg.model.master_dtype),
            shardings=lambda model_cfg: sharding.master_shardings(mesh, param_shapes_tree(model_cfg)),
        )
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    system = cfg.data.system or None
    cache: dict[str, list[int]] = {}

    def prompt_ids(examples: list[Example]) -> list[list[int]]:
        out = []
        for e in examples:
            question = task_spec(e.task).prompt(e)  # the task's prompt format, then the template
            if question not in cache:
                text = format_prompt(question, tokenizer, cfg.data.template, system)
                cache[question] = tokenizer.encode(text, add_special_tokens=False)
            prefix = tokenizer.encode(e.prefix, add_special_tokens=False) if e.prefix else []
            out.append(cache[question] + prefix)  # a prefix is the forced start of the answer (AdaPrefix)
        return out

    eos = {tokenizer.eos_token_id, *_config_eos(model_cfg)}
    longest = max(len(p) for p in prompt_ids(train[:2000] + held_out))
    if cfg.curriculum.prefix:  # AdaPrefix appends up to a whole solution to a training prompt: one bucket still
        source = (lambda e: e.solution) if cfg.curriculum.prefix_source == "solution" else (lambda e: e.target_text)
        longest += max(len(tokenizer.encode(source(e), add_special_tokens=False)) for e in train)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    multiple = 8 * -(-longest // 8)  # one bucket for the whole dataset: a training run compiles generate once
    # The label-free mode computes its rewards from votes; its rows still carry the gold ones (logged as diagnostics).
    reward_fn = get_reward("gold" if cfg.data.reward == LABEL_FREE else cfg.data.reward)
    eos_ids = tuple(sorted(e for e in eos if e is not None))
    return Task(model_cfg, tokenizer, prompt_ids, eos_ids, pad, multiple, reward_fn), params


def param_shapes_tree(model_cfg) -> dict:
    """`param_shapes` as ShapeDtypeStructs (what the sharding rules read)."""
    return jax.tree.map(
        lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32),
        param_shapes(model_cfg),
        is_leaf=lambda x: isinstance(x, tuple),
    )


def _config_eos(model_cfg) -> list[int]:
    e = json.loads(model_cfg.hf_json).get("eos_token_id")
    return [] if e is None else ([e] if isinstance(e, int) else list(e))
