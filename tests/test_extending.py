"""docs/extending.md, run as written: its code blocks are read from the page and executed, so the page and this test
cannot drift apart. Each extension point's example registers its code, trains 2 steps on the shipped tiny model and
evaluates; the registered task also trains by name from the command line, through a config file that imports it. The
registries' own rules (duplicates, reserved names, the lifted shaping signature, the checks of registered names) are
tested at the end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, SHIPPED_MODEL
from esroll import rewards
from esroll.agents import ENVIRONMENTS, make_env
from esroll.es import estimators, shaping
from esroll.grpo import advantages
from esroll.grpo import variants as grpo_variants
from esroll.config import ConfigError, from_config_dict
from esroll.data import TASKS, Example, register_task
from esroll.experiment import check_names

DOC = REPO / "docs" / "extending.md"
FILE_BLOCK = re.compile(r"# (\w+\.py): ")  # a block whose first line names a file is saved as that file


def sections() -> dict[str, list[str]]:
    """The page's "### " sections, each as its python code blocks in order."""
    text = DOC.read_text()
    out = {}
    for part in re.split(r"^### ", text, flags=re.M)[1:]:
        title, _, body = part.partition("\n")
        out[title.strip()] = re.findall(r"```python\n(.*?)```", body, re.S)
    return out


def block_file(block: str) -> str | None:
    m = FILE_BLOCK.match(block)
    return m.group(1) if m else None


def run_section(title: str, folder) -> dict:
    """Save the section's file blocks in `folder` (importable) and execute its other blocks there, in order, in one
    namespace, as a reader pasting them at the repository root would (`assets/` is linked into the folder)."""
    (folder / "assets").symlink_to(REPO / "assets")
    namespace: dict = {"__name__": "__main__"}
    for block in sections()[title]:
        if (name := block_file(block)) is not None:
            (folder / name).write_text(block)
        else:
            exec(compile(block, f"{DOC.name}: {title}", "exec"), namespace)
    return namespace


@pytest.fixture
def registries(tmp_path, monkeypatch):
    """A folder to run in, on sys.path; every registry, and the modules the folder's files become, restored after."""
    registries = (TASKS, rewards.REWARDS, shaping.SHAPINGS, advantages.ESTIMATORS, grpo_variants.VARIANTS)
    registries += (estimators.ESTIMATORS, ENVIRONMENTS)
    saved = [(registry, dict(registry)) for registry in registries]
    saved += [(registry.options, dict(registry.options)) for registry in registries]
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(REPO))  # configs/, as from the repository root
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if getattr(sys.modules[name], "__file__", "") and str(tmp_path) in sys.modules[name].__file__:
            del sys.modules[name]
    for registry, items in saved:
        dict.clear(registry)
        dict.update(registry, items)


def metrics(workdir) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def check_trained(folder, run: str) -> list[dict]:
    """The run trained its 2 steps and evaluated before and after; returns its evaluation records."""
    evals = [r for r in metrics(folder / "runs" / run) if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert all(0.0 <= r["eval_accuracy"] <= 1.0 for r in evals)
    return evals


# ---- the page's examples


def test_the_page_has_one_example_per_extension_point():
    found = sections()
    titles = ("A task", "A reward", "A group-advantage estimator (GRPO)", "A GRPO variant", "A fitness shaping (ES)")
    titles += ("An ES estimator", "An environment")
    for title in titles:
        assert len(found[title]) == 2, title  # the registration, then a run that uses it
    assert [block_file(b) for b in found["A task"]] == ["my_tasks.py", None]
    assert [block_file(b) for b in found["From the command line"]] == ["my_config.py"]


def test_the_refusal_the_page_shows_is_the_one_check_names_gives():
    line = re.search(r"^error: (config: invalid value for 'data.task'.*)$", DOC.read_text(), re.M).group(1)
    cd = _quick()
    cd.data.task = "larger"
    with pytest.raises(ConfigError) as e:
        check_names(from_config_dict(cd.to_dict()))
    assert str(e.value) == line


@pytest.mark.e2e
def test_task_example(registries):
    namespace = run_section("A task", registries)
    assert namespace["summary"]["final_eval_accuracy"] is not None
    evals = check_trained(registries, "larger")
    assert all(0.0 <= r["eval_given"] <= 1.0 for r in evals)
    spec = TASKS["larger"]
    example = spec.splits(namespace["cfg"].data)[1][0]
    a, b = example.meta["numbers"]
    assert spec.prompt(example) == f"Which is larger, {a} or {b}? Reply with the number."
    assert spec.reward(example, f" {max(a, b)}") == 1.0 and spec.reward(example, "no idea") == 0.0
    assert spec.parse_answer(example, "it is 0052") == "52"


@pytest.mark.e2e
def test_reward_example(registries):
    run_section("A reward", registries)
    check_trained(registries, "close_enough")
    close_enough = rewards.get_reward("close_enough")
    example = Example(task="arithmetic", prompt="What is 50 + 50?", answer="100", solution="", target_text=" 100")
    assert close_enough(example, " 100") == 1.0
    assert close_enough(example, " 95") == pytest.approx(0.5)
    assert close_enough(example, " 80") == close_enough(example, "no number") == 0.0


def _ema_baseline_used(folder, run: str, decay: float) -> None:
    """The run's logged baseline: 0 at step 1, then (1 − decay) × step 1's mean reward (the estimator's state after
    one step from 0), so the decay the run read is the one its config set."""
    records = [r for r in metrics(folder / "runs" / run) if "ema_baseline" in r]
    assert [r["step"] for r in records] == [1, 2] and records[0]["ema_baseline"] == 0.0
    assert records[1]["ema_baseline"] == pytest.approx((1 - decay) * records[0]["reward_mean"], rel=1e-5, abs=1e-7)
    saved = json.loads((folder / "runs" / run / "config.json").read_text())
    assert saved["grpo"]["adv"]["ema_baseline"] == {"decay": decay}
    check_trained(folder, run)


@pytest.mark.e2e
def test_advantage_example(registries):
    """The page's estimator with its own option: set in a config in-process (0.8), then overridden on the command
    line of a config file that imports the module (0.5); each run's logged baseline follows the decay it was given."""
    run_section("A group-advantage estimator (GRPO)", registries)
    _ema_baseline_used(registries, "ema_baseline", 0.8)
    assert advantages.ESTIMATORS["ema_baseline"].single_rollout
    cd = _quick("grpo_quick")
    cd.grpo.update(advantage="ema_baseline", group_size=1)  # single_rollout=True allows groups of one
    check_names(from_config_dict(cd.to_dict()))
    for block in sections()["A task"] + sections()["From the command line"]:
        if (name := block_file(block)) is not None:
            (registries / name).write_text(block)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(registries), os.environ.get("PYTHONPATH", "")])}
    args = [  # the page's task too, by name: its config file imports both modules
        "--config.data.task=larger",
        "--config.grpo.advantage=ema_baseline",
        "--config.grpo.adv.ema_baseline.decay=0.5",
        "--config.train.steps=2",
    ]
    workdir = registries / "runs" / "ema_cli"
    command = [sys.executable, "-m", "experiments.train", "--config", f"{registries / 'my_config.py'}:grpo_quick"]
    command += [*args, f"--config.model.path={SHIPPED_MODEL}", "--workdir", str(workdir)]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _ema_baseline_used(registries, "ema_cli", 0.5)
    assert all("eval_given" in r for r in check_trained(registries, "ema_cli"))  # the registered task's own score
    typo = subprocess.run(
        [*command[:5], "--config.grpo.adv.ema_baseline.decya=0.5", "--workdir", str(registries / "runs" / "typo")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert typo.returncode == 2  # refused before absl parses the flags
    expected = "error: config: unknown key 'grpo.adv.ema_baseline.decya' (did you mean 'grpo.adv.ema_baseline.decay'?)"
    assert typo.stderr.strip().splitlines()[-1] == expected


@pytest.mark.e2e
def test_variant_example(registries):
    """The capped run logs its metric each step; the cap acts on the loss exactly as written: advantages beyond the
    limit are clipped, the others unchanged, and the metric counts the capped completion tokens."""
    run_section("A GRPO variant", registries)
    records = [r for r in metrics(registries / "runs" / "cap_advantage") if "capped_tokens" in r]
    assert [r["step"] for r in records] == [1, 2] and all(0.0 <= r["capped_tokens"] <= 1.0 for r in records)
    check_trained(registries, "cap_advantage")
    variant = grpo_variants.VARIANTS["cap_advantage"]
    mask = np.array([[True, True, False], [True, False, False]])
    advantage = np.array([[2.5, 0.3, -4.0], [-1.5, 0.0, 0.0]], np.float32)
    terms = grpo_variants.LossTerms(None, None, None, mask, advantage, 0.2, 0.2)
    expected = np.array([[1.0, 0.3, -1.0], [-1.0, 0.0, 0.0]], np.float32)
    np.testing.assert_array_equal(variant.loss_terms(None, terms).advantage, expected)
    assert float(variant.loss_metrics(None, terms)["capped_tokens"]) == pytest.approx(2 / 3)  # 2.5 and -1.5


@pytest.mark.e2e
def test_shaping_example(registries):
    run_section("A fitness shaping (ES)", registries)
    check_trained(registries, "above_median")
    shaped = shaping.get("above_median")
    np.testing.assert_array_equal(shaped(np.array([3.0, 1.0, 2.0, np.nan])), [0.5, -0.5, 0.0, 0.0])
    assert "above_median" not in advantages.ESTIMATORS  # ES's registry only: GRPO's estimators are registered apart


@pytest.mark.e2e
def test_es_estimator_example(registries):
    """The page's estimator is a training method: it trains by name, and its weights are the centred ranks of the
    pairs' differences, worked by hand: fitness (1, 0), (0, 1), (3, 0), (nan, 2) at σ = 1 gives differences 1, −1, 3
    on the 3 pairs kept (the fourth dropped whole), ranks 1, 0, 2 → centred 0, −1/2, 1/2, over 3σ."""
    run_section("An ES estimator", registries)
    check_trained(registries, "ranked_pairs")
    from esroll import methods

    assert "ranked_pairs" in methods.names() and methods.spec("ranked_pairs") is methods.ES
    w = estimators.direction_weights("ranked_pairs", np.array([1.0, 0, 0, 1, 3, 0, np.nan, 2], np.float32), 1.0)
    np.testing.assert_allclose(np.asarray(w.w_E), [0.0, -1 / 6, 1 / 6, 0.0], atol=1e-7)
    assert int(w.num_dropped) == 2 and int(w.num_nonfinite) == 1
    direction_M, sign_M = estimators.member_directions("ranked_pairs", 4)
    assert direction_M.tolist() == [0, 0, 1, 1] and sign_M.tolist() == [1.0, -1.0, 1.0, -1.0]


@pytest.mark.e2e
def test_environment_example(registries):
    """The page's environment, registered from outside the library, gets a model built for it from its planner
    (`experiments.pretrain_agent`), which then writes its moves, and trains by name with GRPO and GiGPO's turn credit;
    its episodes follow the protocol worked by hand: seed 5 on a corridor of 4 starts P on tile 5 mod 3 = 2, one step
    right stands on G (reward 1, solved, done); a malformed action is a penalised no-op."""
    ns = run_section("An environment", registries)
    assert ns["built"]["corridor_valid_actions"] >= 0.9  # the shipped agent model writes none of these words
    check_trained(registries, "corridor")
    saved = json.loads((registries / "runs" / "corridor" / "config.json").read_text())
    assert saved["grpo"]["advantage"] == "gigpo" and saved["env"]["options"]["corridor"]["max_turns"] == 4
    assert saved["train"]["max_new_tokens"] == 4 * (4 + 24)  # the room followed the turn limit
    samples = [
        json.loads(line)
        for line in (registries / "runs" / "corridor" / "samples.jsonl").read_text().split("\n")
        if line
    ]
    assert [s["step"] for s in samples] == [0] * 4 + [2] * 4
    assert all(t["action"] in ("left", "right") for s in samples for t in s["turns"])
    assert all(s["return"] == pytest.approx(sum(t["reward"] for t in s["turns"])) for s in samples)
    env = make_env("corridor", {"length": 4})
    assert env.reset(5) == "FFPG"
    turn = env.step("wrong move")
    assert (turn.observation, turn.reward, turn.done, turn.valid) == ("FFPG", -0.1, False, False)
    turn = env.step("right")
    assert (turn.observation, turn.reward, turn.done, turn.valid) == ("FFFP", 1.0, True, True) and env.solved
    steps = [r for r in metrics(registries / "runs" / "corridor") if "tokens_per_s" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(0 <= r["valid_actions"] <= 1 for r in steps)


@pytest.mark.e2e
def test_an_unregistered_task_is_refused_from_the_command_line(registries):
    """Without the page's config file (which imports the task module) the name `larger` is unknown: one line. The
    registered name trains from the command line in `test_advantage_example`."""
    command = [sys.executable, "-m", "experiments.train", "--config", "configs/default.py:quick"]
    command += ["--config.data.task=larger", "--workdir", str(registries / "runs" / "unregistered")]
    plain = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert plain.returncode == 1, plain.stderr
    assert plain.stderr.strip().splitlines()[-1].startswith("error: config: invalid value for 'data.task': 'larger'")


# ---- the registries' rules


def _quick(variant: str = "quick"):
    from configs.default import get_config

    cd = get_config(variant)
    cd.model.path = SHIPPED_MODEL
    return cd


def _rows(cfg):
    rows = [Example(task="echo", prompt=f"Say {i}.", answer=str(i), solution="", target_text=f" {i}") for i in range(9)]
    return rows[3:], rows[:3]


def _echo(example, completion):
    return float(completion.strip() == example.answer)


def test_registered_names_are_checked_like_built_in_ones(registries):
    cd = _quick()
    cd.data.task = "echo"
    with pytest.raises(ConfigError, match=r"^config: invalid value for 'data.task': 'echo' \(expected one of gsm8k"):
        check_names(from_config_dict(cd.to_dict()))
    register_task("echo", _rows, _echo)  # no parse_answer: no label-free mode
    check_names(from_config_dict(cd.to_dict()))
    cd.data.reward = "majority"
    with pytest.raises(ConfigError, match=r"^config: invalid value for 'data.reward': 'majority' \(expected 'gold'"):
        check_names(from_config_dict(cd.to_dict()))
    cd.data.reward = "exact"
    with pytest.raises(ConfigError, match=r"^config: invalid value for 'data.reward': 'exact' \(expected one of gold"):
        check_names(from_config_dict(cd.to_dict()))
    rewards.register_reward("exact", _echo)
    check_names(from_config_dict(cd.to_dict()))


def test_a_name_is_registered_once_unless_replaced(registries):
    with pytest.raises(ValueError, match="already registered"):
        register_task("arithmetic", _rows, _echo)
    with pytest.raises(ValueError, match="already registered"):
        rewards.register_reward("gold", _echo)
    with pytest.raises(ValueError, match="already registered"):
        shaping.register_shaping("zscore", lambda r, valid: r)
    with pytest.raises(ValueError, match="already registered"):
        advantages.register_advantage("grpo", lambda g, o, s: None)  # the group-relative built-ins are estimators
    with pytest.raises(ValueError, match="already registered"):
        grpo_variants.register_variant("stare", grpo_variants.Variant())
    with pytest.raises(TypeError, match="Variant instance"):
        grpo_variants.register_variant("mine", grpo_variants.Variant)  # the class, not an instance
    with pytest.raises(ValueError, match="'majority'"):
        rewards.register_reward("majority", _echo)  # the label-free mode is not a function
    with pytest.raises(ValueError, match="'accuracy'"):
        register_task("echo", _rows, _echo, eval_scores={"accuracy": _echo})  # the reward's own name
    with pytest.raises(TypeError, match="callable"):
        register_task("echo", _rows, "exact match")
    register_task("echo", _rows, _echo)
    spec = register_task("echo", _rows, lambda e, c: 0.5, replace=True)
    assert TASKS["echo"] is spec and spec.reward(None, "") == 0.5


def test_a_registered_task_builds_its_splits_and_scores(registries):
    from esroll.data import eval_score_names, eval_scores, make_splits, parse_answer, score

    register_task("echo", _rows, _echo, eval_scores={"long": lambda e, c: float(len(c) > 3)})
    cd = _quick()
    cd.data.update(task="echo", validation_size=1)
    train, test = make_splits(from_config_dict(cd.to_dict()).data)
    assert (len(train), [e.answer for e in test]) == (6, ["1", "2"])  # the first held-out row is validation
    assert eval_score_names("echo") == ("accuracy", "long")
    assert score(test[0], " 1") == 1.0 and eval_scores(test[0], " 1 and more") == (0.0, 1.0)
    with pytest.raises(ValueError, match="no parsed answer"):
        parse_answer(test[0], " 1")
    register_task("stray", lambda cfg: ([Example("unknown", "p", "1", "", "")], []), _echo)
    cd.data.update(task="stray", validation_size=0)
    with pytest.raises(ValueError, match="task 'unknown', which is not registered"):
        make_splits(from_config_dict(cd.to_dict()).data)


def test_a_registered_advantage_is_estimated_with_its_state(registries):
    def counting(group, options, state):
        return advantages.Estimate(np.zeros(np.shape(group.rewards), np.float32), state={"n": state["n"] + 1})

    advantages.register_advantage("counting", counting, lambda options: {"n": np.zeros((), np.int32)})
    state = advantages.init_estimator_state("counting")
    out = advantages.estimate("counting", advantages.Group(np.ones((2, 3))), None, state)
    assert int(out.state["n"]) == 1 and out.advantage.shape == (2, 3)
    assert "counting" not in shaping.SHAPINGS and not advantages.ESTIMATORS["counting"].single_rollout
    cd = _quick("grpo_quick")
    cd.grpo.update(advantage="counting", group_size=1)
    with pytest.raises(ConfigError, match=r"^config: invalid value for 'grpo.group_size': 1 \(expected >= 2\)"):
        check_names(from_config_dict(cd.to_dict()))


def test_data_reward_selects_the_training_reward_and_evaluation_keeps_the_tasks(registries):
    from esroll.data import make_splits
    from esroll.task import load_task

    rewards.register_reward("half", lambda example, completion: 0.5)
    cd = _quick()
    cd.data.reward = "half"
    cfg = check_names(from_config_dict(cd.to_dict()))
    train, held_out = make_splits(cfg.data)
    task, _ = load_task(cfg, train[:4], held_out[:4])
    example = held_out[0]
    ids = task.tokenizer.encode(example.target_text, add_special_tokens=False)
    tokens, lengths = np.array([ids]), np.array([len(ids)])
    assert task.rewards([example], tokens, lengths).tolist() == [0.5]
    assert task.eval_scores([example], tokens, lengths)[0, 0] == 1.0  # accuracy: the task's own reward


def test_the_tasks_prompt_format_is_what_the_template_wraps(registries):
    from esroll.data import PLAIN_TEMPLATE, make_splits
    from esroll.task import load_task

    register_task("echo", _rows, _echo, prompt=lambda example: f"{example.prompt} Only the number.")
    cd = _quick()
    cd.data.update(task="echo", eval_size=3)
    cfg = check_names(from_config_dict(cd.to_dict()))
    train, held_out = make_splits(cfg.data)
    task, _ = load_task(cfg, train, held_out)
    text = PLAIN_TEMPLATE.format(question=f"{train[0].prompt} Only the number.")
    assert task.prompt_ids(train[:1]) == [task.tokenizer.encode(text, add_special_tokens=False)]


def test_every_registry_checks_a_config_name_with_its_key():
    """The one mechanism behind the registries: a name unknown to one is refused with the config key that names it
    and the registered names; a reserved name is accepted by the check and refused by registration."""
    from esroll.config import ConfigError
    from esroll.registry import Registry

    for registry, key in (
        (TASKS, "data.task"),
        (rewards.REWARDS, "data.reward"),
        (shaping.SHAPINGS, "es.shaping"),
        (advantages.ESTIMATORS, "grpo.advantage"),
        (grpo_variants.VARIANTS, "grpo.variants"),
    ):
        assert isinstance(registry, Registry) and registry.key == key
        name = next(iter(registry))
        registry.check(name)
        with pytest.raises(
            ConfigError, match=rf"^config: invalid value for '{key}': 'nope' \(expected one of {name}, "
        ):
            registry.check("nope")
        with pytest.raises(ValueError, match=rf"unknown .* 'nope'; expected one of {name}, "):
            registry.lookup("nope")
    rewards.REWARDS.check("majority")  # the label-free mode: a valid data.reward, not an entry
    with pytest.raises(ValueError, match="'majority' is reserved"):
        rewards.REWARDS.add("majority", _echo)


def test_the_needs_table_names_every_need_and_only_fields_a_group_has():
    """docs/extending.md's table of what each `needs` fills in covers `NEEDS`, and every field it names is a field of
    `Group` that the GRPO step fills for that need."""
    table = DOC.read_text().split("| `needs` | `Group` fields |", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines()[2:]:
        need, fields = (cell.strip() for cell in line.split("|")[1:3])
        rows[need.strip("`")] = re.findall(r"`(\w+)`", fields)
    assert set(rows) == {"(always)", *advantages.NEEDS}
    assert all(f in advantages.Group._fields for fields in rows.values() for f in fields)


def test_the_step_and_agent_configs_take_registered_names(registries):
    """configs/step_level.py takes a registered estimator's name as its method part (GRPO with it), and
    configs/agents.py a registered environment's as its environment part, sizing the token room from its turn limit;
    an unknown part is still refused in one line."""
    import configs.agents
    import configs.step_level
    from esroll.agents import register_env
    from esroll.grpo.advantages import register_advantage

    register_advantage(
        "centred", lambda g, o=None, state=None: advantages.Estimate(g.rewards - g.rewards.mean(1, keepdims=True))
    )
    cd = configs.step_level.get_config("centred,quick")
    assert cd.method == "grpo" and cd.grpo.advantage == "centred"
    register_env("walk", lambda options: None, options=type(make_env("frozenlake", {}).options))
    cd = configs.agents.get_config("walk,grpo,quick")
    assert cd.env.name == "walk" and cd.train.max_new_tokens == 8 * (4 + 24)  # FrozenLake's options: 8 turns
    cd.env.options.walk.max_turns = 3
    assert cd.train.max_new_tokens == 3 * (4 + 24)
    with pytest.raises(ValueError, match=r"^configs/agents\.py: variant 'nowhere,grpo' must name"):
        configs.agents.get_config("nowhere,grpo")
