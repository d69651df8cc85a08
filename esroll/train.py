"""The training loop shared by every method: ES (LOO-ROLL, EGGROLL) and the GRPO baseline.

One linear function, in sections: setup → data and model → method → claim the workdir → checkpoint → evaluation →
loop → final. The methods differ only in their `Method` (state + one step); prompts, generation, rewards
(`esroll.rollout`), evaluation, checkpoints and logs are the same code for all of them, so comparisons are like for
like.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from tqdm.auto import tqdm

from esroll import agents, memory, methods, parallel, sharding
from esroll.checkpoint import Checkpointer, check_workdir, claim_workdir, extension, saved_config, workdir_path
from esroll.config import ExperimentConfig, dotted, make_schedule
from esroll.critic import on_trunk
from esroll.curriculum import Curriculum
from esroll.data import Example, make_splits
from esroll.errors import InputError, Interrupted, reading
from esroll.experiment import as_current, check_names, unread_keys
from esroll.metrics import MetricsWriter, first_eval, last_eval, plot_eval_curve, read_metrics
from esroll.models import save_hf
from esroll.rollout import PAD, Sampling, rollout
from esroll.samples import as_text, readable
from esroll.task import Task, load_task


def evaluate(
    task: Task,
    params: dict,
    examples: list[Example],
    sampling: Sampling | int,
    mesh,
    batch: int = 256,
    samples: list | None = None,
    rows: int = 0,
) -> dict[str, float]:
    """Held-out scores of the unperturbed parameters, greedy, as metrics.jsonl names them: "eval_accuracy" (the task's
    reward) and, for numeric answers, GSM8K's "eval_strict" and "eval_flexible" matches (`esroll.data.eval_scores`).
    Up to `batch` questions per rollout, the last one padded, so every rollout has the same shape and `generate`
    compiles once. `sampling` is greedy `Sampling` (or just its max_new_tokens). With a list `samples`, the first
    `rows` held-out rows are appended to it as readable text (`esroll.samples.readable`)."""
    sampling = Sampling(sampling) if isinstance(sampling, int) else sampling
    totals: dict[str, float] = {}
    batch = min(batch, len(examples))
    for i in range(0, len(examples), batch):
        chunk = examples[i : i + batch]
        example_B = np.concatenate([np.arange(len(chunk)), np.full(batch - len(chunk), PAD)])
        show = samples is not None and rows > 0 and i == 0
        out = rollout(task, mesh, params, chunk, example_B, jax.random.key(0), sampling, scores=True, completions=show)
        for name, score_B in out.scores.items():
            totals[name] = totals.get(name, 0.0) + float(score_B.sum(dtype=np.float64))
        if show:
            samples += readable(out, chunk, task.tokenizer, rows)
    return {f"eval_{name}": total / len(examples) for name, total in totals.items()}


def _learning_rate(cfg: ExperimentConfig):
    """step -> the learning rate of that step's first optimizer update (GRPO takes μ × minibatches per step)."""
    o = cfg.optimizer
    lr = make_schedule(o.schedule, o.lr, o.lr_final, o.horizon, o.warmup_steps)
    per_step = methods.lookup(cfg).updates_per_step(cfg)
    return lambda step: float(lr(step * per_step)) if callable(lr) else lr


def train_and_evaluate(
    cfg: ExperimentConfig,
    workdir: str | os.PathLike,
    *,
    overwrite: bool = False,
    mesh_devices: int = 0,
    stop_after_steps: int | None = None,
    progress: bool = True,
    show_samples: bool = False,
) -> dict:
    """Run (or resume) the experiment in `workdir`; returns a summary. `stop_after_steps` ends this process early,
    as an interruption would (used by resumption tests). Each evaluation writes `train.eval_samples` held-out rows
    as text to workdir/samples.jsonl (`esroll.samples`); `show_samples` also prints the first.

    Nothing is written to `workdir` until the data, the model and the method have been built: a run that cannot
    start leaves the workdir as it was; a config naming no registered method, shaping, estimator, task, ... is
    refused before anything else (`esroll.experiment.check_names`). A finished run is reported and left untouched.
    """
    # ---- setup
    cfg = check_names(cfg)
    parallel.maybe_initialize_distributed(cfg.distributed)
    workdir = workdir_path(workdir)  # a local path made absolute, or a URL (gs://...) kept as it is
    config_dict = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
    lead = jax.process_index() == 0
    resuming = check_workdir(workdir, config_dict, overwrite, current=as_current)
    extended = extension(as_current(saved_config(workdir)), config_dict) if resuming else {}
    mesh = parallel.make_mesh(mesh_devices, model=cfg.parallel.model)
    ckpt_step = Checkpointer.latest_in(workdir) if resuming else None
    records = read_metrics(workdir / "metrics.jsonl") if resuming else []
    complete = ckpt_step is not None and _complete(cfg, workdir, ckpt_step, records)
    # Every process must take the same branch: process 0's view of the workdir decides.
    resuming, step, complete = parallel.broadcast_from_lead(
        (resuming, -1 if ckpt_step is None else ckpt_step, complete)
    )
    ckpt_step = None if step < 0 else step
    if complete:
        summary = _summary(cfg, workdir, records, resumed_from=ckpt_step, ran_steps=0)
        if lead:
            _print_summary(summary, "already complete; nothing to do")
        return summary

    # ---- data and model
    with reading():
        train, held_out = agents.splits(cfg) if cfg.env.name else make_splits(cfg.data)
        task, params = load_task(cfg, train, held_out, mesh)  # master weights, in their shards
    to_compute = sharding.caster(mesh, cfg.model.dtype)

    # ---- method (on devices that report their memory, only once the step is known to fit them)
    plan = preflight(cfg, task, mesh)
    rows_per_device = plan.rows_per_device if plan else None
    spec = methods.lookup(cfg)  # what the loop needs of the method (`esroll.methods`)
    method = spec.build(cfg, task, mesh, rows_per_device)
    state = method.init(params, jax.random.key(cfg.seed))
    batches = Curriculum(cfg, train, task.tokenizer)  # what each step trains on (ADS, AdaPrefix)

    def saved_curriculum() -> dict:  # replicated on the mesh: every process has it
        state = batches.saved()
        return (
            {"curriculum": parallel.put_replicated(mesh, {k: jnp.asarray(v) for k, v in state.items()})}
            if state
            else {}
        )

    # ---- claim the workdir (the run can start), then restore if it holds this run
    if lead:
        aside = claim_workdir(workdir, config_dict, current=as_current)
        if aside is not None and not overwrite:
            print(f"[esroll] {workdir} held a run of another config that never completed a step: moved to {aside}")
    ckpt = Checkpointer(workdir)
    start_step, elapsed = 0, 0.0
    generated = {"completions": 0, "tokens": 0, "flops": 0}  # cumulative, as the records log them (the compute ledger)
    if ckpt_step is not None:
        restored, meta = ckpt.restore({"params": params, "state": state, **saved_curriculum()})  # the shardings
        params, state = restored["params"], restored["state"]
        if "curriculum" in restored:
            batches.restore(parallel.to_host(restored["curriculum"]))
        start_step, elapsed = int(meta["step"]), float(meta["wall_time"])
        generated = {k: int(meta.get(k, 0)) for k in generated}
    metrics = MetricsWriter(workdir, keep_through=ckpt_step, enabled=lead)

    step, acc, saved_step, bar = start_step, None, start_step, None
    try:
        # ---- evaluation
        def run_eval(step: int) -> dict[str, float]:
            start = time.perf_counter()
            samples: list[dict] = []
            scores = evaluate(
                task, to_compute(params), held_out, eval_sampling, mesh, samples=samples, rows=cfg.train.eval_samples
            )
            seconds = time.perf_counter() - start  # greedy decoding of the held-out set: a speed probe
            metrics.write_samples(step, samples)
            if show_samples and lead and samples:
                print(f"[esroll] a held-out sample at step {step}:\n{as_text(samples[0])}", flush=True)
            return {**scores, "eval_s": seconds}

        eval_rows = (
            plan.eval_rows_per_device if plan else _eval_rows_per_device(cfg, task, mesh, params, state, held_out)
        )
        eval_sampling = Sampling.of(cfg.train.max_new_tokens, 0.0, cfg.parallel, eval_rows)

        if start_step == 0:
            scores0 = run_eval(0)
            metrics.write({"step": 0, "wall_time": 0.0, **scores0})
        acc0 = scores0["eval_accuracy"] if start_step == 0 else first_eval(metrics.records())
        if lead and extended:
            for line in _extension_notes(cfg, extended, start_step):
                print(f"[esroll] {line}", flush=True)
        if lead:
            where = f"resuming from step {start_step}" if start_step else "starting"
            rows = f"{len(held_out)} {'episodes' if cfg.env.name else 'questions'}"
            print(f"[esroll] {cfg.method}: {where}; held-out accuracy before training {acc0:.3f} ({rows})", flush=True)

        # ---- loop
        budget = cfg.train.time_budget_s
        lr_at = _learning_rate(cfg)
        rows = spec.rows_per_step(cfg)
        bar = _progress_bar(cfg, start_step, elapsed, enabled=progress and lead)
        while step < cfg.train.steps and not (budget and elapsed >= budget):
            t0 = time.perf_counter()
            batch = batches.batch(step)
            out = method.step(params, state, batch.examples, step)
            params, state, n_tokens, flops = out.params, out.state, out.tokens, out.flops
            m = {**out.metrics, **batches.update(step, batch, out.prompt_reward)}
            m = {k: float(v) for k, v in m.items()}  # the host needs rewards anyway; one sync per step
            dt = time.perf_counter() - t0
            elapsed += dt
            step += 1
            generated = {
                "completions": generated["completions"] + rows,
                "tokens": generated["tokens"] + n_tokens,
                "flops": generated["flops"] + flops,
            }
            record = {
                "step": step,
                "wall_time": elapsed,
                **generated,
                "tokens_per_s": n_tokens / dt,
                "lr": lr_at(step - 1),
            }
            record.update(m)
            if step % cfg.train.eval_every == 0 or step == cfg.train.steps:
                record.update(run_eval(step))
                acc = record["eval_accuracy"]
            metrics.write(record)
            bar.update(min(dt, budget - bar.n) if budget else 1)
            bar.set_postfix(
                step=step,
                **{method.headline: f"{m[method.headline]:.3f}"},
                acc="-" if acc is None else f"{acc:.3f}",
                tok_s=f"{n_tokens / dt:.0f}",
            )
            if step % cfg.train.checkpoint_every == 0 or step == cfg.train.steps:
                saved = {"params": params, "state": state, **saved_curriculum()}
                ckpt.save(step, saved, {"step": step, "wall_time": elapsed, **generated})
                saved_step = step
            if stop_after_steps is not None and step - start_step >= stop_after_steps:
                ckpt.wait()
                ckpt.close()
                metrics.close()
                return {"initial_eval_accuracy": acc0, "resumed_from": start_step, "stopped_at": step, "params": params}
        bar.close()
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
        raise _interrupted(
            ckpt, metrics, step, saved_step if ckpt_step is not None or saved_step > start_step else None
        ) from None
    if saved_step != step:  # the time budget ended the loop between checkpoints
        saved = {"params": params, "state": state, **saved_curriculum()}
        ckpt.save(step, saved, {"step": step, "wall_time": elapsed, **generated})
    ckpt.wait()
    ckpt.close()

    # ---- final
    last = last_eval(metrics.records())
    if last is None or last["step"] != step:
        metrics.write({"step": step, "wall_time": elapsed, **generated, **run_eval(step)})
    metrics.close()
    # The model in `model.dtype`, as it was loaded; every process joins the gather of a model split across hosts.
    final = parallel.to_host(to_compute(params)) if cfg.train.export else None
    critic = getattr(state, "critic", None) if cfg.train.export else None  # PPO's (`esroll.grpo.ppo`)
    critic = None if critic is None else parallel.to_host(on_trunk(critic, params))  # a head on the policy's trunk
    if lead:
        plot_eval_curve(workdir / "metrics.jsonl", workdir / "eval_accuracy.png", title=cfg.method, n=len(held_out))
        if cfg.train.export:
            if critic is not None:  # a value model, before `final` (whose config.json marks the export done)
                value_cfg = dataclasses.replace(task.cfg, head="value")
                save_hf(workdir / "final_critic", value_cfg, critic, tokenizer=task.tokenizer)
            save_hf(workdir / "final", task.cfg, final, tokenizer=task.tokenizer)
    summary = _summary(cfg, workdir, read_metrics(workdir / "metrics.jsonl"), start_step, step - start_step)
    if lead:
        _print_summary(summary, "resumed and finished" if start_step else "finished")
    return {**summary, "params": params}


def _interrupted(ckpt: Checkpointer, metrics: MetricsWriter, step: int, saved: int | None) -> Interrupted:
    """Ctrl-C: let a checkpoint being written finish, close the logs, and say where a rerun resumes from."""
    try:
        ckpt.wait()
        ckpt.close()
        metrics.close()
    except Exception:  # noqa: BLE001 — the interruption is what gets reported; a rerun checks the workdir again
        pass
    where = f"from its checkpoint at step {saved}" if saved is not None else "from the start (no checkpoint yet)"
    return Interrupted(f"interrupted at step {step}; rerun the same command to resume {where}")


def preflight(cfg: ExperimentConfig, task: Task, mesh):
    """Before the first step, where devices report their memory (GPUs, TPUs; not CPUs): compile the step for them
    as `experiments.plan` does, choosing the rows per device (halving an automatic count until the step fits), and
    refuse a step that cannot fit with one line naming its largest buffer. Returns the `esroll.plan.Plan` (None where
    skipped: CPUs)."""
    if memory.device_memory_bytes(mesh.devices.flat[0]) is None:
        return None
    plan = methods.lookup(cfg).plan(
        cfg, task.cfg, mesh, platform=jax.default_backend(), prompt_len=task.prompt_multiple, eos_ids=task.eos_ids
    )
    if not plan.fits:
        raise InputError(f"config: {plan.refusal()}")
    return plan


def _eval_rows_per_device(cfg: ExperimentConfig, task: Task, mesh, params, state, held_out) -> int:
    """The evaluation rows each device decodes at once (`esroll.memory.rows_per_device`): beside the run's
    parameters, optimizer state and decoding copy."""
    compute = sharding.decoding_copy(mesh, params, cfg.model.dtype)
    resident = memory.resident_bytes(params, state, compute)
    rows = min(256, len(held_out))
    return memory.rows_per_device(cfg, task.cfg, task.prompt_multiple, mesh, resident, rows)


_HORIZONS = ("optimizer.horizon", "es.sigma_horizon", "grpo.adv.agrae.horizon", "curriculum.prefix_horizon")


def _extension_notes(cfg: ExperimentConfig, extended: dict, start_step: int) -> list[str]:
    """What a rerun that raised train.steps / train.time_budget_s does, and how the run's schedules carry on: each
    is a function of the step with a horizon of its own, so the continued run is the run that had the larger value
    from the start; past a horizon a schedule holds its final value."""
    changes = ", ".join(f"{key} {a} -> {b}" for key, (a, b) in sorted(extended.items()))
    notes = [f"extending the run ({changes}) from its checkpoint at step {start_step}"]
    values, unread = dotted(dataclasses.asdict(cfg)), unread_keys(cfg)  # a schedule's horizon is read iff it acts
    ended = [f"{k} = {values[k]}" for k in _HORIZONS if k not in unread and values[k]]
    if ended:
        notes.append(
            f"schedules keep their horizons ({', '.join(ended)}; the optimizer's in updates): each holds its final "
            "value past its horizon, as in a run given the larger train.steps from the start"
        )
    return notes


def _complete(cfg: ExperimentConfig, workdir: epath.Path, ckpt_step: int, records: list[dict]) -> bool:
    """Whether a run whose last checkpoint is at `ckpt_step` has nothing left to do: its loop had ended (step limit
    or time budget), its final evaluation is logged, and its plot and exported model were written (both come after
    the final evaluation, so a run killed while exporting is finished when rerun)."""
    last = last_eval(records)
    if last is None or last["step"] != ckpt_step or not (workdir / "eval_accuracy.png").is_file():
        return False
    if cfg.train.export and not (workdir / "final" / "config.json").is_file():
        return False
    budget = cfg.train.time_budget_s
    return ckpt_step >= cfg.train.steps or bool(budget and last["wall_time"] >= budget)


def _progress_bar(cfg: ExperimentConfig, start_step: int, elapsed: float, enabled: bool) -> tqdm:
    """Steps against `train.steps`, or training seconds against `train.time_budget_s` when a budget bounds the run."""
    budget = cfg.train.time_budget_s
    if budget:
        return tqdm(
            total=budget,
            initial=min(elapsed, budget),
            unit="s",
            disable=not enabled,
            dynamic_ncols=True,
            bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s of training [{elapsed}<{remaining}{postfix}]",
        )
    return tqdm(total=cfg.train.steps, initial=start_step, unit="step", disable=not enabled, dynamic_ncols=True)


def _summary(
    cfg: ExperimentConfig, workdir: epath.Path, records: list[dict], resumed_from: int, ran_steps: int
) -> dict:
    last = last_eval(records) or {}
    outputs = {
        "metrics": workdir / "metrics.jsonl",
        "tensorboard": workdir / "tb",
        "plot": workdir / "eval_accuracy.png",
        "checkpoints": workdir / "checkpoints",
        "model": workdir / "final",
    }
    return {
        "method": cfg.method,
        "steps": last.get("step"),
        "ran_steps": ran_steps,
        "resumed_from": resumed_from,
        "wall_time": last.get("wall_time"),
        "initial_eval_accuracy": first_eval(records),
        "final_eval_accuracy": last.get("eval_accuracy"),
        "paths": {k: str(v) for k, v in outputs.items() if v.exists()},
    }


def _print_summary(s: dict, what: str) -> None:
    resumed = f", resumed from step {s['resumed_from']}" if s["resumed_from"] and s["ran_steps"] else ""
    lines = [
        f"[esroll] {s['method']}: {what} — {s['steps']} steps, {s['wall_time']:.0f} s of training{resumed}",
        f"[esroll] held-out accuracy {s['initial_eval_accuracy']:.3f} -> {s['final_eval_accuracy']:.3f}",
        *(f"[esroll]   {name:<12}{path}" for name, path in s["paths"].items()),
    ]
    print("\n".join(lines), flush=True)
