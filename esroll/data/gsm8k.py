"""GSM8K-schema data (`question`, `answer` ending in "#### <number>") from JSONL, Parquet, or the `datasets` hub.

Every row is validated on load, so a bad file fails at start-up with its name and line rather than mid-training.
"""

import json
import os
import re
from pathlib import Path
from typing import Any, Iterable, Iterator

from esroll import rewards
from esroll.data.tasks import Example

_CALCULATOR = re.compile(r"<<[^<>]*>>")  # GSM8K's "<<48/2=24>>" calculator annotations
_SUFFIXES = (".jsonl", ".parquet")


def example_from_gsm8k(row: Any, where: str = "row", task: str = "gsm8k") -> Example:
    """Validate one {question, answer} row and turn it into an Example; ValueError names `where` and the problem."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected an object with 'question' and 'answer', got {type(row).__name__}")
    for key in ("question", "answer"):
        if key not in row:
            raise ValueError(f"{where}: missing key {key!r}")
        if not isinstance(row[key], str) or not row[key].strip():
            raise ValueError(f"{where}: {key!r} must be a non-empty string, got {row[key]!r:.60}")
    question, solution = row["question"].strip(), row["answer"].strip()
    gold = rewards.parse_gold(solution) if "####" in solution else None
    if gold is None:
        raise ValueError(f"{where}: 'answer' must end in '#### <number>', got ...{solution[-40:]!r}")
    target = _CALCULATOR.sub("", solution)
    return Example(task=task, prompt=question, answer=gold, solution=solution, target_text=f" {target}")


def to_gsm8k_dict(example: Example) -> dict[str, str]:
    """The GSM8K-schema row of an Example, for writing JSONL that `load_gsm8k` reads back."""
    return {"question": example.prompt, "answer": example.solution}


def write_jsonl(examples: Iterable[Example], path: str | os.PathLike) -> None:
    """Write examples as GSM8K-schema JSONL, one row per line."""
    with open(path, "w", encoding="utf-8") as f:
        for example in examples:
            f.write(json.dumps(to_gsm8k_dict(example), ensure_ascii=False) + "\n")


def _jsonl_rows(path: Path) -> Iterator[tuple[Any, str]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield json.loads(line), f"{path}:{lineno}"
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None


def _parquet_rows(path: Path) -> Iterator[tuple[Any, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            f"reading {path} needs pyarrow (pip install -e '.[tasks]'), or convert it to .jsonl"
        ) from None
    for index, row in enumerate(pq.read_table(path).to_pylist(), start=1):
        yield row, f"{path}: row {index}"


def _hub_rows(name: str, split: str, config: str) -> Iterator[tuple[Any, str]]:
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"{name!r} is not a local file, and loading it by name needs `datasets` (pip install -e '.[tasks]'); "
            "or pass a local .jsonl/.parquet path"
        ) from None
    try:
        rows = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # offline, unknown name, or bad split: all one message
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(
            f"could not load {name!r} ({config}, {split}) with `datasets`: {reason}; "
            "when offline pass a local .jsonl/.parquet path"
        ) from None
    for index, row in enumerate(rows, start=1):
        yield row, f"{name}[{split}] row {index}"


def _resolve_file(path: Path, split: str) -> Path:
    """A file as given, or the single `<split>*.jsonl|parquet` file under a directory (HF hub layout)."""
    if path.is_file():
        return path
    matches = sorted(p for p in path.rglob(f"{split}*") if p.suffix in _SUFFIXES)
    if len(matches) != 1:
        raise ValueError(f"{path}: expected one '{split}*.jsonl' or '{split}*.parquet' file, found {len(matches)}")
    return matches[0]


def load_gsm8k(path_or_name: str | os.PathLike, split: str = "train", *, config: str = "main") -> list[Example]:
    """Load GSM8K-schema rows as Examples.

    An existing path is read locally: a .jsonl or .parquet file, or a directory holding one `<split>*` file (`split`
    is otherwise ignored). Anything else is a `datasets` hub name, e.g. "openai/gsm8k" with `config` "main".
    """
    path = Path(path_or_name)
    if path.exists():
        path = _resolve_file(path, split)
        rows = _parquet_rows(path) if path.suffix == ".parquet" else _jsonl_rows(path)
        source = str(path)
    elif path.suffix in _SUFFIXES:
        raise FileNotFoundError(f"{path}: no such file")
    else:
        rows, source = _hub_rows(str(path_or_name), split, config), str(path_or_name)
    examples = [example_from_gsm8k(row, where) for row, where in rows]
    if not examples:
        raise ValueError(f"{source}: no examples")
    return examples
