"""Tasks (GSM8K, GSM-Symbolic, synthetic arithmetic, Countdown, and any registered with `register_task`), prompts,
scoring, splits and resumable batching."""

from esroll.data import builtin_tasks  # noqa: F401  (registers the built-in tasks)
from esroll.data.batching import batch_indices, epoch_permutation, get_batch, split_examples
from esroll.data.build import make_splits
from esroll.data.gsm8k import example_from_gsm8k, load_gsm8k, to_gsm8k_dict, write_jsonl
from esroll.data.gsm_symbolic import gsm_symbolic_templates, make_gsm_symbolic, make_gsm_symbolic_splits
from esroll.data.synthetic import make_arith_steps, make_arithmetic, make_countdown
from esroll.data.tasks import (
    PLAIN_TEMPLATE,
    TASKS,
    TEMPLATES,
    Example,
    TaskSpec,
    cluster_key,
    eval_score_names,
    eval_scores,
    format_prompt,
    own_prompt,
    parse_answer,
    prefix_states,
    register_task,
    score,
    step_states,
    task_options,
    task_spec,
)

__all__ = [
    "PLAIN_TEMPLATE",
    "TASKS",
    "TEMPLATES",
    "Example",
    "TaskSpec",
    "batch_indices",
    "cluster_key",
    "epoch_permutation",
    "eval_score_names",
    "eval_scores",
    "example_from_gsm8k",
    "format_prompt",
    "get_batch",
    "gsm_symbolic_templates",
    "load_gsm8k",
    "make_arith_steps",
    "make_arithmetic",
    "make_countdown",
    "make_gsm_symbolic",
    "make_gsm_symbolic_splits",
    "make_splits",
    "own_prompt",
    "parse_answer",
    "prefix_states",
    "register_task",
    "score",
    "split_examples",
    "step_states",
    "task_options",
    "task_spec",
    "to_gsm8k_dict",
    "write_jsonl",
]
