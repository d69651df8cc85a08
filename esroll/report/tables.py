"""The Markdown of a comparison's report (results.md, written by `esroll.report.write.write_report`): the
per-method table, the paired differences against the reference, the sample-efficiency tables and their notes
(`markdown_table`); the machine's speed over the runs and the tuned protocol's choices (`protocol_notes`).

Formats the rows of `esroll.report.stats.summarize` and the runs of `esroll.report.runs.load_comparison`: accuracies
and their differences in points of %, an undefined value (NaN) as —. Computes no statistics; imports from esroll only
`esroll.report.runs`, and no JAX.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from esroll.report.runs import RunResult


def _fmt(x: float, scale: float = 1.0, spec: str = ".1f") -> str:
    return "—" if math.isnan(x) else f"{scale * x:{spec}}"


def _pct(x: float) -> str:
    return _fmt(x, 100.0)


def _p(x: float) -> str:
    return _fmt(x, spec=".3f")


def _count(x: float) -> str:
    return _fmt(x, spec=",.0f")


def _sci(x: float) -> str:
    return _fmt(x, spec=".3e")


def _paired_rows(summary: Sequence[dict], ref: str, metrics: Sequence[tuple[str, str]], pairs: dict[str, str]) -> list:
    """Rows of a paired-differences table: per method (not the reference) and metric (key, label); `pairs` names the
    summary column counting a metric's pairs (default n_pairs)."""
    lines = []
    for r in summary:
        if r["method"] == ref:
            continue
        for key, label in metrics:
            lines.append(
                f"| {r['method']} | {label} | {r[pairs.get(key, 'n_pairs')]} | {_pct(r[f'{key}_diff_mean'])} "
                f"| [{_pct(r[f'{key}_diff_ci_low'])}, {_pct(r[f'{key}_diff_ci_high'])}] | {_p(r[f'{key}_diff_p_t'])} "
                f"| {_p(r[f'{key}_diff_p_holm'])} | {_p(r[f'{key}_diff_p_wilcoxon'])} | {_p(r[f'{key}_diff_p_sign'])} "
                f"| {_pct(r[f'{key}_diff_mde80'])} |"
            )
    return lines


_PAIRED_HEADER = [
    "| method | metric | pairs | mean diff | 95% CI (t) | paired t p | Holm p (t) | Wilcoxon p | sign test p "
    "| 80%-power effect |",
    "|---|---|---|---|---|---|---|---|---|---|",
]


def markdown_table(summary: Sequence[dict], spec: dict) -> str:
    """The results as Markdown: a per-method table, the paired differences against the reference, and notes."""
    ref, budget, n = spec["reference"], spec["time_budget_s"], len(spec["seeds"])
    lines = [
        (
            f"Budget {budget:g} s of training wall time per run (evaluation excluded); seeds {spec['seeds']}; "
            "accuracy in %; mean ± sd over seeds."
        ),
        "",
        (
            "| method | seeds | final accuracy | AUC (mean accuracy over the budget) | steps | evaluations | completions "
            "| all-equal groups | of them with a signal |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        lines.append(
            f"| {r['method']} | {r['n_seeds']} | {_pct(r['final_accuracy_mean'])} ± {_pct(r['final_accuracy_sd'])} "
            f"| {_pct(r['auc_mean'])} ± {_pct(r['auc_sd'])} | {_fmt(r['steps_mean'], spec='.0f')} "
            f"| {_fmt(r['evaluations_mean'], spec='.0f')} | {_fmt(r['completions_mean'], spec='.0f')} "
            f"| {_pct(r['all_equal_groups_mean'])} | {_pct(r['all_equal_signal_mean'])} |"
        )
    lines += ["", f"Paired differences against {ref} (method − {ref}, points of accuracy):", "", *_PAIRED_HEADER]
    lines += _paired_rows(summary, ref, (("final_accuracy", "final accuracy"), ("auc", "AUC")), {})
    x_c = summary[0]["range_completions"] if summary else math.nan
    x_t = summary[0]["range_tokens"] if summary else math.nan
    x_f = summary[0]["range_flops"] if summary else math.nan
    lines += [
        "",
        "Sample efficiency",
        "",
        (
            f"AUC against completions: mean accuracy over [0, X] completions generated for training, X = {_count(x_c)}; "
            f"against tokens: over [0, X] tokens generated for training, X = {_count(x_t)}; against FLOPs: over "
            f"[0, X] training FLOPs (rollout + update), X = {_sci(x_f)}. Final counts at the last evaluation; mean ± sd "
            "over seeds."
        ),
        "",
        (
            "| method | seeds | AUC vs completions | AUC vs tokens | AUC vs FLOPs | final completions | final tokens "
            "| final FLOPs |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        fewer = [
            f"{r[f'n_seeds_{view}']} with {what}"
            for view, what in (("tokens", "tokens"), ("flops", "FLOPs"))
            if r[f"n_seeds_{view}"] < r["n_seeds"]
        ]
        seeds = f"{r['n_seeds']}" + (f" ({', '.join(fewer)})" if fewer else "")
        lines.append(
            f"| {r['method']} | {seeds} | {_pct(r['auc_completions_mean'])} ± {_pct(r['auc_completions_sd'])} "
            f"| {_pct(r['auc_tokens_mean'])} ± {_pct(r['auc_tokens_sd'])} "
            f"| {_pct(r['auc_flops_mean'])} ± {_pct(r['auc_flops_sd'])} "
            f"| {_count(r['final_completions_mean'])} ± {_count(r['final_completions_sd'])} "
            f"| {_count(r['final_tokens_mean'])} ± {_count(r['final_tokens_sd'])} "
            f"| {_sci(r['final_flops_mean'])} ± {_sci(r['final_flops_sd'])} |"
        )
    lines += ["", f"Paired differences against {ref} (method − {ref}, points of accuracy):", "", *_PAIRED_HEADER]
    metrics = (
        ("auc_completions", "AUC vs completions"),
        ("auc_tokens", "AUC vs tokens"),
        ("auc_flops", "AUC vs FLOPs"),
    )
    lines += _paired_rows(summary, ref, metrics, {"auc_tokens": "n_pairs_tokens", "auc_flops": "n_pairs_flops"})
    untokened = [
        f"{r['method']} ({r['n_seeds'] - r['n_seeds_tokens']})" for r in summary if r["n_seeds_tokens"] < r["n_seeds"]
    ]
    skipped = (
        (
            f" Finished runs whose metrics carry no generation counters (logged before they existed): "
            f"{', '.join(untokened)}; their completions are steps × completions per step, and the tokens view "
            "(AUC, final tokens, the range and the pairs) leaves them out."
        )
        if untokened
        else ""
    )
    unflopped = [
        f"{r['method']} ({r['n_seeds'] - r['n_seeds_flops']})" for r in summary if r["n_seeds_flops"] < r["n_seeds"]
    ]
    if unflopped:
        skipped += (
            f" Finished runs whose metrics carry no FLOPs counter throughout (logged before it existed, or resumed "
            f"from a checkpoint that predates it): {', '.join(unflopped)}; the FLOPs view (AUC, final FLOPs, the range "
            "and the pairs) leaves them out."
        )
    lines += [
        "",
        (
            f"Notes. With n = {n} seeds the Wilcoxon signed-rank and sign tests cannot give a two-sided p below "
            f"2·0.5^n = {2 * 0.5**n:.3g}, however large the effect; the t-test assumes normal differences, which "
            f"n = {n} cannot check; the 80%-power effect is the smallest true mean difference the paired t-test "
            "would detect at 0.05 four times in five with these pairs' spread (a smaller effect can go unseen); "
            "Holm p adjusts each table's paired t p-values of one metric over the methods "
            "compared with the reference (family-wise error); — marks an undefined value (e.g. all differences "
            "equal). All-equal groups: the mean over steps of the fraction of prompts whose rewards are all equal "
            "(GRPO: over the group's completions; ES: over the members' rows), and of them the fraction the method "
            "still gives a learning signal (a non-zero advantage, or a fitness that still differs). Final accuracy: the "
            "evaluation after the step that used up the budget. AUC: trapezoids between evaluations over [0, budget], "
            "held at the last value, divided by the budget. Evaluations: ES population members × steps (each member "
            "scores all of a step's prompts); GRPO sampled completions. Completions: sequences generated for training."
        ),
        "",
        (
            "Sample efficiency. The same runs, accuracy against what they generated for training instead of wall "
            "time. Methods reach different counts within the time budget, so each count view is compared over a "
            "common range: X is the smallest final count (at the last evaluation) among the finished runs of all "
            "methods, and a run's AUC is its mean accuracy over [0, X] (trapezoids between evaluations, interpolated "
            "at X, divided by X). Every method is thus scored over the same range; beyond X only some runs have "
            f"data.{skipped}"
        ),
    ]
    return "\n".join(lines) + "\n"


def protocol_notes(workdir: Path, runs: Sequence[RunResult]) -> str:
    """Markdown: the machine's speed over the runs (the timed evaluation before training: the same greedy decoding of
    the same questions in every run of a method), and the tuned protocol's choices (workdir/tuning/choice.json)."""
    lines = []
    probes = [r.probe_s for r in runs if math.isfinite(r.probe_s)]
    if probes:
        med = float(np.median(probes))
        lines += [
            "",
            (
                f"Machine speed alongside: the held-out evaluation before training (greedy decoding, the same in "
                f"every run) took {med:.2f} s median, {min(probes):.2f}–{max(probes):.2f} s over {len(probes)} runs "
                f"(the fastest {min(probes) / med:.2f}×, the slowest {max(probes) / med:.2f}× the median)."
            ),
        ]
    choice_path = Path(workdir) / "tuning" / "choice.json"
    if choice_path.is_file():
        choice = json.loads(choice_path.read_text())
        lines += [
            "",
            (
                "Tuning: each method's settings (candidate 0 is its own), mean validation AUC over the tuning seeds; "
                "the chosen one in bold, then run on the evaluation seeds and scored on the test split."
            ),
            "",
            "| method | candidate | setting | validation AUC per tuning seed (%) | mean (%) |",
            "|---|---|---|---|---|",
        ]
        for method, c in choice.items():
            for cand in c["candidates"]:
                setting = json.dumps(cand["overrides"]) if cand["overrides"] else "its own"
                mark = "**" if cand["candidate"] == c["chosen"] else ""
                aucs = ", ".join(_pct(a) for a in cand["validation_auc"])
                lines.append(
                    f"| {method} | {mark}c{cand['candidate']}{mark} | `{setting}` | {aucs} | {_pct(cand['mean'])} |"
                )
    return "\n".join(lines) + ("\n" if lines else "")
