"""Where a GRPO step's time goes, op by op: esroll (XLA, from `jax.profiler`'s trace) and TRL (PyTorch, from
`torch.profiler`), on the step of grpo_step_vs_trl (mid shape, 8 prompts × 8 completions × 64 new tokens, one
device for esroll, TRL at one intra-op thread per core).

grpo_profile: one step of each side after warm-up steps, traced. Each op's self time (its span minus the spans
nested in it) is summed by op and by kind: `matmul` (dots, whether XLA fused them or oneDNN / XNNPACK ran them;
aten mm / bmm / addmm / linear), `attention` (PyTorch's attention kernels; XLA fuses attention into dots and
fusions), `fusion` (elementwise and reduction work: XLA's fused loops, PyTorch's other aten ops), `copy` (copies,
transposes, concatenations, dynamic slices and updates), `other`. Phases: generation (esroll's `generate`, TRL's `transformers.generate`) and
the rest (scoring and the update). The figure is esroll's step time over TRL's (above 1: TRL is faster).
"""

from __future__ import annotations

import collections
import glob
import os
import tempfile
import time

import jax

from esroll import parallel
from experiments.benchmarks import _idtask
from experiments.benchmarks._shapes import shape_name

KINDS = ("matmul", "attention", "fusion", "copy", "other")


def xla_kind(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("dot", "ynn", "onednn", "matmul", "convolution", "gemm")):
        return "matmul"
    if any(k in n for k in ("copy", "transpose", "concatenate", "dynamic-slice", "dynamic-update-slice", "slice")):
        return "copy"
    if "fusion" in n or n.startswith(("reduce", "add", "multiply", "exp", "select", "broadcast")):
        return "fusion"
    return "other"


def torch_kind(name: str) -> str:
    n = name.lower()
    if "attention" in n or "softmax" in n and "log" not in n:
        return "attention"
    if any(k in n for k in ("::mm", "::bmm", "addmm", "::matmul", "::linear", "baddbmm")):
        return "matmul"
    if any(k in n for k in ("copy", "::cat", "transpose", "contiguous", "index", "slice", "clone", "::to")):
        return "copy"
    return "other" if "::" not in n else "fusion" if "backward" not in n else "other"


def _self_times(events) -> list[tuple[str, str, int]]:
    """(name, HLO module, self ns) of a line's events, children's spans subtracted from their parent's."""
    out, stack = [], []  # stack entries: [name, module, end, self ns]
    for e in sorted(events, key=lambda e: (e.start_ns, -e.duration_ns)):
        start, end = e.start_ns, e.start_ns + e.duration_ns
        while stack and stack[-1][2] <= start:
            out.append(stack.pop())
        if stack:
            stack[-1][3] -= min(end, stack[-1][2]) - start
        module = next((str(v) for k, v in e.stats if k == "hlo_module"), "")
        stack.append([e.name, module, end, e.duration_ns])
    return [(name, module, ns) for name, module, _, ns in out + stack[::-1]]


def trace_xla(fn, folder: str) -> tuple[dict, dict]:
    """Run fn() under jax.profiler; returns ({op: seconds}, {program: seconds}) of the ops XLA ran, summed over the
    threads that ran them (independent ops run side by side, so the sum can exceed the wall time); ops by HLO name
    without its number, programs as "generate" (the sampler's) or "rest"."""
    from jax.profiler import ProfileData

    jax.profiler.start_trace(folder)
    try:
        jax.block_until_ready(fn())
    finally:
        jax.profiler.stop_trace()
    path = max(glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    host = ProfileData.from_file(path).find_plane_with_name("/host:CPU")
    by_op, by_phase = collections.Counter(), collections.Counter()
    skip = ("ThreadpoolListener", "end:", "ThunkExecutor", "SlinkyThreadPool")  # bookkeeping and waits, not ops
    for line in host.lines:
        if not line.name.startswith("tf_XLA"):  # the executor's thread and the pool it runs independent ops on
            continue
        for name, module, ns in _self_times(e for e in line.events if not e.name.startswith(skip)):
            base, _, number = name.rpartition(".")
            by_op[base if number.isdigit() else name] += ns / 1e9
            by_phase["generate" if "generate" in module else "rest"] += ns / 1e9
    return dict(by_op), dict(by_phase)


def _by_kind(by_op: dict, kind) -> dict:
    out = dict.fromkeys(KINDS, 0.0)
    for name, seconds in by_op.items():
        out[kind(name)] += seconds
    return out


def _top(by_op: dict, n: int = 8) -> dict:
    return {k: round(v, 3) for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:n]}


def _trl_profiled_step(cfg, folder: str, batches, warmup: int) -> dict:
    """TRL's GRPOTrainer for warmup + 1 steps; the last under torch.profiler. Returns op self times, the step's wall
    time, and TRL's own timing of its generation call."""
    import torch
    from transformers import TrainerCallback
    from trl.extras import profiling

    from experiments.benchmarks.grpo import train_trl

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    spans = collections.Counter()
    original = profiling.ProfilingContext._log_metrics

    def log_metrics(self, duration):  # TRL's own spans (its generate call among them), kept for the profiled step
        spans[self.name] += duration
        original(self, duration)

    out = {}

    class Profile(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == warmup:
                spans.clear()
                self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self.prof.__enter__()
                self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == warmup + 1:
                out["step_s"] = time.perf_counter() - self.start
                self.prof.__exit__(None, None, None)
                out["ops"] = {e.key: e.self_cpu_time_total / 1e6 for e in self.prof.key_averages()}
                out["spans"] = dict(spans)

    profiling.ProfilingContext._log_metrics = log_metrics
    try:
        out["mixed_precision"] = train_trl(cfg, folder, batches, warmup + 1, Profile())
    finally:
        profiling.ProfilingContext._log_metrics = original
    return out


def grpo_profile(args) -> dict:
    try:
        import torch
        import trl
    except ImportError as e:
        return {"grpo_profile": None, "reason": f"TRL is not installed ({e}); pip install -e '.[bench]'"}
    X, G, n, prompt_len, warmup, _ = _idtask.GRPO_SIZES["quick" if args.quick else "full"]
    name = shape_name(args)
    with tempfile.TemporaryDirectory() as folder:
        model_cfg, params = _idtask.save_model(folder, name)
        cfg = _idtask.grpo_config(folder, X, G, n, args.grpo_remat)
        batches = [_idtask.prompts(model_cfg.vocab_size, X, prompt_len, seed=i) for i in range(warmup + 1)]
        mesh = parallel.make_mesh(1)
        step = _idtask.grpo_stepper(cfg, model_cfg, params, batches, prompt_len, mesh)
        for i in range(warmup):
            step(i)
        start = time.perf_counter()
        ours_ops, ours_phases = trace_xla(lambda: step(warmup), os.path.join(folder, "trace"))
        ours_s = time.perf_counter() - start
        trl_out = _trl_profiled_step(cfg, folder, batches, warmup)
    trl_generate = sum(v for k, v in trl_out["spans"].items() if k.endswith("generate"))
    return {
        "grpo_profile": ours_s / trl_out["step_s"],
        "esroll_step_s": ours_s,
        "trl_step_s": trl_out["step_s"],
        "esroll_generate_s": ours_phases.get("generate", 0.0),
        "esroll_rest_s": ours_phases.get("rest", 0.0),
        "trl_generate_s": trl_generate,
        "trl_rest_s": trl_out["step_s"] - trl_generate,
        **{f"esroll_{k}_s": v for k, v in _by_kind(ours_ops, xla_kind).items()},
        **{f"trl_{k}_s": v for k, v in _by_kind(trl_out["ops"], torch_kind).items()},
        "esroll_top_ops_s": _top(ours_ops),
        "trl_top_ops_s": _top(trl_out["ops"]),
        "trl_spans_s": {k: round(v, 3) for k, v in trl_out["spans"].items()},
        **_idtask.grpo_context(name, cfg, prompt_len, warmup, 1, {"ours": mesh}),
        "trl_version": trl.__version__,
        "torch_version": torch.__version__,
        "trl_threads": torch.get_num_threads(),
        "trl_mixed_precision": trl_out["mixed_precision"],
        "timing": "one traced step of each side after warm-up steps; op times are self times (nested ops "
        "subtracted), XLA's from its executor threads, PyTorch's self CPU time per op",
    }


BENCHMARKS = {"grpo_profile": grpo_profile}
