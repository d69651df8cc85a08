"""The layout's rules, read from the source: no import circle among esroll's modules, no module of `esroll/` or
`experiments/` over 450 lines, and no environment or reasoning-step module that reaches a training method."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = REPO / "esroll"
MAX_LINES = 450


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(name: str, path: Path) -> set[str]:
    """The esroll modules `name` imports anywhere in its file (function bodies included: an import deferred into a
    function still ties the two modules), each resolved to the module itself: `from esroll.grpo import advantages`
    is the module `esroll.grpo.advantages`, `from esroll.grpo import Group` the package `esroll.grpo`. Imports under
    `if TYPE_CHECKING:` do not run, and are left out."""
    tree = ast.parse(path.read_text(), str(path))
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for child in node.body
        for n in ast.walk(child)
    }
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    # Importing a.b.c first runs the packages a and a.b (their __init__.py), unless they are already being imported:
    # the packages `name` itself sits in.
    own = {name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)} | {name}
    parents = {m.rsplit(".", k)[0] for m in found for k in range(1, m.count(".") + 1)}
    return {m for m in found | (parents - own) if m in MODULES and m != name}


GRAPH = {name: imported(name, path) for name, path in MODULES.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as [a, b, ..., a], or None (depth-first search, iterative)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def reachable(name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        for m in GRAPH[todo.pop()]:
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def test_the_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_the_imports_it_must():
    """The reader resolves both spellings of an import: `from esroll.grpo import method` is the module, and a name
    taken from a package is the package."""
    assert "esroll.grpo.method" in GRAPH["esroll.methods"] and "esroll.es.plan" in GRAPH["esroll.methods"]
    assert "esroll.agents" in GRAPH["esroll.task"]


def test_no_import_cycle_among_esrolls_modules():
    assert find_cycle(GRAPH) is None, " -> ".join(find_cycle(GRAPH))


@pytest.mark.parametrize("package", ["esroll.agents", "esroll.steps"])
def test_environments_and_steps_reach_no_training_method(package):
    """Nothing an environment or a reasoning-step module imports, directly or through others, is a training method's
    code: what an estimator reads of episodes or steps is checked by the method that owns it."""
    for name in (m for m in MODULES if m == package or m.startswith(package + ".")):
        methods = sorted(
            m for m in reachable(name) | {name} if m.split(".")[:2] in (["esroll", "grpo"], ["esroll", "es"])
        )
        assert not methods, f"{name} reaches {methods}"


def test_no_module_is_over_450_lines():
    long = {
        str(p.relative_to(REPO)): n
        for folder in ("esroll", "experiments")
        for p in sorted((REPO / folder).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


# ---- the e2e marker

TESTS = REPO / "tests"
RUNS = re.compile(r"\b(?:train_and_evaluate|subprocess\.|Popen|check_exact_resume|NotebookClient)\b")


def test_every_test_that_trains_or_spawns_a_process_is_marked_e2e():
    """A test that runs the trainer or spawns a process, itself or through a fixture or helper of its file or of
    conftest.py, carries the `e2e` marker, so that `pytest -m "not e2e"` stays the fast loop."""
    shared = {
        n.name: n for n in ast.walk(ast.parse((TESTS / "conftest.py").read_text())) if isinstance(n, ast.FunctionDef)
    }
    unmarked = []
    for path in sorted(TESTS.rglob("test_*.py")):
        if path.resolve() == Path(__file__).resolve():  # this file names what it looks for, and runs none of it
            continue
        tree = ast.parse(path.read_text())
        module_marks = "pytest.mark.e2e" in "".join(
            ast.unparse(n) for n in tree.body if isinstance(n, ast.Assign) and "pytestmark" in ast.unparse(n)
        )
        # what a name of the file stands for: a function (a test, fixture or helper) or a module-level value (a
        # table of cases), searched for what it runs and for the names it uses
        functions = {**shared, **{n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}}
        for n in tree.body:
            if isinstance(n, ast.Assign):
                functions.update({t.id: n.value for t in n.targets if isinstance(t, ast.Name)})
        memo: dict[str, bool] = {}

        def runs(name: str, seen: tuple = ()) -> bool:
            if name not in memo:
                f = functions[name]
                used = {a.arg for a in f.args.args} if isinstance(f, ast.FunctionDef) else set()
                used |= {n.id for n in ast.walk(f) if isinstance(n, ast.Name)}
                memo[name] = bool(RUNS.search(ast.unparse(f))) or any(
                    runs(u, (*seen, name)) for u in used if u in functions and u not in (*seen, name)
                )
            return memo[name]

        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and runs(node.name):
                marked = any("pytest.mark.e2e" in ast.unparse(d) for d in node.decorator_list)
                if not (marked or module_marks):
                    unmarked.append(f"{path.relative_to(REPO)}::{node.name}")
    assert not unmarked, unmarked
