"""GRPO training throughput: esroll's GRPO step against TRL's `GRPOTrainer`, same weights, prompts, reward and settings.

A step is everything: sampling G completions per prompt, rewards, advantages and one clipped-AdamW update. The
figure is completion tokens per second of esroll over TRL. The model is a random Qwen3 of the "mid" shape (hidden
1024; "quick" under --quick; --model picks another) with the `_idtask` prompts and reward, so that every completion
has exactly the configured number of tokens on both sides (`_idtask.GRPO_SIZES`: 8 prompts × 8 completions, 64 new
tokens). All run in this process: after each TRL step (from a TRL callback), one esroll step on the devices its
trainers use for this model (`parallel.trainer_device_count`: one CPU device at the mid shape) and one in the other
layout, so that all see the same machine load. TRL's steps alternate
between one intra-op thread per core and a single thread (on a shared machine its multi-threaded kernels can
stall), and its faster setting counts. Figures are medians over the timed steps. TRL is optional (the `bench`
extra); without it the figure is None, with the reason.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from experiments.benchmarks import _idtask
from experiments.benchmarks._shapes import shape_name


def trl_config(cfg, folder: str, steps: int):
    """TRL's GRPOConfig with esroll's settings (`cfg`): the same batch, sampling, optimizer, clipping and loss."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=os.path.join(folder, "trl"),
        use_cpu=True,
        # float32 compute, as esroll and Tunix run these steps: TRL's GRPOConfig defaults to bf16=True, and the
        # Trainer then autocasts forward and backward to bfloat16, on a CPU too.
        bf16=False,
        fp16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        max_steps=steps,
        per_device_train_batch_size=cfg.train.prompts_per_step * cfg.grpo.group_size,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=cfg.grpo.group_size,
        max_completion_length=cfg.train.max_new_tokens,
        temperature=cfg.grpo.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=cfg.optimizer.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=cfg.optimizer.weight_decay,
        max_grad_norm=cfg.optimizer.max_grad_norm,
        gradient_checkpointing=cfg.grpo.remat != "none",  # per decoder layer, as esroll's "full"
        beta=cfg.grpo.beta,
        epsilon=cfg.grpo.epsilon_low,
        epsilon_high=cfg.grpo.epsilon_high,
        num_iterations=cfg.grpo.inner_iterations,
        loss_type="grpo",
        scale_rewards="group",
        shuffle_dataset=False,
        seed=cfg.seed,
    )


def _trl_interleaved(cfg, folder: str, batches, steps: int, steppers: dict) -> dict[str, list]:
    """Train TRL for `steps` steps, alternating its thread count; after each, run every esroll stepper once."""
    import torch
    from transformers import TrainerCallback

    cores = len(os.sched_getaffinity(0))
    log = {"trl_s": [], "trl_threads": [], "trl_tokens": []} | {
        f"{k}_{v}": [] for k in steppers for v in ("s", "tokens")
    }

    def reward(prompts, completions, **_):
        log["trl_tokens"].append(sum(len(c.split()) for c in completions))
        return _idtask.reward_from_text(completions)

    class Interleave(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            threads = cores if state.global_step % 2 == 0 else 1
            torch.set_num_threads(threads)
            log["trl_threads"].append(threads)
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            log["trl_s"].append(time.perf_counter() - self.start)
            _idtask.run_steppers(steppers, len(log["trl_s"]) - 1, log)

    log["trl_mixed_precision"] = train_trl(cfg, folder, batches, steps, Interleave(), reward)
    return log


def train_trl(cfg, folder: str, batches, steps: int, callback, reward=None) -> str:
    """TRL's GRPOTrainer on the saved model, the prompt batches in order, for `steps` steps with `callback`; returns
    the mixed precision its accelerator ran with ("no": float32 throughout)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback
    from trl import GRPOTrainer

    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
        reward_funcs=reward or (lambda prompts, completions, **_: _idtask.reward_from_text(completions)),
        args=trl_config(cfg, folder, steps),
        train_dataset=Dataset.from_dict({"prompt": [p for batch in batches for p in batch]}),
        processing_class=AutoTokenizer.from_pretrained(folder),
        callbacks=[callback],
    )
    trainer.remove_callback(PrinterCallback)  # it prints every step's log dict when tqdm is disabled
    trainer.train()
    return str(trainer.accelerator.mixed_precision)


def grpo_step_vs_trl(args) -> dict:
    """Completion tokens/s of a full GRPO step, esroll over TRL at its faster thread count, after warm-up steps."""
    if not args.no_peers:
        try:
            import torch
            import trl
        except ImportError as e:
            return {"grpo_step_vs_trl": None, "reason": f"TRL is not installed ({e}); pip install -e '.[bench]'"}
    X, G, n, prompt_len, warmup, timed = _idtask.GRPO_SIZES["quick" if args.quick else "full"]
    warmup, timed = warmup + 1, timed + timed % 2  # each thread count warms up, and is timed as often
    name = shape_name(args)
    steps = warmup + timed
    with tempfile.TemporaryDirectory() as folder:
        model_cfg, params = _idtask.save_model(folder, name)
        cfg = _idtask.grpo_config(folder, X, G, n, args.grpo_remat)
        batches = [_idtask.prompts(model_cfg.vocab_size, X, prompt_len, seed=i) for i in range(steps)]
        meshes = _idtask.esroll_meshes(params)  # as esroll's trainers run this model, and the other layout
        steppers = {
            side: _idtask.grpo_stepper(cfg, model_cfg, params, batches, prompt_len, m) for side, m in meshes.items()
        }
        if args.no_peers:
            log = _idtask.run_steppers_alone(steppers, steps)
        else:
            log = _trl_interleaved(cfg, folder, batches, steps, steppers)
    timed_steps = range(warmup, steps)
    context = _idtask.grpo_context(name, cfg, prompt_len, warmup, timed, meshes)
    esroll_figures = _idtask.esroll_grpo_figures(log, steppers, warmup, context)
    if args.no_peers:
        return _idtask.ours_only("grpo_step_vs_trl", esroll_figures)
    ours = {side: _idtask.step_rate(log, side, warmup) for side in steppers}
    trl_tps = {
        threads: statistics.median(
            log["trl_tokens"][i] / log["trl_s"][i] for i in timed_steps if log["trl_threads"][i] == threads
        )
        for threads in sorted(set(log["trl_threads"]))
    }
    best = max(trl_tps.values())
    return {
        **{f"grpo_step_vs_trl{side.removeprefix('ours')}": v / best for side, v in ours.items()},
        **esroll_figures,
        "trl_tokens_per_s": best,
        **{f"trl_tokens_per_s_{t}threads": v for t, v in trl_tps.items()},
        "trl_step_s": [log["trl_s"][i] for i in timed_steps],
        "trl_completion_tokens_per_step": log["trl_tokens"][warmup],
        "trl_version": trl.__version__,
        "torch_version": torch.__version__,
        "trl_mixed_precision": log["trl_mixed_precision"],
        "unmatched": "esroll on the devices its trainers use for this model (the _split / _1device figures: the other "
        "layout), TRL in one process at its faster thread count; remat: matched (TRL's gradient checkpointing follows "
        "--grpo_remat, off by default)",
        "timing": "median completion tokens/s over timed steps, one esroll step on each mesh after each TRL step",
    }


BENCHMARKS = {"grpo_step_vs_trl": grpo_step_vs_trl}
