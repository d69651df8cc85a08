"""The row type shared by every task, prompt formatting, the task registry (`register_task`), and scoring a
completion against a row by its task's scorer."""

import dataclasses
import itertools
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

from esroll import rewards
from esroll.config import DataConfig
from esroll.registry import Registry

# The fixed "plain" template. The tiny shipped model is trained on synthetic arithmetic with exactly this template
# and the completion `Example.target_text` (" 47"), so changing it invalidates that model.
PLAIN_TEMPLATE = "Question: {question}\nAnswer:"
TEMPLATES = ("plain", "chat")


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt and what counts as answering it.

    task: the registered task (`TASKS`) whose prompt format and scorer apply to the row.
    prompt: the question text, before any template.
    answer: the canonical gold number, e.g. "42".
    solution: a worked solution in GSM8K form ending in "#### <answer>" (Countdown: the constructing expression).
    target_text: the supervised completion after the template, e.g. " 47" (the trainer appends EOS).
    meta: task data the reward needs; Countdown stores `numbers` (a tuple) and `target` (an int). GSM-Symbolic stores
        the `template` id (an int) and its `draw`; sums store their `difficulty` (carries).
    prefix: a forced start of the answer, placed after the prompt (AdaPrefix, `esroll.curriculum`); the reward scores
        prefix + completion. Empty for every example a data loader makes.
    """

    task: str
    prompt: str
    answer: str
    solution: str
    target_text: str
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    prefix: str = ""


def format_prompt(
    question: str,
    tokenizer: Any = None,
    template: Literal["plain", "chat"] = "plain",
    system: str | None = None,
) -> str:
    """The model input for a question.

    "plain" fills `PLAIN_TEMPLATE` (after `system` and a blank line, if given). "chat" applies the tokenizer's chat
    template with a generation prompt and `enable_thinking=False` (Qwen3 non-thinking mode; templates that do not
    know the flag ignore it, since transformers forwards extra keyword arguments to the template).
    """
    if template == "plain":
        text = PLAIN_TEMPLATE.format(question=question)
        return f"{system}\n\n{text}" if system else text
    if template == "chat":
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("template='chat' needs a tokenizer with a chat template; use template='plain'")
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
    raise ValueError(f"unknown prompt template {template!r}; expected one of {', '.join(TEMPLATES)}")


# ---- the task registry: what `data.task` names

Scorer = Callable[[Example, str], float]


def own_prompt(example: Example) -> str:
    """The default prompt format: the example's question text as it is."""
    return example.prompt


class TaskSpec(NamedTuple):
    """What a task is: how its examples are built, how the model is asked, and how an answer is scored.

    name: what `data.task` names, and the `task` field of the examples it builds (scoring dispatches on it).
    splits(cfg: `esroll.config.DataConfig`) -> (train, held_out): lists of `Example`, built from the data section
        (its seed, sizes, paths and task knobs) and deterministic in it, no prompt in both. `esroll.data.make_splits`
        then applies what every task shares: `min_difficulty`, and the validation / test split of held_out.
    reward(example, completion) -> float: the task's own reward ("gold"), what held-out accuracy reports; it reads
        untrusted text, under the contract of `esroll.rewards.register_reward`.
    prompt(example) -> str: the question text the prompt template wraps (`data.template`: "plain" fills
        `PLAIN_TEMPLATE`, "chat" makes it the user message); `own_prompt` (the default) takes `example.prompt`.
    parse_answer(example, completion) -> str | None: the canonical answer a completion gives (None: it gives none),
        what the label-free mode (`data.reward = "majority"`) votes on; None when answers cannot be compared as
        strings, and `esroll.experiment.check_names` then refuses the label-free mode for the task.
    eval_scores: ((name, fn(example, completion) -> float), ...): held-out scores logged as eval_<name> next to
        eval_accuracy (the reward).
    reads: the `TASK_KNOBS` of the data section its `splits` reads (None: all of them, not declared); a knob it does
        not read is refused when set on the command line (`esroll.experiment.unread_keys`).
    """

    name: str
    splits: Callable[[DataConfig], tuple[list[Example], list[Example]]]
    reward: Scorer
    prompt: Callable[[Example], str] = own_prompt
    parse_answer: Callable[[Example, str], str | None] | None = None
    eval_scores: tuple[tuple[str, Scorer], ...] = ()
    reads: tuple[str, ...] | None = None
    step_state: Callable[[Example, Sequence[str]], Sequence[Hashable]] | None = None


def prefix_states(example: Example, steps: Sequence[str]) -> list[Hashable]:
    """The default state after each step: the completion's exact text through that step (so states meet only where
    completions share a prefix, and the group's steps form a prefix tree)."""
    return list(itertools.accumulate(steps))


def step_states(example: Example, steps: Sequence[str]) -> list[Hashable]:
    """The state key after each of `steps` by the example's task (`TaskSpec.step_state`, else `prefix_states`); a
    task's function that fails or returns the wrong number of keys is an error naming the task."""
    fn = TASKS.lookup(example.task).step_state or prefix_states
    try:
        keys = list(fn(example, steps))
    except Exception as e:  # a task's own code: say whose it is
        raise ValueError(f"task {example.task!r}: step_state failed on {len(steps)} steps: {e!r}") from e
    if len(keys) != len(steps):
        raise ValueError(f"task {example.task!r}: step_state gave {len(keys)} keys for {len(steps)} steps")
    return keys


# The keys of the data section that only some tasks read; the others (sizes of the held-out split, seeds, template,
# reward) apply to every task.
TASK_KNOBS = ("path", "eval_path", "n_examples", "digits", "ops", "n_terms", "word_problems", "countdown_numbers")


TASKS: Registry[TaskSpec] = Registry(
    "task", "data.task", options_key="data.options"
)  # the built-ins: `esroll.data.builtin_tasks`


def register_task(
    name: str,
    splits: Callable[[DataConfig], tuple[list[Example], list[Example]]],
    reward: Scorer,
    *,
    prompt: Callable[[Example], str] = own_prompt,
    parse_answer: Callable[[Example, str], str | None] | None = None,
    eval_scores: Mapping[str, Scorer] | None = None,
    reads: Iterable[str] | None = None,
    options: type | None = None,
    step_state: Callable[[Example, Sequence[str]], Sequence[Hashable]] | None = None,
    replace: bool = False,
) -> TaskSpec:
    """Register the task `data.task = name` selects (the fields are `TaskSpec`'s) and return its spec. `options`: the
    task's own frozen options dataclass (config keys `data.options.<name>.<field>`), which `splits` reads with
    `task_options(data_cfg)`. A name already registered is refused unless `replace` is set, so that two modules cannot
    silently shadow each other's task."""
    TASKS.check_new(name, replace=replace)
    if reads is not None:
        reads = tuple(reads)
        unknown = [k for k in reads if k not in TASK_KNOBS]
        if unknown:
            raise ValueError(f"task {name!r}: reads {unknown[0]!r}, not one of {', '.join(TASK_KNOBS)}")
    extra = tuple((eval_scores or {}).items())
    named = {"splits": splits, "reward": reward, "prompt": prompt}
    if parse_answer is not None:
        named["parse_answer"] = parse_answer
    if step_state is not None:
        named["step_state"] = step_state
    named.update((f"eval_scores[{key!r}]", fn) for key, fn in extra)
    for what, fn in named.items():
        if not callable(fn):
            raise TypeError(f"task {name!r}: {what} must be callable, got {fn!r}")
    for key, _ in extra:
        if not isinstance(key, str) or not key.isidentifier() or key == "accuracy":
            raise ValueError(f"task {name!r}: eval score name {key!r} must be an identifier other than 'accuracy'")
    spec = TaskSpec(name, splits, reward, prompt, parse_answer, extra, reads, step_state)
    return TASKS.add(name, spec, options=options, replace=replace)


def task_options(cfg: DataConfig):
    """The options of `cfg.task` (`data.options.<task>`; its defaults when the config sets none; None for a task that
    registered none)."""
    return TASKS.options_of(cfg.options, cfg.task)


def task_spec(name: str) -> TaskSpec:
    """The registered task `name`."""
    return TASKS.lookup(name)


def score(example: Example, completion: str) -> float:
    """The reward of one completion for one row: its task's own reward (what `data.reward = "gold"` trains on)."""
    return float(task_spec(example.task).reward(example, completion))


def parse_answer(example: Example, completion: str) -> str | None:
    """The answer a completion gives, canonical (what label-free rewards vote on), by the row's task's parser; None if
    there is none. A task without a parser has no label-free mode."""
    spec = task_spec(example.task)
    if spec.parse_answer is None:
        voting = [t.name for t in TASKS.values() if t.parse_answer is not None]
        raise ValueError(f"task {example.task!r} has no parsed answer to vote on (label-free rewards: {voting})")
    return spec.parse_answer(example, completion)


def eval_score_names(task: str) -> tuple[str, ...]:
    """What held-out evaluation logs per completion of `task`: the reward ("accuracy"), then the task's other eval
    scores (numeric answers: "strict", the number after `####`, and "flexible", the last number, as GSM8K harnesses
    report them)."""
    return ("accuracy", *(name for name, _ in task_spec(task).eval_scores))


def eval_scores(example: Example, completion: str) -> tuple[float, ...]:
    """The scores `eval_score_names(example.task)` names, for one completion."""
    spec = task_spec(example.task)
    return (score(example, completion), *(float(fn(example, completion)) for _, fn in spec.eval_scores))


rewards.register_reward("gold", score)


def cluster_key(example: Example, key: str) -> str:
    """The cluster an example belongs to (BV-Blend's history, adaptive data schedules): `key` is "task", "difficulty"
    (`meta["difficulty"]` when the generator sets one, e.g. the carries of a sum; else the number of steps of the
    worked solution) or the name of a field of `example.meta`."""
    if key == "task":
        return example.task
    if key == "difficulty":
        if "difficulty" in example.meta:
            return f"difficulty={example.meta['difficulty']}"
        steps = [line for line in example.solution.split("####")[0].splitlines() if line.strip()]
        return f"steps={len(steps)}"
    if key not in example.meta:
        raise ValueError(
            f"cluster key {key!r}: the {example.task} examples have no such meta field ({sorted(example.meta)})"
        )
    return f"{key}={example.meta[key]}"
