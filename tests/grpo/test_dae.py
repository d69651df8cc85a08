"""DAE (esroll/grpo/estimators/dae.py, esroll.critic.dae_terms, esroll.grpo.ppo.dae_readings): the advantages and
the loss on a two-turn episode by hand, Σ_a π·Â = 0, the readings of a rollout and the policy's action
probabilities, the loss's minimiser equal to the exact advantage of a fixed policy on a FrozenLake map enumerated
whole, its options, and a quick agent run."""

from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from esroll.agents.multiturn import Turns
from esroll.config import ConfigError
from esroll.critic import dae_terms
from esroll.grpo.advantages import Group, estimate
from esroll.grpo.estimators.dae import DaeOptions, advantage_model

LOG_OFF = np.log(0.5)  # log π off a turn start (not read)


def _readings(v, f, pi, taken):
    """One position's readings with S = 2 slots: V, f(·, 2 slots), log π(2 slots), the slot taken."""
    return [v, *f, *np.log(pi), taken]


def _episode(second_taken=1):
    """One episode, γ 0.5, two action slots (an action and "anything else"): turn 1's action at tokens 0-1 (reward 0;
    V 0.4, f (1, 0), π (0.25, 0.75), slot 0 taken), the environment's answer at 2-3, turn 2's action at 4-5 (reward 1;
    V 0.6, f (0.2, 0.6), π (0.5, 0.5), slot `second_taken`)."""
    off = _readings(0.0, (0.0, 0.0), (0.5, 0.5), -2)
    readings = [
        _readings(0.4, (1.0, 0.0), (0.25, 0.75), 0),
        off,
        off,
        off,
        _readings(0.6, (0.2, 0.6), (0.5, 0.5), second_taken),
        off,
    ]
    turns = Turns(np.array([[0, 4]]), np.array([[2, 6]]), np.array([[0.0, 1.0]]), np.array([2]), [["s0", "s1"]])
    g = Group(
        np.array([[1.0]]),
        token_mask=np.array([[[1, 1, 0, 0, 1, 1]]], bool),
        values=np.array([[readings]]),
        turns=turns,
    )
    return g, np.array([readings], np.float32)


def test_dae_on_two_turns_by_hand():
    """Turn 1: Σπf = 0.25, Â = (0.75, −0.25), taken 0.75; turn 2: Σπf = 0.4, Â = (−0.2, 0.2), taken 0.2. Returns
    G_2 = 1, G_1 = 0.5·1 = 0.5 at the turns' first tokens. The loss: C_2 = 0.2, C_1 = 0.75 + 0.5·0.2 = 0.85;
    (1 − 0.2 − 0.6)² = 0.04 and (0.5 − 0.85 − 0.4)² = 0.5625. With turn 2 taking slot 0 instead: Â −0.2, C_2 = −0.2,
    C_1 = 0.75 − 0.1 = 0.65, the terms (1 + 0.2 − 0.6)² = 0.36 and (0.5 − 0.65 − 0.4)² = 0.3025."""
    g, readings = _episode()
    est = estimate("dae", g, DaeOptions(gamma=0.5, whiten=False))
    np.testing.assert_allclose(est.advantage[0, 0], [0.75, 0.75, 0, 0, 0.2, 0.2], atol=1e-7)
    np.testing.assert_allclose(est.returns[0, 0], [0.5, 0, 0, 0, 1.0, 0], atol=1e-12)
    assert est.metrics["value_prompt"] == pytest.approx(0.4)
    assert est.metrics["advantage_model_abs"] == pytest.approx((0.75 + 0.2) / 2)
    assert est.metrics["advantage_constraint"] < 1e-12
    out = jnp.asarray(readings[..., :3])
    terms = dae_terms(out, jnp.asarray(readings), jnp.asarray(est.returns[0], jnp.float32), 0.5)
    np.testing.assert_allclose(np.asarray(terms[0]), [0.5625, 0, 0, 0, 0.04, 0], atol=1e-6)

    g, readings = _episode(second_taken=0)
    est = estimate("dae", g, DaeOptions(gamma=0.5, whiten=False))
    np.testing.assert_allclose(est.advantage[0, 0], [0.75, 0.75, 0, 0, -0.2, -0.2], atol=1e-7)
    terms = dae_terms(jnp.asarray(readings[..., :3]), jnp.asarray(readings), jnp.asarray(est.returns[0]), 0.5)
    np.testing.assert_allclose(np.asarray(terms[0]), [0.3025, 0, 0, 0, 0.36, 0], atol=1e-6)


def test_the_advantage_model_is_centred_under_the_policy():
    """Σ_a π(a|s)·Â(s, a) = 0 at every position for random scores and policies (slots of probability 0 included),
    and Â is unchanged by adding a per-state constant to f."""
    rng = np.random.default_rng(0)
    f = rng.normal(size=(5, 7, 8))
    logits = rng.normal(size=(5, 7, 8))
    logits[..., 6:] = -np.inf  # slots the environment does not use
    pi = np.exp(logits - logits.max(-1, keepdims=True))
    pi /= pi.sum(-1, keepdims=True)
    a_hat = advantage_model(f, pi)
    np.testing.assert_allclose(np.sum(pi * a_hat, -1), 0.0, atol=1e-12)
    np.testing.assert_allclose(advantage_model(f + rng.normal(size=(5, 7, 1)), pi), a_hat, atol=1e-12)


def _rollout(tokens_BxN, turns, P=3):
    """A rollout's fields that the critic and DAE read: prompts of P tokens (row 1's first one padding)."""
    B, N = tokens_BxN.shape
    prompt = np.arange(1, B * P + 1).reshape(B, P) % 50 + 60
    prompt_mask = np.ones((B, P), bool)
    prompt_mask[1:, 0] = False
    length = np.full(B, N)
    return SimpleNamespace(
        prompt_BxP=prompt, prompt_mask_BxP=prompt_mask, tokens_BxN=tokens_BxN, length_B=length, turns=turns
    )


def test_dae_readings_of_a_rollout():
    """log π over the actions' first tokens (11, 12) and "anything else" as given, at each turn's first action token
    (−1e9 elsewhere and in a slot past them); the slot each turn took there: 0 for token 11, 2 ("anything else") for
    token 13, −2 elsewhere."""
    from esroll.grpo.ppo import dae_readings

    turns = Turns(np.array([[0, 4]]), np.array([[2, 6]]), np.array([[0.0, 1.0]]), np.array([2]), [["s0", "s1"]])
    out = SimpleNamespace(tokens_BxN=np.array([[11, 3, 7, 7, 13, 3]]), turns=turns)
    critic = np.arange(24, dtype=np.float32).reshape(1, 6, 4) / 10  # K = 4 outputs: S = 3 slots
    logp = np.log([[[0.2, 0.6, 0.2], [0.5, 0.25, 0.25]]])  # [B, W, A + 1]
    r = dae_readings(critic, logp, out, (11, 12))
    assert r.shape == (1, 6, 8)
    np.testing.assert_allclose(r[..., :4], critic)
    np.testing.assert_allclose(np.exp(r[0, [0, 4], 4:7]), np.exp(logp[0]), atol=1e-6)
    assert np.all(r[0, [1, 2, 3, 5], 4:7] == -1e9)
    np.testing.assert_array_equal(r[0, :, 7], [0, -2, -2, -2, 2, -2])
    wide = dae_readings(np.zeros((1, 6, 5), np.float32), logp, out, (11, 12))  # S = 4 slots, 2 actions
    assert wide.shape == (1, 6, 10) and np.all(wide[..., 8] == -1e9)


def test_dae_reads_the_critic_and_the_policy_where_each_turn_starts():
    """`rollout_values` with DAE's action set on the shipped agent model, two rows of prompt 3 and 8 generated tokens
    (row 1's prompt padded; its second turn's action starts with no action's token): the critic's 9 outputs at
    generated token n are its forward at position P−1+n, and at each turn's first action token the policy's
    log-probabilities at temperature 0.7 of the four actions' first tokens and of any other token equal the full
    forward's log-softmax of logits / 0.7 at that position, to 1e-5."""
    from esroll import parallel
    from esroll.critic import critic_params, values
    from esroll.grpo.ppo import ActionSet, rollout_values
    from esroll.models import forward, load_hf

    from conftest import REPO

    cfg, params = load_hf(REPO / "assets/tiny-qwen3-agent")
    ids = (5, 17, 40, 41)
    tokens = np.array([[5, 30, 31, 40, 9, 32, 33, 2], [41, 9, 30, 31, 7, 8, 34, 35]])
    turns = Turns(np.array([[0, 3], [0, 4]]), np.array([[2, 5], [2, 6]]), np.zeros((2, 2)), np.array([2, 2]), [])
    out = _rollout(tokens, turns)
    critic = critic_params(params, 9)
    critic["value_head"] = jax.random.normal(jax.random.key(0), critic["value_head"].shape) * 0.1
    got = rollout_values(cfg, critic, out, parallel.make_mesh(1), params, ActionSet(ids, 0.7))
    assert got.shape == (2, 8, 18)
    seq = np.concatenate([out.prompt_BxP, tokens], 1)
    mask = np.concatenate([out.prompt_mask_BxP, np.ones_like(tokens, bool)], 1)
    value_cfg = dataclasses.replace(cfg, head="value")
    want = np.asarray(values(value_cfg, critic, seq, mask_BxT=mask))[:, 2:10]
    np.testing.assert_allclose(got[..., :9], want, atol=1e-5)
    logits, _ = forward(cfg, params, seq, mask_BxT=mask)
    full = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32) / 0.7, -1), np.float64)
    for b, starts in enumerate(turns.start_BxW):
        for n in starts:
            np.testing.assert_allclose(got[b, n, 9:13], full[b, 2 + n, list(ids)], atol=1e-5)
            other = 1 - np.exp(full[b, 2 + n, list(ids)]).sum()
            np.testing.assert_allclose(np.exp(got[b, n, 13]), other, atol=1e-5)
    np.testing.assert_array_equal(got[:, [0, 3], -1], [[0, 2], [3, -2]])  # tokens 5 → 0, 40 → 2; 41 → 3
    assert got[1, 4, -1] == 4  # token 7 starts no action: "anything else"


def test_daes_loss_is_minimised_by_the_exact_advantage_on_an_enumerated_frozenlake():
    """A 3 × 3 FrozenLake map, 4 turns, a fixed policy (random per history, every move likely), γ 0.9. Every
    history is a state (the model reads the episode so far) and every action sequence is played, so V^π and
    A^π = r + γ·V^π(next) − V^π are exact by backward induction (0 after the episode ends or its last turn). A table
    of V and f per history minimises the expected loss Σ_episodes P(episode)·Σ_i (`esroll.critic.dae_terms`) in
    closed form (the loss is quadratic in the table: one Newton step from 0, the least-norm solution, since f is free
    up to a constant per state). Its Â equals A^π and its V equals V^π at every history to 1e-4 (float32)."""
    from esroll.agents import make_env

    H, gamma, S = 4, 0.9, 4
    env = make_env("frozenlake", {"size": 3, "max_turns": H})
    moves = env.actions

    def play(seq):
        env.reset(seed=7)
        rewards, done = [], False
        for a in seq:
            turn = env.step(moves[a])
            rewards.append(turn.reward)
            done = turn.done
            if done:
                break
        return rewards, done

    histories = [()]  # the histories at which the policy acts (the episode has not ended)
    for n in range(1, H):
        histories += [h for h in itertools.product(range(S), repeat=n) if h[:-1] in histories and not play(h)[1]]
    index = {h: i for i, h in enumerate(histories)}
    logits = np.random.default_rng(1).normal(size=(len(histories), S))
    pi = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    value, advantage = {}, np.zeros((len(histories), S))
    for h in sorted(histories, key=len, reverse=True):  # backward induction
        q = np.zeros(S)
        for a in range(S):
            rewards, done = play(h + (a,))
            q[a] = rewards[-1] + (0.0 if done or len(h) + 1 == H else gamma * value[h + (a,)])
        value[h] = float(pi[index[h]] @ q)
        advantage[index[h]] = q - value[h]
    assert 0 < value[()] < 1  # a map the policy sometimes solves

    episodes = []  # (histories, actions, rewards, probability) of every episode
    for seq in itertools.product(range(S), repeat=H):
        rewards, _ = play(seq)
        n = len(rewards)
        if seq[n:] == (0,) * (H - n):  # one representative per ended episode
            hs = [seq[:i] for i in range(n)]
            episodes.append((hs, seq[:n], rewards, np.prod([pi[index[h], a] for h, a in zip(hs, seq)])))
    assert sum(e[3] for e in episodes) == pytest.approx(1.0)
    B = len(episodes)
    node, readings = np.zeros((B, H), int), np.zeros((B, H, 2 * (1 + S)), np.float32)
    returns, weight = np.zeros((B, H), np.float32), np.zeros(B, np.float32)
    readings[..., -1] = -2
    for b, (hs, actions, rewards, p) in enumerate(episodes):
        weight[b] = p
        for i, (h, a) in enumerate(zip(hs, actions)):
            node[b, i] = index[h]
            readings[b, i, 1 + S : 1 + 2 * S] = np.log(pi[index[h]])
            readings[b, i, -1] = a
            returns[b, i] = sum(gamma**j * r for j, r in enumerate(rewards[i:]))

    def loss(theta):
        table = theta.reshape(len(histories), 1 + S)
        out = table[node]
        return jnp.sum(weight[:, None] * dae_terms(out, jnp.asarray(readings), jnp.asarray(returns), gamma))

    theta0 = jnp.zeros(len(histories) * (1 + S))
    grad = np.asarray(jax.grad(loss)(theta0), np.float64)
    hess = np.asarray(jax.hessian(loss)(theta0), np.float64)
    table = (-np.linalg.pinv(hess, rcond=1e-10) @ grad).reshape(len(histories), 1 + S)
    np.testing.assert_allclose(advantage_model(table[:, 1:], pi), advantage, atol=1e-4)
    np.testing.assert_allclose(table[:, 0], [value[h] for h in histories], atol=1e-4)


def test_dae_options_and_runs_are_checked():
    """gamma outside [0, 1], a non-positive critic lr, an unread key, a run without episodes and an environment whose
    actions share a first token are refused, each naming its key."""
    from esroll.config import from_config_dict
    from esroll.experiment import check_names
    from esroll.grpo.ppo import action_tokens

    with pytest.raises(ConfigError, match="gamma"):
        DaeOptions(gamma=1.5)
    with pytest.raises(ConfigError, match="critic_lr"):
        DaeOptions(critic_lr=0.0)
    with pytest.raises(ConfigError, match=r"grpo\.advantage.*reads turns"):
        check_names(from_config_dict({"method": "grpo", "grpo": {"advantage": "dae"}}))
    from configs import agents

    agent = agents.get_config("quick,dae").to_dict()
    g = check_names(from_config_dict(agent)).grpo
    agent["grpo"].setdefault("adv", {}).setdefault("dae", {})["critic_path"] = "x"
    with pytest.raises(ValueError, match=r"critic_path"):
        check_names(from_config_dict(agent))

    class Tok:
        def encode(self, text, add_special_tokens=False):
            return [ord(text[0]), ord(text[-1])]

    env = SimpleNamespace(name="frozenlake", make=lambda: SimpleNamespace(actions=("left", "down", "right", "up")))
    got = action_tokens(g, SimpleNamespace(env=env, tokenizer=Tok()))
    assert got.ids == tuple(map(ord, "ldru")) and got.temperature == g.temperature
    env = SimpleNamespace(name="sokoban", make=lambda: SimpleNamespace(actions=("up", "down", "left", "lower")))
    with pytest.raises(ConfigError, match=r"grpo\.advantage.*start with distinct tokens"):
        action_tokens(g, SimpleNamespace(env=env, tokenizer=Tok()))
    env = SimpleNamespace(name="many", make=lambda: SimpleNamespace(actions=tuple("abcdefgh")))
    with pytest.raises(ConfigError, match=r"at most 7 actions"):  # 8 slots: 7 and "anything else"
        action_tokens(g, SimpleNamespace(env=env, tokenizer=Tok()))


@pytest.mark.e2e
def test_the_shipped_dae_config_trains_its_critic(tmp_path):
    """configs/agents.py:quick,dae: two steps on FrozenLake episodes; the advantage model starts at 0 (its head is
    zero) and is no longer 0 at step 2, Σ_a π·Â stays 0, and the loss is logged."""
    from conftest import shipped_config
    from configs import agents
    from esroll.metrics import read_metrics
    from esroll.train import train_and_evaluate

    cfg = shipped_config(agents.get_config, "quick,dae")
    assert cfg.method == "grpo" and cfg.grpo.advantage == "dae" and cfg.env.name == "frozenlake"
    train_and_evaluate(cfg, tmp_path, progress=False)
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "value_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert steps[0]["advantage_model_abs"] == 0.0 and steps[1]["advantage_model_abs"] > 0.0
    assert all(r["advantage_constraint"] < 1e-6 and np.isfinite(r["value_loss"]) for r in steps)
