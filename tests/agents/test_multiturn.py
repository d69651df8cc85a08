"""Multi-turn episodes in one KV cache (`esroll.agents.play`), on the shipped tiny model and FrozenLake: a scripted
episode equals the environment stepped by hand (tokens, loss mask, rewards, turn boundaries); every action token's
recorded log-probability equals a cache-free forward over the whole episode (so each turn saw exactly the episode's
text before it); environment tokens never get loss; per-member perturbed episodes equal each member's played alone."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from esroll.errors import InputError

from esroll import es
from esroll.agents import FrozenLake, Sokoban
from esroll.models import Perturbation, forward, load_hf
from esroll.agents.multiturn import format_observation, episode_prompt, play
from esroll.sampling import pad_prompts

from conftest import SHIPPED_MODEL, lake_path

pytest.importorskip("gymnasium")

N, O = 10, 32  # actions of the scripted walks take 5-6 tokens: several decode steps after their end


@pytest.fixture(scope="module")
def model():
    from transformers import AutoTokenizer

    cfg, params = load_hf(SHIPPED_MODEL)
    return cfg, params, AutoTokenizer.from_pretrained(SHIPPED_MODEL)


def play_lake(model, seeds, key=0, **kwargs):
    cfg, params, tok = model
    envs = [FrozenLake() for _ in seeds]
    kwargs = {"max_turns": 8, "max_action_tokens": N, "max_observation_tokens": O, **kwargs}
    eos, pad = tok.eos_token_id, tok.pad_token_id
    return play(cfg, params, tok, envs, seeds, jax.random.key(key), eos_id=eos, pad_id=pad, **kwargs)


def check_logprobs_by_full_forward(model, ep):
    """Each row's prompt and episode as one sequence, through the cache-free forward: the log-softmax at every action
    token equals what the turn-by-turn cache recorded."""
    cfg, params, _ = model
    rows = [
        list(ep.prompt_BxP[b][ep.prompt_mask_BxP[b]]) + list(ep.tokens_BxT[b, : ep.length_B[b]])
        for b in range(len(ep.length_B))
    ]
    tokens, mask = pad_prompts(rows, multiple=1)
    logits, _ = forward(cfg, params, tokens, mask_BxT=mask)
    logp = np.asarray(jax.nn.log_softmax(logits, -1))
    for b, row in enumerate(rows):
        P, n = len(row) - ep.length_B[b], ep.length_B[b]
        offset = tokens.shape[1] - len(row)
        for i in np.flatnonzero(ep.loss_mask_BxT[b, :n]):
            expected = logp[b, offset + P + i - 1, row[P + i]]
            assert abs(expected - ep.logprobs_BxT[b, i]) < 2e-4, (b, i, expected, ep.logprobs_BxT[b, i])


def test_a_scripted_episode_equals_the_environment_stepped_by_hand(model):
    """Row 0 walks its shortest path to G; row 1 plays a malformed action first, then its path; row 2 walks left
    until the turn limit. The tokens are the prompt's continuation built here from the tokenizer, the loss mask is
    on the actions only, and the rewards, turns and boundaries are those of the environments stepped by hand."""
    _, _, tok = model
    seeds = [0, 1, 7]
    paths = [lake_path(FrozenLake().reset(s)) for s in seeds]
    scripts = [paths[0], ["jump", *paths[1]], ["left"] * 8]

    ep = play_lake(model, seeds, actions=lambda turn, obs: [s[turn] if turn < len(s) else "up" for s in scripts])
    eos = tok.eos_token_id
    for b, (seed, script) in enumerate(zip(seeds, scripts)):
        env = FrozenLake()
        first = env.reset(seed)
        prompt = tok.encode(episode_prompt(env.instructions, first), add_special_tokens=False)
        assert list(ep.prompt_BxP[b][ep.prompt_mask_BxP[b]]) == prompt
        tokens, mask, rewards, valid, starts = [], [], [], [], []
        for action in script:
            ids = tok.encode(action, add_special_tokens=False) + [eos]
            starts.append(len(tokens))
            tokens += ids
            mask += [True] * len(ids)
            turn = env.step(action)
            rewards.append(turn.reward)
            valid.append(turn.valid)
            if turn.done:
                break
            answer = tok.encode(format_observation(turn.observation), add_special_tokens=False)
            tokens += answer
            mask += [False] * len(answer)
        n = len(tokens)
        assert ep.length_B[b] == n and list(ep.tokens_BxT[b, :n]) == tokens
        assert list(ep.loss_mask_BxT[b, :n]) == mask and not ep.loss_mask_BxT[b, n:].any()
        turns = len(rewards)
        assert ep.turns_B[b] == turns and ep.done_B[b]
        np.testing.assert_allclose(ep.reward_BxW[b, :turns], rewards)
        assert list(ep.valid_BxW[b, :turns]) == valid and ep.actions[b] == script[:turns]
        assert list(ep.action_start_BxW[b, :turns]) == starts
    assert ep.return_B[0] == 1.0 and ep.return_B[1] == pytest.approx(0.9) and ep.return_B[2] == 0.0
    assert ep.turns_B[2] == 8  # the turn limit
    assert list(ep.solved_B) == [True, True, False]
    check_logprobs_by_full_forward(model, ep)


def test_sampled_episodes_mask_every_environment_token(model):
    """Sampled episodes (temperature 1, 6 rows): the text after each action is the environment's answer, tokenised,
    with no loss on it; the actions' log-probabilities are those of the whole episode's forward."""
    _, _, tok = model
    ep = play_lake(model, list(range(6)), key=3, temperature=1.0)
    for b in range(6):
        turns = ep.turns_B[b]
        assert turns >= 1 and len(ep.actions[b]) == turns and len(ep.observations[b]) == turns + 1
        for t in range(turns):
            s, e = ep.action_start_BxW[b, t], ep.action_end_BxW[b, t]
            assert ep.loss_mask_BxT[b, s:e].all() and e - s >= 1
            nxt = ep.action_start_BxW[b, t + 1] if t + 1 < turns else ep.length_B[b]
            answer = list(ep.tokens_BxT[b, e:nxt])
            assert not ep.loss_mask_BxT[b, e:nxt].any()
            if t + 1 < turns:
                expected = tok.encode(format_observation(ep.observations[b][t + 1]), add_special_tokens=False)
                assert answer == expected
    check_logprobs_by_full_forward(model, ep)


def test_per_member_perturbed_episodes_equal_each_member_alone(model):
    """Two members × 2 episodes in one batch (rows member-major) against each member's two rows played alone at
    their row offset: the same tokens, rewards and log-probabilities."""
    cfg, params, tok = model
    strategy = es.make_strategy(es.ESConfig(population=2, rank=2, sigma=0.3), optax.adam(1e-3))
    deltas = strategy.ask(strategy.init(params, jax.random.key(5)), params)
    seeds = [2, 3, 2, 3]
    both = play_lake(model, seeds, key=1, temperature=1.0, perturb=Perturbation(deltas, np.array([0, 0, 1, 1])))
    for m in (0, 1):
        alone = play_lake(
            model, seeds[2 * m : 2 * m + 2], key=1, temperature=1.0, row_offset=2 * m,
            perturb=Perturbation(deltas, np.array([m, m])),
        )  # fmt: skip
        rows = slice(2 * m, 2 * m + 2)
        n = alone.tokens_BxT.shape[1]
        np.testing.assert_array_equal(both.tokens_BxT[rows, :n], alone.tokens_BxT)
        np.testing.assert_array_equal(both.reward_BxW[rows], alone.reward_BxW)
        np.testing.assert_allclose(both.logprobs_BxT[rows, :n], alone.logprobs_BxT, atol=1e-5)
    plain = play_lake(model, seeds, key=1, temperature=1.0)
    assert not np.array_equal(plain.tokens_BxT, both.tokens_BxT)  # the perturbation changes what is sampled


def test_an_observation_longer_than_its_room_is_refused(model):
    cfg, params, tok = model
    with pytest.raises(
        InputError, match=r"^env\.max_observation_tokens: an observation of \d+ tokens does not fit its 8 "
    ):
        play(cfg, params, tok, [Sokoban()], [0], jax.random.key(0), max_turns=2, max_observation_tokens=8,
             actions=lambda turn, obs: ["up"], eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)  # fmt: skip
