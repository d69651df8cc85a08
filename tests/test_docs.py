"""The documentation against the code: README length, relative links, the README's commands, the config reference,
and notebooks free of execution metadata and absolute paths."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from conftest import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"
MARKDOWN = [README, *sorted(DOCS.rglob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text: str) -> str:
    """`text` without fenced code blocks and inline code spans (links there are not links)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", FENCE.sub("", path.read_text()), re.M)}


def test_readme_is_at_most_300_lines():
    assert len(README.read_text().splitlines()) <= 300


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    """Every relative link (and image) of README.md and docs/**/*.md names a file or folder inside the repository, and
    an anchor into a Markdown page names one of its headings."""
    problems = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.is_relative_to(REPO):
            problems.append(f"{target}: outside the repository")
        elif not resolved.exists():
            problems.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            problems.append(f"{target}: no heading #{anchor}")
    assert not problems, problems


def test_docs_never_point_outside_the_repository():
    for page in MARKDOWN:
        assert "../shared" not in page.read_text(), page


# ---- the README's commands


def shell_blocks(text: str) -> list[str]:
    """The contents of the fenced code blocks marked bash, sh, shell or console, or not marked at all."""
    blocks, language, lines = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if language is None:
                language, lines = line[3:].strip(), []
            else:
                if language in ("", "bash", "sh", "shell", "console"):
                    blocks.append("\n".join(lines) + "\n")
                language = None
        elif language is not None:
            lines.append(line)
    return blocks


def readme_commands() -> list[list[str]]:
    """Every `python -m MODULE ...` command of the README's shell code blocks, as argv from `-m` on (continuation
    lines joined, comments and environment assignments dropped)."""
    commands = []
    for block in shell_blocks(README.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            for i, word in enumerate(words[:-1]):
                if re.fullmatch(r"(.*/)?python3?", word) and words[i + 1] == "-m":
                    commands.append(words[i + 1 :])
                    break
    return commands


def test_readme_has_commands():
    modules = {c[1] for c in readme_commands()}
    assert {"experiments.train", "experiments.plan"} <= modules


@pytest.mark.e2e
@pytest.mark.parametrize("argv", readme_commands(), ids=lambda a: " ".join(a[1:4]))
def test_readme_command_parses(argv):
    """`--help` with the command's own flags exits 0, and every flag it passes is one the script (or, for
    `--config.KEY`, its config file) knows."""
    proc = subprocess.run([sys.executable, *argv, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    help_text = proc.stdout
    assert "error:" not in help_text, help_text[-2000:]
    for word in argv[2:]:
        if not word.startswith("--"):
            continue
        name = word[2:].split("=", 1)[0]
        if name.startswith("config."):
            assert re.search(rf"^\s+{re.escape(name[len('config.') :])} = ", help_text, re.M), word
        else:
            assert re.search(rf"--(\[no\])?{re.escape(name)}\b", help_text), word


# ---- the config reference


def config_keys() -> dict[str, object]:
    """Every key of an experiment config (dotted, as config files and --config.KEY spell it) and its default, the
    registered options of the built-in estimators, variants and shapings included."""
    from esroll.config import ExperimentConfig
    from esroll.experiment import check_names

    keys = {}

    def walk(obj, prefix):
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{field.name}.")
            elif isinstance(value, dict):  # an options section: {registered name: its options dataclass}
                for name, options in value.items():
                    walk(options, f"{prefix}{field.name}.{name}.")
            else:
                keys[prefix + field.name] = value

    walk(check_names(ExperimentConfig()), "")
    return keys


def documented_keys() -> dict[str, str]:
    rows = re.findall(r"^\| `([a-z0-9_.]+)` \| `(.*?)` \|", (DOCS / "config.md").read_text(), re.M)
    assert len(rows) == len({k for k, _ in rows}), "a key listed twice"
    return dict(rows)


def test_config_reference_lists_every_key_with_its_default():
    keys, documented = config_keys(), documented_keys()
    missing = sorted(set(keys) - set(documented))
    unknown = sorted(set(documented) - set(keys))
    assert not missing, f"docs/config.md lacks {missing}"
    assert not unknown, f"docs/config.md lists keys that do not exist: {unknown}"
    wrong = {k: (documented[k], repr(v)) for k, v in keys.items() if documented[k] != repr(v)}
    assert not wrong, f"docs/config.md defaults differ from esroll.config (page, code): {wrong}"


# ---- notebooks


@pytest.mark.parametrize("notebook", sorted((REPO / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_notebook_has_no_execution_metadata_or_absolute_paths(notebook):
    text = notebook.read_text()
    nb = json.loads(text)
    for cell in nb["cells"]:
        assert "execution" not in cell.get("metadata", {}), "cell execution timestamps"
    assert not re.search(r"\d{4}-\d\d-\d\dT\d\d:\d\d", text), "a timestamp"
    assert not re.search(r"(?<![\w.~])/(home|work|tmp|root|Users|mnt|opt|var)/", text), "an absolute path"
    assert not re.search(r"[A-Za-z]:\\\\(Users|home)", text), "an absolute Windows path"


def test_readme_names_every_notebook():
    text = README.read_text()
    missing = [p.name for p in sorted((REPO / "notebooks").glob("*.ipynb")) if f"notebooks/{p.name}" not in text]
    assert not missing, f"README.md does not name {missing}"


# ---- no development narrative

NARRATIVE = re.compile(
    r"\bsessions?\b|\bone-off\b|tried and not kept|earlier version|\bZen ?\d\b|CPU family|\bwas available\b"
    r"|no accelerator was lent|this machine|LOG\.md|\.\./shared",
    re.I,
)
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def _notebook_text(path: Path) -> str:
    """A notebook's cell sources and text outputs (not its images)."""
    nb = json.loads(path.read_text())
    parts = []
    for cell in nb["cells"]:
        parts.append("".join(cell["source"]))
        for out in cell.get("outputs", []):
            parts.append("".join(out.get("text", "")))
            parts.append("".join(out.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


def narrative_sources() -> list[Path]:
    paths = [*MARKDOWN, *sorted((REPO / "notebooks").glob("*.ipynb"))]
    for folder in ("configs", "experiments", "esroll"):
        paths += sorted((REPO / folder).rglob("*.py"))
    return [p for p in paths if p != DOCS / "theory.md"]


def test_no_development_narrative():
    """No diary: no work periods, throwaway scripts, abandoned attempts, host CPU generations or machine availability,
    and no dates outside the pages that report when a figure was measured (docs/results, docs/benchmarks.md)."""
    found = []
    for path in narrative_sources():
        text = _notebook_text(path) if path.suffix == ".ipynb" else path.read_text()
        found += [f"{path.relative_to(REPO)}: {m.group()!r}" for m in NARRATIVE.finditer(text)]
        dated = path.is_relative_to(DOCS / "results") or path == DOCS / "benchmarks.md"
        if not dated:
            found += [f"{path.relative_to(REPO)}: date {m.group()}" for m in DATE.finditer(text)]
    assert not found, found
