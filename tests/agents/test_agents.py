"""Agent runs (`esroll.agents`, `env.name`): a rollout of an agent task is `esroll.agents.play`'s episodes (reward the
return, loss on the actions only, chunking and members as in single-turn rollouts); GRPO's gradient on episodes equals a
policy gradient written here from a cache-free forward over each whole episode with the action tokens picked out by hand
(so the environment's tokens are attended to and get no loss); `configs/agents.py:quick` trains, logging the episodes'
metrics (its exact resumption: tests/test_resume.py), and `configs/agents_compare.py:quick` trains GRPO, GiGPO and
LOO-ROLL end to end; a config agents cannot run with is refused with one line naming its key."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from esroll import agents, es, parallel, sharding
from esroll.config import ConfigError, InputError, from_config_dict
from esroll.experiment import check_names, unread_keys
from esroll.grpo.method import _loss_mask, make_batches, make_gradient
from esroll.grpo.update import update_config
from esroll.models import Perturbation, forward
from esroll.agents.multiturn import play
from esroll.rollout import PAD, Sampling, rollout
from esroll.task import load_task

from conftest import REPO

pytest.importorskip("gymnasium")

AGENT_MODEL = str(REPO / "assets" / "tiny-qwen3-agent")


def agent_config(variant: str = "quick", **overrides):
    """`configs/agents.py:<variant>` on the shipped agent model, with dotted overrides, as the trainer's config."""
    from configs.agents import get_config

    cd = get_config(variant)
    cd.model.path = AGENT_MODEL
    for key, value in overrides.items():
        section, field = key.split(".")
        setattr(getattr(cd, section), field, value)
    return check_names(from_config_dict(cd.to_dict()))


@pytest.fixture(scope="module")
def setup():
    cfg = agent_config(**{"data.eval_size": 6})
    mesh = parallel.make_mesh(1)
    train, held_out = agents.splits(cfg)
    task, params = load_task(cfg, train, held_out, mesh)
    return cfg, mesh, task, sharding.caster(mesh, cfg.model.dtype)(params), held_out


def play_directly(task, params, seeds, key, temperature, perturb=None):
    env = task.env
    return play(
        task.cfg, params, task.tokenizer, [env.make() for _ in seeds], seeds, key,
        max_turns=env.max_turns, max_action_tokens=env.max_action_tokens,
        max_observation_tokens=env.max_observation_tokens, temperature=temperature,
        eos_id=task.tokenizer.eos_token_id, pad_id=task.pad_id, perturb=perturb, prompt_multiple=task.prompt_multiple,
    )  # fmt: skip


def test_an_agent_rollout_is_the_episodes_played(setup):
    """Rows are the held-out episodes' seeds (two rows per seed, and a padding row); the rollout's rewards are the
    returns, its tokens, log-probabilities and loss mask are play's padded to max_new_tokens, its prompts play's
    prompts; decoding in chunks of one row gives the same rows (noise keyed by the row's global index)."""
    cfg, mesh, task, params, held_out = setup
    example_B = np.array([0, 1, 2, 0, 1, 2, PAD])
    key = jax.random.key(3)
    whole = rollout(task, mesh, params, held_out, example_B, key, Sampling(cfg.train.max_new_tokens, 1.0), scores=True)
    chunked = rollout(
        task, mesh, params, held_out, example_B, key, Sampling(cfg.train.max_new_tokens, 1.0, rows_per_device=1)
    )
    seeds = [held_out[e].meta["seed"] for e in example_B[:6]]
    assert seeds[:3] == [agents.HELD_OUT + i for i in range(3)]
    ep = play_directly(task, params, seeds, key, 1.0)
    L = ep.tokens_BxT.shape[1]
    for out in (whole, chunked):
        np.testing.assert_array_equal(out.reward_B[:6], ep.return_B)
        assert out.reward_B[6] == 0 and out.length_B[6] == 0 and not out.loss_mask_BxN[6].any()
        np.testing.assert_array_equal(out.tokens_BxN[:6, :L], ep.tokens_BxT)
        assert (out.tokens_BxN[:6, L:] == task.pad_id).all() and not out.loss_mask_BxN[:, L:].any()
        np.testing.assert_array_equal(out.loss_mask_BxN[:6, :L], ep.loss_mask_BxT)
        np.testing.assert_allclose(out.logprobs_BxN[:6, :L], ep.logprobs_BxT, atol=2e-5)
        np.testing.assert_array_equal(out.length_B[:6], ep.length_B)
        P = ep.prompt_BxP.shape[1]
        np.testing.assert_array_equal(out.prompt_BxP[:6, -P:], ep.prompt_BxP)
    # The held-out scores: solved, the return, turns.
    np.testing.assert_array_equal(whole.scores["accuracy"][:6], ep.solved_B.astype(np.float32))
    np.testing.assert_array_equal(whole.scores["return"][:6], ep.return_B)
    np.testing.assert_array_equal(whole.scores["turns"][:6], ep.turns_B)
    assert whole.metrics["episode_solved"] == pytest.approx(ep.solved_B.mean())


def test_turns_of_a_rollout_are_the_episodes_turns_and_gigpo_credits_only_actions(setup):
    """The rollout's turns are play's (action spans, rewards, the observation each action answered) and their spans
    cover exactly the loss mask; GiGPO on a sampled group (`estimator_group`, as the GRPO step builds it) puts every
    nonzero advantage on an action token."""
    from esroll.grpo.advantages import estimate
    from esroll.grpo.method import estimator_group
    from esroll.grpo.estimators.turns import GigpoOptions

    cfg, mesh, task, params, held_out = setup
    example_B = np.repeat(np.arange(2), 4)
    key = jax.random.key(7)
    out = rollout(task, mesh, params, held_out, example_B, key, Sampling(cfg.train.max_new_tokens, 1.0))
    ep = play_directly(task, params, [held_out[e].meta["seed"] for e in example_B], key, 1.0)
    W = ep.turns_B.max()
    np.testing.assert_array_equal(out.turns.count_B, ep.turns_B)
    np.testing.assert_array_equal(out.turns.start_BxW[:, :W], ep.action_start_BxW[:, :W])
    np.testing.assert_array_equal(out.turns.reward_BxW[:, :W], ep.reward_BxW[:, :W])
    assert out.turns.states == [obs[:n] for obs, n in zip(ep.observations, ep.turns_B)]
    covered = np.zeros_like(out.loss_mask_BxN)
    for b in range(8):
        for t in range(out.turns.count_B[b]):
            covered[b, out.turns.start_BxW[b, t] : out.turns.end_BxW[b, t]] = True
    np.testing.assert_array_equal(covered, out.loss_mask_BxN)
    mask = _loss_mask(out)
    group = estimator_group(out, out.reward_B.reshape(2, 4), mask, held_out, 0, 0, ("turns",))
    advantage = estimate("gigpo", group, GigpoOptions()).advantage.reshape(8, -1)
    assert not advantage[~mask].any()


def test_members_play_the_same_episodes_with_their_own_weights(setup):
    """An ES rollout's rows (member-major over two seeds) equal each member's episodes played alone with its own
    perturbation: the reward of a row is the return its member got."""
    cfg, mesh, task, params, held_out = setup
    strategy = es.make_strategy(es.ESConfig(population=4, rank=2, sigma=0.05), optax.sgd(1e-3))
    state = strategy.init(params, jax.random.key(0))
    deltas = strategy.ask(state, params)
    member_B = np.repeat(np.arange(4, dtype=np.int32), 2)
    example_B = np.tile(np.arange(2), 4)
    key = jax.random.key(1)
    sampling = Sampling(cfg.train.max_new_tokens, 0.0, rows_per_device=2)
    out = rollout(task, mesh, params, held_out, example_B, key, sampling, deltas=deltas, member_B=member_B)
    seeds = [held_out[0].meta["seed"], held_out[1].meta["seed"]]
    returns = []
    for m in range(4):
        alone = play_directly(task, params, seeds, key, 0.0, Perturbation(deltas, np.full(2, m, np.int32)))
        returns.append(alone.return_B)
        L = alone.tokens_BxT.shape[1]
        np.testing.assert_array_equal(out.tokens_BxN[2 * m : 2 * m + 2, :L], alone.tokens_BxT)
    np.testing.assert_array_equal(out.reward_B, np.concatenate(returns))


@pytest.mark.e2e
def test_grpo_gradient_on_episodes_is_the_policy_gradient_on_the_actions(setup):
    """GRPO's minibatch gradient (`make_batches` + `make_gradient`, on-policy, no KL) on sampled episodes equals the
    gradient of −Σ_b A_b Σ_{action tokens t} log π(x_t | x_<t) / (action tokens), written here from the cache-free
    forward over each episode's whole text with its action positions taken from the environment's turns
    (`action_start`/`action_end`), not from the rollout's mask."""
    cfg, mesh, task, params, held_out = setup
    example_B = np.array([0, 0, 1, 1])
    sampling = Sampling(cfg.train.max_new_tokens, 1.0)
    out = rollout(task, mesh, params, held_out, example_B, jax.random.key(5), sampling)
    seeds = [held_out[e].meta["seed"] for e in example_B]
    ep = play_directly(task, params, seeds, jax.random.key(5), 1.0)
    advantage_B = np.array([1.0, -0.5, 0.25, -2.0], np.float32)
    mask_BxN = _loss_mask(out)
    N = mask_BxN.shape[1]
    g = dataclasses.replace(update_config(cfg.grpo), beta=0.0, aggregation="token_mean")
    (batch,) = make_batches(
        out, mask_BxN, np.broadcast_to(advantage_B[:, None], (4, N)).astype(np.float32), np.float32(1.0),
        g.aggregation, 1, 1, mesh,
    )  # fmt: skip
    grads, _ = make_gradient(task.cfg, g, mesh, None)(params, None, batch, jnp.asarray(True))

    # The reference: each episode's prompt and text as one unpadded sequence; its action tokens from the turns' spans.
    rows, positions = [], []
    for b in range(4):
        prompt = list(ep.prompt_BxP[b][ep.prompt_mask_BxP[b]])
        rows.append(prompt + list(ep.tokens_BxT[b, : ep.length_B[b]]))
        positions.append(
            [
                len(prompt) + i
                for t in range(ep.turns_B[b])
                for i in range(ep.action_start_BxW[b, t], ep.action_end_BxW[b, t])
            ]
        )
    width = max(len(r) for r in rows)
    tokens = np.array([r + [task.pad_id] * (width - len(r)) for r in rows], np.int32)
    valid = np.array([[i < len(r) for i in range(width)] for r in rows])
    count = sum(len(p) for p in positions)

    def loss(p):
        logits, _ = forward(task.cfg, p, tokens, mask_BxT=valid)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
        total = 0.0
        for b in range(4):
            idx = np.array(positions[b])
            total = total + advantage_B[b] * logp[b, idx - 1, tokens[b, idx]].sum()
        return -total / count

    expected = jax.grad(loss)(params)
    for path, got in jax.tree_util.tree_leaves_with_path(grads):
        want = dict(jax.tree_util.tree_leaves_with_path(expected))[path]
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-3, atol=2e-6, err_msg=str(path))
    # Episodes that went on past their first action hold the environment's tokens, which got none of the loss.
    assert (ep.length_B > np.array([len(p) for p in positions])).any()


def test_agent_configs_refuse_what_episodes_cannot_have():
    """One line naming the key: a completion too short for the longest episode, an unknown environment or option,
    a label-free reward, the curriculum, ES's dense step fitness, a step-level estimator."""
    cases = [
        ({"train.max_new_tokens": 100}, "train.max_new_tokens"),
        ({"env.name": "chess"}, "env.name"),
        ({"data.reward": "majority"}, "data.reward"),
        ({"curriculum.ads": True}, "curriculum.ads"),
        ({"es.step_weight": 0.5}, "es.step_weight"),
    ]
    for overrides, key in cases:
        with pytest.raises((ConfigError, InputError, ValueError), match=key.replace(".", r"\.")) as e:
            agent_config(**overrides)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"grpo\.advantage"):
        agent_config("grpo,quick", **{"grpo.advantage": "verigate"})
    # Turn-level estimators read episodes' turns: accepted with env.name, refused without it.
    assert agent_config("grpo,quick", **{"grpo.advantage": "gigpo"}).grpo.advantage == "gigpo"
    with pytest.raises(ConfigError, match=r"grpo\.advantage.*reads turns"):
        check_names(from_config_dict({"method": "grpo", "grpo": {"advantage": "gigpo"}}))
    from configs.agents import get_config

    cd = get_config("quick")
    cd.env.options.frozenlake.max_turnz = 3
    with pytest.raises(InputError, match=r"env\.options\.frozenlake\.max_turnz"):
        check_names(from_config_dict(cd.to_dict()))
    with pytest.raises(ValueError, match="configs/agents.py: variant"):
        get_config("frozenlake,sokoban")


def test_agent_runs_do_not_read_the_question_keys():
    """With env.name set the data keys of questions are unread (a command line that sets one is refused), the
    episode counts and split are read; without it the env keys are unread."""
    unread = unread_keys(agent_config())
    assert "data.task" in unread and "data.digits" in unread and "env.options.sokoban.max_turns" in unread
    assert not {"data.n_examples", "data.eval_size", "data.validation_size", "env.max_action_tokens"} & set(unread)
    plain = unread_keys(check_names(from_config_dict({})))
    assert "env.max_action_tokens" in plain and "env.options.frozenlake.size" in plain


@pytest.mark.parametrize("env", ["frozenlake", "sokoban"])
def test_agent_configs_fit_the_agent_model(env):
    """configs/agents.py's episodes fit the shipped model's positions (the longest prompt of 500 training and every
    held-out seed, then train.max_new_tokens), with the answer room the model was built with."""
    import json

    from transformers import AutoTokenizer

    from experiments.pretrain_agent import MAX_ACTION_TOKENS, MAX_OBSERVATION_TOKENS

    cfg = agent_config(env)
    assert (cfg.env.max_action_tokens, cfg.env.max_observation_tokens) == (MAX_ACTION_TOKENS, MAX_OBSERVATION_TOKENS)
    tok = AutoTokenizer.from_pretrained(AGENT_MODEL)
    train, held_out = agents.splits(cfg)
    longest = max(len(p) for p in agents.prompt_reader(agents.env_task(cfg), tok)(train[:500] + held_out))
    positions = json.loads((REPO / "assets" / "tiny-qwen3-agent" / "config.json").read_text())[
        "max_position_embeddings"
    ]
    assert longest + cfg.train.max_new_tokens <= positions


@pytest.mark.e2e
def test_agent_comparison_quick_pairs_every_arm_with_grpo(tmp_path):
    """configs/agents_compare.py:quick through the tuned protocol: GiGPO starts from GRPO's chosen setting and trains
    with the turn-level advantage (its steps log the anchor groups), LOO-ROLL trains on the same episodes, and the
    report pairs each arm with GRPO. The four full variants build with their 4 arms (the games' own estimator on
    the games model, 3 seeds)."""
    import csv
    import json

    from configs import agents_compare
    from esroll.compare import comparison_from_dict, run_comparison
    from esroll.metrics import read_metrics
    from esroll.report import write_report

    for variant in ("frozenlake", "sokoban", "rps", "locate"):
        comp = comparison_from_dict(agents_compare.get_config(variant).to_dict())
        arms = agents_compare.GAMES.get(variant, agents_compare.ARMS)
        assert sorted(comp.configs) == sorted(arms) and comp.reference == "grpo"
        assert comp.configs["gigpo"].grpo.advantage == "gigpo" and comp.configs["looroll"].env.name == variant
    for variant, own in (("rps", "memopilot"), ("locate", "a2agent")):
        comp = comparison_from_dict(agents_compare.get_config(variant).to_dict())
        assert comp.configs[own].grpo.advantage == own and comp.configs[own].model.path.endswith("tiny-qwen3-games")
        assert len(comp.seeds) == 3 and comp.tuning.inherit[own] == "grpo"
    comp = comparison_from_dict(agents_compare.get_config("repro").to_dict())
    assert list(comp.configs) == ["grpo", "repro"] and comp.tuning is None
    assert {c.model.path for c in comp.configs.values()} == {"assets/tiny-qwen3-reflect"}
    assert comp.configs["repro"].env.reflect_tokens > 0 and comp.configs["grpo"].env.reflect_tokens == 0
    cd = agents_compare.get_config("quick")
    cd.experiment.model.path = AGENT_MODEL
    comp = comparison_from_dict(cd.to_dict())
    run_comparison(comp, tmp_path, mesh_devices=1, progress=False)
    gigpo = json.loads((tmp_path / "gigpo" / "seed1" / "config.json").read_text())
    assert gigpo["grpo"]["advantage"] == "gigpo" and gigpo["data"]["eval_split"] == "test"
    steps = [r for r in read_metrics(tmp_path / "gigpo" / "seed0" / "metrics.jsonl") if "reward_mean" in r]
    assert steps and all("gigpo_anchor_share" in r and "episode_solved" in r for r in steps)
    with open(write_report(tmp_path)["results_csv"]) as f:
        results = {r["method"]: r for r in csv.DictReader(f)}
    assert set(results) == {"grpo", "gigpo", "looroll"} and int(results["gigpo"]["n_pairs"]) == 2
