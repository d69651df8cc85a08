"""A token-id task at benchmark shapes, the same for esroll and its peers (Tunix, TRL).

A random Qwen3 model of a named shape (`_shapes.SHAPES`, rope_theta 1e6 as real Qwen3 has) is saved with a
word-level tokenizer whose words are the token ids themselves ("17" is token 17), so that a peer that only takes
text (TRL, Tunix's sampler) sees exactly the ids esroll sees. Prompts are `prompt_len` random ids (all of one length:
no padding anywhere), and the reward, computed alike from ids or from text, is the fraction of a completion's tokens
whose id is even. The end-of-sequence token is one past the model's vocabulary, so it is never sampled: every
completion is exactly `max_new_tokens` long on every side, and both sides do the same work.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from configs.default import get_config
from esroll import parallel, sharding
from esroll.config import ExperimentConfig, from_config_dict
from esroll.data import Example
from esroll.grpo import make_grpo_method
from esroll.models import load_hf
from esroll.task import Task
from experiments.benchmarks._shapes import hf_config_kwargs

PAD, EOS = "0", "<eos>"


def save_model(folder: str | Path, name: str, seed: int = 0):
    """Write the random model and its tokenizer to `folder`; returns (esroll ModelConfig, params)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(seed)
    kwargs = hf_config_kwargs(name)
    vocab = kwargs["vocab_size"]
    hf_cfg = transformers.Qwen3Config(
        **kwargs, rope_theta=1e6, max_position_embeddings=4096, initializer_range=0.1, eos_token_id=None
    )
    transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).save_pretrained(str(folder))
    words = {str(i): i for i in range(vocab)} | {EOS: vocab}
    tok = Tokenizer(models.WordLevel(words, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS)
    fast.save_pretrained(str(folder))
    return load_hf(folder)


def rope_theta(folder: str | Path) -> float:
    """The saved config's rope theta (transformers >= 5 nests it under rope_parameters)."""
    c = json.loads((Path(folder) / "config.json").read_text())
    return float(c.get("rope_theta") or c["rope_parameters"]["rope_theta"])


def prompts(vocab: int, count: int, prompt_len: int, seed: int = 0) -> list[str]:
    """`count` prompts of `prompt_len` random ids in [1, vocab), as text ("5 17 33 ...")."""
    rng = np.random.default_rng(seed)
    return [" ".join(map(str, rng.integers(1, vocab, prompt_len))) for _ in range(count)]


def even_fraction(ids) -> float:
    ids = np.asarray(ids)
    return float(np.mean(ids % 2 == 0)) if ids.size else 0.0


def reward_from_text(completions: list[str]) -> list[float]:
    """The reward of completions given as text (TRL, Tunix)."""
    return [even_fraction([int(w) for w in c.split() if w.isdigit()]) for c in completions]


class IdTask(Task):
    """`esroll.task.Task` over id prompts, rewarded by `even_fraction`."""

    def rewards(self, examples, tokens, lengths):
        return np.array([even_fraction(t[:n]) for t, n in zip(tokens, lengths)], np.float32)


def make_task(model_cfg, prompt_len: int) -> IdTask:
    def prompt_ids(examples: list[Example]) -> list[list[int]]:
        return [[int(w) for w in e.prompt.split()] for e in examples]

    return IdTask(model_cfg, None, prompt_ids, (model_cfg.vocab_size,), int(PAD), prompt_len)


def examples(texts: list[str]) -> list[Example]:
    return [Example(task="ids", prompt=t, answer="", solution="", target_text="") for t in texts]


# ---- GRPO steps at these shapes (the peers' GRPO benchmarks)

# (prompts per step, completions per prompt, new tokens, prompt length, warm-up steps, timed steps)
GRPO_SIZES = {"quick": (2, 4, 8, 16, 1, 2), "full": (8, 8, 64, 32, 2, 8)}


def grpo_config(folder: str, prompts: int, group: int, new_tokens: int, remat: str = "") -> ExperimentConfig:
    """`configs/default.py:grpo` (its AdamW, ε, temperature 1, chunked log-probabilities) at this batch, with μ = 1,
    β = 0, one minibatch and one microbatch: the settings the peers are run with. `remat` is the policy's
    rematerialisation, "none" unless given: Tunix's learner does not rematerialise (and has no switch for it), and
    TRL is told to match (`gradient_checkpointing` is on exactly when `remat` is not "none")."""
    cd = get_config("grpo")
    cd.model.path = str(folder)
    cd.train.prompts_per_step, cd.train.max_new_tokens = prompts, new_tokens
    cd.grpo.update(group_size=group, beta=0.0, inner_iterations=1, minibatches=1, microbatches=1, temperature=1.0)
    cd.grpo.remat = remat or "none"
    return from_config_dict(cd.to_dict())


def grpo_stepper(cfg: ExperimentConfig, model_cfg, params, batches: list[list[str]], prompt_len: int, mesh):
    """run(i): esroll's GRPO step on prompt batch i, to completion, with the trainer's layout on `mesh`; returns
    (seconds, completion tokens)."""
    method = make_grpo_method(cfg, make_task(model_cfg, prompt_len), mesh)
    carry = [sharding.place(params, sharding.master_shardings(mesh, params))]
    carry.append(method.init(carry[0], jax.random.key(0)))

    def run(i: int) -> tuple[float, int]:
        start = time.perf_counter()
        out = method.step(*carry, examples(batches[i]), i)
        jax.block_until_ready((out.params, out.state, out.metrics))
        carry[:] = [out.params, out.state]
        return time.perf_counter() - start, out.tokens

    return run


def run_steppers(steppers: dict, i: int, log: dict) -> None:
    """Run every esroll stepper on prompt batch `i`, appending its seconds and tokens to log[f"{side}_s"] and
    log[f"{side}_tokens"]."""
    for side, run in steppers.items():
        seconds, tokens = run(i)
        log.setdefault(f"{side}_s", []).append(seconds)
        log.setdefault(f"{side}_tokens", []).append(tokens)


def run_steppers_alone(steppers: dict, steps: int) -> dict:
    """The log of `run_steppers` over prompt batches 0 .. steps − 1, with no peer between the steps (--no_peers)."""
    log: dict = {}
    for i in range(steps):
        run_steppers(steppers, i, log)
    return log


def step_rate(log: dict, side: str, warmup: int) -> float:
    """Median completion tokens/s of `side`'s steps in `log` after the first `warmup`."""
    return statistics.median(k / s for k, s in zip(log[f"{side}_tokens"][warmup:], log[f"{side}_s"][warmup:]))


def esroll_grpo_figures(log: dict, steppers: dict, warmup: int, context: dict) -> dict:
    """What a GRPO peer benchmark reports of esroll's steps in `log` (tokens/s and step seconds of each layout, the
    completion tokens per step) beside `context` (`grpo_context`)."""
    return {
        **{f"esroll_tokens_per_s{side.removeprefix('ours')}": step_rate(log, side, warmup) for side in steppers},
        **{f"esroll_step_s{side.removeprefix('ours')}": log[f"{side}_s"][warmup:] for side in steppers},
        "completion_tokens_per_step": log["ours_tokens"][warmup],
        **context,
    }


def ours_only(figure: str, figures: dict) -> dict:
    """A peer benchmark's result under --no_peers: esroll's own figures, the ratio None with the reason."""
    return {figure: None, "reason": "--no_peers: esroll's side only", **figures}


def esroll_meshes(params) -> dict:
    """esroll's layouts in a peer benchmark: "ours", the devices its trainers run this model on
    (`parallel.trainer_device_count`: one CPU device at the mid shape, one per core for small models), which gives the
    named figure; and the other layout as context, "ours_split" (rows over every device) or "ours_1device", when the
    host has more than one device."""
    n = parallel.trainer_device_count(sum(x.size for x in jax.tree.leaves(params)))
    meshes = {"ours": parallel.make_mesh(n)}
    if jax.device_count() > 1:
        meshes["ours_split" if n == 1 else "ours_1device"] = parallel.make_mesh(jax.device_count() if n == 1 else 1)
    return meshes


def grpo_context(name: str, cfg: ExperimentConfig, prompt_len: int, warmup: int, timed: int, meshes: dict) -> dict:
    """The settings a GRPO benchmark's JSON entry records beside its figures."""
    return {
        "shape": name,
        "prompts": cfg.train.prompts_per_step,
        "group_size": cfg.grpo.group_size,
        "new_tokens": cfg.train.max_new_tokens,
        "prompt_len": prompt_len,
        "timed_steps": timed,
        "warmup_steps": warmup,
        **{f"esroll_devices{side.removeprefix('ours')}": m.size for side, m in meshes.items()},
        "grpo_remat": cfg.grpo.remat,
    }
