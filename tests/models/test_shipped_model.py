"""The tiny model shipped in assets/ loads in transformers and in esroll with the same logits, and is small."""

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from esroll.data import PLAIN_TEMPLATE
from esroll.models import forward, load_hf

ASSET = Path(__file__).resolve().parents[2] / "assets" / "tiny-qwen3-arith"


def test_shipped_model_loads_in_both():
    assert sum(f.stat().st_size for f in ASSET.iterdir()) < 25 * 2**20
    tok = transformers.AutoTokenizer.from_pretrained(str(ASSET))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ASSET), dtype=torch.float32).eval()
    ids = tok(PLAIN_TEMPLATE.format(question="What is 12 + 35?"), return_tensors="np").input_ids
    cfg, params = load_hf(ASSET)
    ours, _ = forward(cfg, params, ids)
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    assert np.abs(np.asarray(ours) - ref).max() < 1e-4
    # Digits are single tokens, so answers are spelled digit by digit.
    assert [tok.decode([t]) for t in tok(" 47").input_ids] == [" ", "4", "7"]


# each agent model: its environments (the first the one its build stops on) and the range that one's success is built in
AGENT_MODELS = {
    "tiny-qwen3-agent": (("frozenlake", "sokoban"), (0.2, 0.6), "right"),
    "tiny-qwen3-games": (("locate", "rps"), (0.3, 0.6), "look 1"),
    "tiny-qwen3-reflect": (("frozenlake", "sokoban"), (0.2, 0.6), "right"),
}


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(AGENT_MODELS))
def test_shipped_agent_model_loads_in_both_and_plays_as_its_build_log_says(name):
    """An agent model: the same logits in transformers and esroll on an episode's text; room for the longest
    episode in each of its environments at the builder's action and answer room; and greedy play on the builder's 64
    held-out seeds of each environment solves the share its build log (pretrain_summary.json) reports, the first
    environment's within the range the model is built for; a reflecting model's reflections after those episodes
    parse and agree with the oracle in the shares its log reports."""
    import json

    import jax

    from experiments.pretrain_agent import MAX_ACTION_TOKENS as ACTION_TOKENS
    from experiments.pretrain_agent import MAX_OBSERVATION_TOKENS as OBSERVATION_TOKENS
    from experiments.pretrain_agent import reflect_tokens, success_rates
    from esroll.agents import make_env
    from esroll.agents.reflect import HEADER_TOKENS
    from esroll.agents.multiturn import format_observation, episode_prompt, play

    path = ASSET.parent / name
    envs_of, (low, high), action = AGENT_MODELS[name]
    assert sum(f.stat().st_size for f in path.iterdir()) < 25 * 2**20
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    env = make_env(envs_of[0])
    first = env.reset(5)
    turn = env.step(action)
    text = episode_prompt(env.instructions, first) + action + tok.eos_token + format_observation(turn.observation)
    ids = tok(text, return_tensors="np").input_ids
    cfg, params = load_hf(path)
    ours, _ = forward(cfg, params, ids)
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    assert np.abs(np.asarray(ours) - ref).max() < 1e-4

    summary = json.loads((path / "pretrain_summary.json").read_text())
    for env_name in envs_of:
        envs = [make_env(env_name) for _ in range(64)]
        seeds = range(1_000_000, 1_000_064)
        longest_prompt = max(len(tok.encode(episode_prompt(e.instructions, e.reset(s)))) for e, s in zip(envs, seeds))
        turns = envs[0].options.max_turns
        room = turns * (ACTION_TOKENS + OBSERVATION_TOKENS)
        if f"{env_name}_reflection_parsed" in summary:
            room += OBSERVATION_TOKENS + HEADER_TOKENS + reflect_tokens(env_name)
        assert longest_prompt + room <= cfg.max_position_embeddings
        ep = play(
            cfg, params, tok, envs, seeds, jax.random.key(0), max_turns=turns, max_action_tokens=ACTION_TOKENS,
            max_observation_tokens=OBSERVATION_TOKENS, temperature=0.0, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
        )  # fmt: skip
        assert ep.solved_B.mean() == summary[f"{env_name}_success"], env_name
    if "frozenlake_reflection_parsed" in summary:
        figures = success_rates(cfg, params, tok, 64, envs_of, reflect=True)
        keys = {key for key in {**figures, **summary} if "_reflection_" in key}
        for key in keys:
            assert figures.get(key) == summary.get(key), key
        assert summary["frozenlake_reflection_parsed"] >= 0.25  # the warm-up taught the format
    assert low <= summary[f"{envs_of[0]}_success"] <= high
