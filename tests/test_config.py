"""esroll.config is a leaf: it imports nothing from esroll but the leaves esroll.errors and esroll.schedules, and no
order of importing the package's modules meets a cycle. Structure and ranges are checked when a config is built;
registered names by `esroll.experiment.check_names` (and the factories of configs built by hand), each refusal one
line naming the key."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import subprocess
import sys

import optax
import pytest

from configs.default import get_config
from esroll import config, curriculum, errors, es, grpo, schedules
from esroll.config import ConfigError, ExperimentConfig, InputError, from_config_dict
from esroll.es import estimators
from esroll.experiment import check_names

from conftest import REPO

PACKAGE = REPO / "esroll"


def esroll_modules() -> list[str]:
    """Every module of the package, by dotted name (a package by its own name)."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


# ---- the leaf and the cycle


def test_config_imports_nothing_from_esroll():
    """Not at the top, not in a function, not under TYPE_CHECKING: the config package imports only the standard
    library, optax (and ml_collections, which only `config_dict` needs), itself and the leaves `esroll.errors` and
    `esroll.schedules`, which import nothing from esroll."""
    leaves = {"esroll.errors", "esroll.schedules"}
    for path in [*sorted((PACKAGE / "config").glob("*.py")), PACKAGE / "errors.py", PACKAGE / "schedules.py"]:
        imported = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"relative import at line {node.lineno}"
                imported.append(node.module)
        ours = {name for name in imported if name.split(".")[0] == "esroll"}
        allowed = leaves | {"esroll.config"} if path.parent.name == "config" else set()
        assert all(
            name in allowed or name.startswith("esroll.config.") and path.parent.name == "config" for name in ours
        ), (path, ours)
        roots = {name.split(".")[0] for name in imported} - {"esroll"}
        assert roots <= set(sys.stdlib_module_names) | {"__future__", "optax", "ml_collections"}, (path, roots)


def _imports(path) -> set[str]:
    """The esroll-or-project modules `path` imports anywhere (top level, functions, TYPE_CHECKING), as written."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            out |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return out


def test_the_layers_keep_apart():
    """ES and GRPO never import each other; the model knows no method, no data and no reward; the library never
    imports experiments/ or configs/ (docs/architecture.md, "What never imports what")."""
    rules = {
        "es": ("esroll.grpo",),
        "grpo": ("esroll.es",),
        "models": tuple(f"esroll.{m}" for m in ("es", "grpo", "data", "rewards", "rollout", "task", "train")),
    }
    for path in sorted(PACKAGE.rglob("*.py")):
        imported = _imports(path)
        assert not {m for m in imported if m.split(".")[0] in ("experiments", "configs")}, path
        part = path.relative_to(PACKAGE).parts[0]
        for banned in rules.get(part, ()):
            bad = {m for m in imported if m == banned or m.startswith(banned + ".")}
            assert not bad, f"{path.relative_to(REPO)} imports {sorted(bad)}"


def test_the_report_imports_one_way():
    """Within `esroll.report` each module imports only those before it: runs, stats, then tables and plots, then
    write (`write_report`), then the package's re-exports; none imports `esroll.compare` (docs/architecture.md)."""
    order = ["runs", "stats", "tables", "plots", "write", "__init__"]
    assert sorted(p.stem for p in (PACKAGE / "report").glob("*.py")) == sorted(order)
    for i, name in enumerate(order):
        path = PACKAGE / "report" / f"{name}.py"
        imported = {m for m in _imports(path) if m.startswith("esroll.")}
        assert "esroll.report" not in imported, f"{path.relative_to(REPO)} imports the package, not its modules"
        assert not {m for m in imported if m.startswith("esroll.compare")}, path
        ours = {m.split(".")[2] for m in imported if m.startswith("esroll.report.")}
        later = ours - set(order[:i])
        assert not later, f"{path.relative_to(REPO)} imports {sorted(later)}, later in esroll.report"


@pytest.mark.e2e
def test_config_and_errors_do_not_import_jax():
    """What reads only configs, errors and workdirs (`esroll.report`) imports them without JAX."""
    code = "import sys, esroll.config, esroll.errors; assert 'jax' not in sys.modules, sorted(sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.e2e
def test_every_module_imports_in_one_interpreter():
    """A fresh interpreter imports every module of esroll/ one after another: no module's import breaks another's.
    (Import cycles, which show in some orders only, are what `test_every_module_imports_first` finds: it enters
    every module first.)"""
    modules = esroll_modules()
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    proc = subprocess.run([sys.executable, "-c", code, *modules], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.e2e
def test_every_module_imports_first():
    """Each module imported into an interpreter that holds no esroll module yet (the rest dropped from sys.modules
    between imports): whichever module of a cycle comes first, its import must complete."""
    code = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    for loaded in [m for m in sys.modules if m == 'esroll' or m.startswith('esroll.')]:\n"
        "        del sys.modules[loaded]\n"
        "    importlib.import_module(name)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *esroll_modules()], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr


def test_the_implementations_reexport_their_configs():
    assert es.ESConfig is config.ESConfig and es.ESSettings is config.ESSettings
    assert grpo.GRPOConfig is config.GRPOConfig
    assert curriculum.CurriculumConfig is config.CurriculumConfig
    assert schedules.make_schedule is config.make_schedule and schedules.SCHEDULES is config.SCHEDULES
    for name in ("InputError", "ConfigError", "check_fields"):
        assert getattr(errors, name) is getattr(config, name)
    assert estimators.num_directions("eggroll", 8) == 4 and estimators.num_directions("looroll", 8) == 8


# ---- structure and ranges: from_config_dict


def test_parallel_scan_unroll():
    cd = get_config("quick")
    assert from_config_dict(cd.to_dict()).parallel.scan_unroll == 1
    cd.parallel.scan_unroll = 4
    assert from_config_dict(cd.to_dict()).parallel.scan_unroll == 4
    cd.parallel.scan_unroll = 0
    with pytest.raises(ConfigError, match=r"^config: invalid value for 'parallel.scan_unroll': 0 \(expected >= 1\)$"):
        from_config_dict(cd.to_dict())
    d = get_config("quick").to_dict()
    d["parallel"]["decode_layers"] = "scan"
    with pytest.raises(InputError, match=r"^config: unknown key 'parallel.decode_layers'"):
        from_config_dict(d)


# ---- registered names: check_names


NAMES = [
    ("quick", "method", "cma"),
    ("quick", "data.task", "chess"),
    ("quick", "data.template", "fancy"),
    ("quick", "es.shaping", "foo"),
    ("quick", "es.prompt_shaping", "foo"),
    ("grpo_quick", "grpo.advantage", "foo"),
    ("grpo_quick", "grpo.aggregation", "sum"),
    ("grpo_quick", "grpo.remat", "some"),
    ("quick", "curriculum.prefix_source", "answer"),
]


@pytest.mark.parametrize("variant, key, value", NAMES)
def test_a_name_no_registry_holds_is_refused_in_one_line(variant, key, value):
    """from_config_dict takes the name (it cannot see the registries); check_names refuses it, naming the key."""
    cd = get_config(variant)
    section, _, field = key.rpartition(".")
    (cd[section] if section else cd)[field] = value
    cfg = from_config_dict(cd.to_dict())
    with pytest.raises(ConfigError) as e:
        check_names(cfg)
    message = str(e.value)
    assert message.startswith(f"config: invalid value for '{key}': '{value}' (expected one of "), message
    assert "\n" not in message


def test_names_that_depend_on_what_they_implement():
    cd = get_config("quick")
    cd.data.update(task="countdown", reward="majority")  # a vote needs numeric answers
    with pytest.raises(ConfigError, match=r"^config: invalid value for 'data.reward': 'majority' \(expected 'gold'"):
        check_names(from_config_dict(cd.to_dict()))


@pytest.mark.parametrize("variant", ["looroll", "eggroll", "grpo", "quick", "grpo_quick"])
def test_the_shipped_configs_name_registered_implementations(variant):
    """Checking changes no value: it only types the registered options (and fills in the defaults of those unset)."""
    cfg = from_config_dict(get_config(variant).to_dict())
    checked = check_names(cfg)
    assert dataclasses.asdict(checked) == dataclasses.asdict(cfg) and check_names(checked) == checked
    default = check_names(ExperimentConfig())
    assert type(default.grpo.adv["agrae"]).__name__ == "AgraeOptions" and default.grpo.adv["agrae"].positive == 1.0


@pytest.mark.e2e
def test_the_trainer_refuses_a_bad_name_before_writing(tmp_path):
    from esroll.train import train_and_evaluate

    cd = get_config("quick")
    cd.es.shaping = "foo"
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^config: invalid value for 'es.shaping': 'foo'"):
        train_and_evaluate(from_config_dict(cd.to_dict()), workdir, progress=False)
    assert not workdir.exists()


def test_a_comparison_refuses_a_bad_name():
    from configs.compare import get_config as compare_config
    from esroll.compare import comparison_from_dict

    d = compare_config("quick").to_dict()
    d["overrides"]["eggroll"]["es"] = {"shaping": "foo"}
    with pytest.raises(ConfigError, match=r"^config: invalid value for 'es.shaping': 'foo'"):
        comparison_from_dict(d)


@pytest.mark.e2e
def test_the_factories_refuse_configs_built_by_hand():
    """ESConfig and GRPOConfig built directly skip check_names: their factories look the names up."""
    with pytest.raises(ConfigError, match=r"^ESConfig: invalid value for 'method': 'bogus' \(expected one of "):
        es.make_strategy(es.ESConfig(method="bogus"), optax.sgd(1.0))
    with pytest.raises(ConfigError, match=r"^GRPOConfig: invalid value for 'aggregation': 'sum'"):
        grpo.make_update(None, config.GRPOConfig(aggregation="sum"), config.OptimConfig(), None)
    with pytest.raises(ConfigError, match=r"^config: invalid value for 'grpo.advantage': 'foo'"):
        grpo.make_grpo_method(ExperimentConfig(grpo=config.GRPOConfig(advantage="foo")), None, None)
    from esroll import methods

    assert methods.names() == (*estimators.ESTIMATORS, "grpo") == ("eggroll", "looroll", "grpo")


# ---- registered options: their keys, the renamed flat keys, and runs saved with those


def test_registered_options_are_config_keys_checked_with_the_nearest_name():
    cd = get_config("grpo_quick")
    cd.grpo.update(advantage="lampo")
    cd.grpo.adv.lampo.temperature = 0.25
    cfg = check_names(from_config_dict(cd.to_dict()))
    assert cfg.grpo.adv["lampo"].temperature == 0.25 and cfg.grpo.adv["maxpo"].k == 2  # the others at their defaults
    bad = get_config("grpo_quick")
    bad.grpo.adv.lampo.temperatur = 0.25
    with pytest.raises(
        InputError,
        match=r"^config: unknown key 'grpo.adv.lampo.temperatur' \(did you mean 'grpo.adv.lampo.temperature'\?\)$",
    ):
        check_names(from_config_dict(bad.to_dict()))
    bad = get_config("grpo_quick")
    bad.grpo.adv.lampo.temperature = -1.0
    with pytest.raises(
        InputError, match=r"^config: invalid value for 'grpo.adv.lampo.temperature': -1.0 \(expected >= 0\)$"
    ):
        check_names(from_config_dict(bad.to_dict()))
    bad = get_config("grpo_quick")
    bad.grpo.adv["lamp"] = {"temperature": 0.5}
    with pytest.raises(InputError, match=r"^config: unknown key 'grpo.adv.lamp' \(did you mean 'grpo.adv.lampo'\?\)$"):
        check_names(from_config_dict(bad.to_dict()))
    bad = get_config("grpo_quick")
    bad.grpo.variant_options.stare.alpha = 2.0
    with pytest.raises(InputError, match=r"'grpo.variant_options.stare.alpha': 2.0 \(expected in \[0, 1\]\)$"):
        check_names(from_config_dict(bad.to_dict()))


@pytest.mark.parametrize(
    ("key", "new"),
    [("grpo.adv.maxpo_k", "grpo.adv.maxpo.k"), ("grpo.adv.horizon", "grpo.adv.agrae.horizon")],
)
def test_a_renamed_key_is_refused_with_its_new_name(key, new):
    cd = get_config("grpo_quick")
    section, leaf = key.rsplit(".", 1)
    cd.grpo.adv[leaf] = 3
    with pytest.raises(InputError, match=rf"^config: key '{re.escape(key)}' is now '{re.escape(new)}'$"):
        from_config_dict(cd.to_dict())
    assert (
        config.unknown_key("grpo.stare", ["adv"]) == "config: section 'grpo.stare' is now 'grpo.variant_options.stare'"
    )


def test_a_run_saved_with_the_flat_option_keys_resumes(tmp_path):
    """A committed config.json written before the estimators and variants took their options beside their code
    (`grpo.adv.maxpo_k`, `grpo.stare.alpha`), and before the options of implementations registered since (a task's
    `data.options`): read as the current code reads it (`migrate`, then those options at their defaults:
    `esroll.experiment.as_current`) it is the config the current code builds from it, so `check_workdir` resumes the
    run, and `claim_workdir` leaves its file alone."""
    from esroll.checkpoint import check_workdir, claim_workdir
    from esroll.experiment import as_current

    saved = REPO / "docs" / "training_variance" / "grpo_s0" / "config.json"
    old = json.loads(saved.read_text())
    assert "maxpo_k" in old["grpo"]["adv"] and "stare" in old["grpo"]  # the layout this test is about
    migrated = config.migrate(old)
    assert migrated["grpo"]["adv"]["maxpo"] == {"k": old["grpo"]["adv"]["maxpo_k"]}
    assert migrated["grpo"]["variant_options"]["stare"] == old["grpo"]["stare"]
    assert "options" not in old["data"]  # saved before tasks had options
    cfg = check_names(from_config_dict(migrated))
    now = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
    assert as_current(old) == now and now["data"]["options"]["arith_steps"]["max_operands"] == 4
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text(saved.read_text())
    assert check_workdir(workdir, now, overwrite=False, current=as_current) is True
    claim_workdir(workdir, now, current=as_current)
    assert (workdir / "config.json").read_text() == saved.read_text() and not list(workdir.glob("replaced-*"))
    assert config.migrate(now) is now  # a current config is left as it is
