"""GRPO training throughput: esroll's GRPO step against TRL's `GRPOTrainer`, same model, prompts, reward and settings.

A step is everything: sampling G completions per prompt, rewards, advantages and one clipped-AdamW update. The
figure is completion tokens per second of esroll over TRL, after warm-up steps (compilation excluded). Both run in
this process on the shipped tiny model with the `configs/default.py:grpo` settings, one esroll step after each TRL
step (from a TRL callback), so that both see the same machine load. `--model` and `--dtype` do not apply.
TRL is optional (`pip install trl`); without it the figure is None, with the reason.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from configs.default import get_config
from esroll import parallel, sharding
from esroll.config import from_config_dict
from esroll.data import get_batch, make_splits, score
from esroll.grpo import make_grpo_method
from esroll.task import load_task

REPO = Path(__file__).resolve().parents[2]


def _config():
    cd = get_config("grpo")
    cd.model.path = str(REPO / cd.model.path)
    return from_config_dict(cd.to_dict())


def _esroll_stepper(cfg, task, params, train):
    """A function running esroll's GRPO step `i` to completion; returns (seconds, completion tokens)."""
    mesh = parallel.make_mesh(1)
    method = make_grpo_method(cfg, task, mesh)
    params = sharding.place(params, sharding.master_shardings(mesh, params))  # the trainer's layout (`load_task`)
    carry = [params, method.init(params, jax.random.key(cfg.seed))]

    def run(i: int) -> tuple[float, int]:
        start = time.perf_counter()
        examples = get_batch(train, cfg.train.prompts_per_step, cfg.data.seed, i)
        params, state, metrics, n_tokens = method.step(*carry, examples, i)
        jax.block_until_ready((params, state, metrics))
        carry[:] = [params, state]
        return time.perf_counter() - start, n_tokens

    return run


def _trl_interleaved(cfg, task, train, steps: int, folder: str, ours) -> dict[str, list]:
    """Train TRL for `steps` steps; after each, run `ours(i)` once, so both sides see the same machine load."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    P, G = cfg.train.prompts_per_step, cfg.grpo.group_size
    rows = [e for step in range(steps) for e in get_batch(train, P, cfg.data.seed, step)]
    texts = [task.tokenizer.decode(ids) for ids in task.prompt_ids(rows)]
    dataset = Dataset.from_dict({"prompt": texts, "row": list(range(len(rows)))})

    def reward(prompts, completions, row, **_):
        return [score(rows[i], c) for i, c in zip(row, completions)]

    log = {"trl_s": [], "trl_tokens": [], "ours_s": [], "ours_tokens": []}

    class Interleave(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            log["trl_s"].append(time.perf_counter() - self.start)
            seconds, tokens = ours(len(log["ours_s"]))
            log["ours_s"].append(seconds)
            log["ours_tokens"].append(tokens)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                log["trl_tokens"].append(round(logs["completions/mean_length"] * P * G))

    args = GRPOConfig(
        output_dir=folder,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        max_steps=steps,
        per_device_train_batch_size=P * G,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=G,
        max_completion_length=cfg.train.max_new_tokens,
        temperature=cfg.grpo.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=cfg.optimizer.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=cfg.optimizer.weight_decay,
        max_grad_norm=cfg.optimizer.max_grad_norm,
        beta=cfg.grpo.beta,
        epsilon=cfg.grpo.epsilon_low,
        epsilon_high=cfg.grpo.epsilon_high,
        num_iterations=cfg.grpo.inner_iterations,
        loss_type="grpo",
        scale_rewards="group",
        shuffle_dataset=False,
        seed=cfg.seed,
    )
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=task.tokenizer,
        callbacks=[Interleave()],
    )
    trainer.remove_callback(PrinterCallback)  # it prints every step's log dict when tqdm is disabled
    trainer.train()
    return log


def grpo_step_vs_trl(args) -> dict:
    """Completion tokens/s of a full GRPO step, esroll over TRL, both after `warmup` untimed steps."""
    try:
        import torch
        import trl
    except ImportError as e:
        return {"grpo_step_vs_trl": None, "reason": f"TRL is not installed ({e}); pip install trl"}
    torch.set_num_threads(os.cpu_count())
    warmup, timed = (1, 3) if args.quick else (2, 10)
    cfg = _config()
    train, held_out = make_splits(cfg.data)
    task, params = load_task(cfg, train, held_out)
    ours = _esroll_stepper(cfg, task, params, train)
    with tempfile.TemporaryDirectory() as folder:
        log = _trl_interleaved(cfg, task, train, warmup + timed, folder, ours)
    ours_s, ours_tok, trl_s, trl_tok = (log[k][warmup:] for k in ("ours_s", "ours_tokens", "trl_s", "trl_tokens"))
    ours_tps, trl_tps = sum(ours_tok) / sum(ours_s), sum(trl_tok) / sum(trl_s)
    rows = cfg.train.prompts_per_step * cfg.grpo.group_size
    return {
        "grpo_step_vs_trl": ours_tps / trl_tps,
        "esroll_tokens_per_s": ours_tps,
        "trl_tokens_per_s": trl_tps,
        "esroll_step_s_median": statistics.median(ours_s),
        "trl_step_s_median": statistics.median(trl_s),
        "esroll_mean_completion_tokens": float(np.mean(ours_tok)) / rows,
        "trl_mean_completion_tokens": float(np.mean(trl_tok)) / rows,
        "prompts": cfg.train.prompts_per_step,
        "group_size": cfg.grpo.group_size,
        "max_new_tokens": cfg.train.max_new_tokens,
        "timed_steps": timed,
        "warmup_steps": warmup,
        "trl_version": trl.__version__,
        "torch_threads": torch.get_num_threads(),
        "jax_devices": 1,
        "model": "assets/tiny-qwen3-arith",
        "timing": "completion tokens / wall time of full steps, the two sides alternating, after warm-up steps",
    }


BENCHMARKS = {"grpo_step_vs_trl": grpo_step_vs_trl}
