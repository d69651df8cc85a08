"""The training loop shared by every method: ES (LOO-ROLL, EGGROLL) and the GRPO baseline.

One linear function, in sections: setup → model → data → method → checkpoint → evaluation → loop → final. The
methods differ only in their `Method` (state + one step); prompts, generation, rewards, evaluation, checkpoints and
logs are the same code for all of them, so comparisons are like for like.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

import jax
import numpy as np
import optax
from tqdm.auto import tqdm

from esroll import parallel
from esroll.checkpoint import Checkpointer, guard_workdir
from esroll.config import ExperimentConfig, OptimConfig
from esroll.data import Example, get_batch, make_splits
from esroll.metrics import MetricsWriter, plot_eval_curve
from esroll.task import Task, load_task
from esroll.models import save_hf
from esroll.sampling import generate, pad_prompts


@functools.cache  # one object per config, so jitted steps that take it as a static argument share their cache
def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    if cfg.name == "sgd":
        opt = optax.sgd(cfg.lr)
    elif cfg.name == "adamw":
        opt = optax.adamw(cfg.lr, weight_decay=cfg.weight_decay)
    else:
        opt = optax.adam(cfg.lr)
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), opt) if cfg.max_grad_norm > 0 else opt


def evaluate(task: Task, params: dict, examples: list[Example], max_new_tokens: int, batch: int = 256,
             mesh=None) -> float:  # fmt: skip
    """Held-out accuracy of the unperturbed parameters, greedy; rows split over `mesh` when one is given."""
    split = mesh is not None and mesh.size > 1 and batch % mesh.size == 0
    correct = 0.0
    for i in range(0, len(examples), batch):
        chunk = examples[i : i + batch]
        tokens, mask = pad_prompts(task.prompt_ids(chunk), multiple=task.prompt_multiple, rows=batch, pad_id=task.pad_id)
        if split:
            tokens, mask = parallel.put_rows(mesh, tokens), parallel.put_rows(mesh, mask)
        gen = generate(task.cfg, params, tokens, jax.random.key(0), max_new_tokens=max_new_tokens, temperature=0.0,
                       eos_ids=task.eos_ids, prompt_mask=mask, pad_id=task.pad_id)  # fmt: skip
        if not split:
            out_tokens, lengths = np.asarray(gen.tokens)[: len(chunk)], np.asarray(gen.lengths)[: len(chunk)]
            correct += task.rewards(chunk, out_tokens, lengths).sum()
            continue
        idx, out_tokens = parallel.local_rows(gen.tokens)
        _, lengths = parallel.local_rows(gen.lengths)
        real = idx < len(chunk)  # padding rows fill the last batch
        local = task.rewards([chunk[j] for j in idx[real]], out_tokens[real], lengths[real]).sum()
        per_process = np.array([local], np.float64)
        correct += parallel.gather_to_all(per_process, np.array([jax.process_index()]), jax.process_count()).sum()
    return float(correct / len(examples))


def train_and_evaluate(
    cfg: ExperimentConfig,
    workdir: str | Path,
    *,
    overwrite: bool = False,
    mesh_devices: int = 0,
    stop_after_steps: int | None = None,
    progress: bool = True,
) -> dict:
    """Run (or resume) the experiment in `workdir`; returns a summary. `stop_after_steps` ends this process early,
    as an interruption would (used by resumption tests)."""
    # ---- setup
    parallel.maybe_initialize_distributed(cfg.distributed)
    workdir = Path(workdir)
    config_dict = dataclasses.asdict(cfg)
    resuming = guard_workdir(workdir, config_dict, overwrite) if jax.process_index() == 0 else True
    mesh = parallel.make_mesh(mesh_devices)

    # ---- model and data
    train, held_out = make_splits(cfg.data)
    task, params = load_task(cfg, train, held_out)
    params = parallel.put_replicated(mesh, params)

    # ---- method
    optimizer = make_optimizer(cfg.optimizer)
    if cfg.method == "grpo":
        from esroll.grpo import make_grpo_method

        method = make_grpo_method(cfg, task, optimizer, mesh)
    else:
        from esroll.es_train import make_es_method

        method = make_es_method(cfg, task, optimizer, mesh)
    state = parallel.put_replicated(mesh, method.init(params, jax.random.key(cfg.seed)))

    # ---- checkpoint: restore if this workdir already holds this run
    ckpt = Checkpointer(workdir)
    metrics = MetricsWriter(workdir, enabled=jax.process_index() == 0)
    start_step, elapsed = 0, 0.0
    if resuming and ckpt.latest_step() is not None:
        restored, meta = ckpt.restore({"params": params, "state": state})
        params, state = parallel.put_replicated(mesh, (restored["params"], restored["state"]))
        start_step, elapsed = int(meta["step"]), float(meta["wall_time"])
        metrics.truncate_after(start_step)

    # ---- evaluation
    def run_eval() -> float:
        return evaluate(task, params, held_out, cfg.train.max_new_tokens, mesh=mesh)

    if start_step == 0:
        acc0 = run_eval()
        metrics.write({"step": 0, "wall_time": 0.0, "eval_accuracy": acc0})
    else:
        acc0 = metrics.first_eval()
    summary = {"initial_eval_accuracy": acc0, "resumed_from": start_step}
    if jax.process_index() == 0:
        print(f"[esroll] {cfg.method}: held-out accuracy before training {acc0:.3f} ({len(held_out)} prompts)", flush=True)

    # ---- loop
    bar = tqdm(total=cfg.train.steps, initial=start_step, disable=not progress or jax.process_index() != 0,
               dynamic_ncols=True)  # fmt: skip
    step, acc, saved_step = start_step, None, start_step
    while step < cfg.train.steps:
        if cfg.train.time_budget_s and elapsed >= cfg.train.time_budget_s:
            break
        t0 = time.perf_counter()
        examples = get_batch(train, cfg.train.prompts_per_step, cfg.data.seed, step)
        params, state, m, n_tokens = method.step(params, state, examples, step)
        m = {k: float(v) for k, v in m.items()}  # the host needs rewards anyway; one sync per step
        dt = time.perf_counter() - t0
        elapsed += dt
        step += 1
        record = {"step": step, "wall_time": elapsed, "tokens_per_s": n_tokens / dt, **m}
        if step % cfg.train.eval_every == 0 or step == cfg.train.steps:
            acc = run_eval()
            record["eval_accuracy"] = acc
        metrics.write(record)
        bar.update(1)
        bar.set_postfix(fitness=f"{m['fitness_mean']:.3f}", acc=f"{acc:.3f}" if acc is not None else "-",
                        tok_s=f"{n_tokens / dt:.0f}")  # fmt: skip
        if step % cfg.train.checkpoint_every == 0 or step == cfg.train.steps:
            ckpt.save(step, {"params": params, "state": state}, {"step": step, "wall_time": elapsed})
            saved_step = step
        if stop_after_steps is not None and step - start_step >= stop_after_steps:
            ckpt.wait()
            ckpt.close()
            metrics.close()
            return {**summary, "stopped_at": step, "params": params}
    bar.close()
    if saved_step != step:  # the time budget ended the loop between checkpoints
        ckpt.save(step, {"params": params, "state": state}, {"step": step, "wall_time": elapsed})
    ckpt.wait()
    ckpt.close()

    # ---- final
    last = metrics.last_eval_record()
    final_acc = last["eval_accuracy"] if last else None
    if last is None or last["step"] != step:
        final_acc = run_eval()
        metrics.write({"step": step, "wall_time": elapsed, "eval_accuracy": final_acc})
    metrics.close()
    if jax.process_index() == 0:
        plot_eval_curve(workdir / "metrics.jsonl", workdir / "eval_accuracy.png", title=f"{cfg.method}")
        if cfg.train.export:
            save_hf(workdir / "final", task.cfg, jax.device_get(params), tokenizer=task.tokenizer)
        print(f"[esroll] {cfg.method}: held-out accuracy {acc0:.3f} -> {final_acc:.3f} after {step} steps, "
              f"{elapsed:.0f} s of training", flush=True)  # fmt: skip
    return {**summary, "final_eval_accuracy": final_acc, "steps": step, "wall_time": elapsed, "params": params}
