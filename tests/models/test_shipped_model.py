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


AGENT = ASSET.parent / "tiny-qwen3-agent"


@pytest.mark.e2e
def test_shipped_agent_model_loads_in_both_and_plays_as_its_build_log_says():
    """The agent model: the same logits in transformers and esroll on an episode's text; room for the longest
    episode in either environment at the builder's action and answer room; and greedy play on the builder's 64 held-out seeds of
    each environment solves the share its build log (pretrain_summary.json) reports, FrozenLake's within the 20-60%
    the model is built for."""
    import json

    import jax

    from experiments.pretrain_agent import MAX_ACTION_TOKENS as ACTION_TOKENS
    from experiments.pretrain_agent import MAX_OBSERVATION_TOKENS as OBSERVATION_TOKENS
    from esroll.agents import FrozenLake, Sokoban
    from esroll.agents.multiturn import format_observation, episode_prompt, play

    assert sum(f.stat().st_size for f in AGENT.iterdir()) < 25 * 2**20
    tok = transformers.AutoTokenizer.from_pretrained(str(AGENT))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(AGENT), dtype=torch.float32).eval()
    env = FrozenLake()
    text = episode_prompt(env.instructions, env.reset(5)) + "right" + tok.eos_token + format_observation(env.render())
    ids = tok(text, return_tensors="np").input_ids
    cfg, params = load_hf(AGENT)
    ours, _ = forward(cfg, params, ids)
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    assert np.abs(np.asarray(ours) - ref).max() < 1e-4

    summary = json.loads((AGENT / "pretrain_summary.json").read_text())
    for cls in (FrozenLake, Sokoban):
        name = cls.__name__.lower()
        envs = [cls() for _ in range(64)]
        seeds = range(1_000_000, 1_000_064)
        longest_prompt = max(len(tok.encode(episode_prompt(e.instructions, e.reset(s)))) for e, s in zip(envs, seeds))
        turns = envs[0].options.max_turns
        assert longest_prompt + turns * (ACTION_TOKENS + OBSERVATION_TOKENS) <= cfg.max_position_embeddings
        ep = play(
            cfg, params, tok, envs, seeds, jax.random.key(0), max_turns=turns, max_action_tokens=ACTION_TOKENS,
            max_observation_tokens=OBSERVATION_TOKENS, temperature=0.0, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
        )  # fmt: skip
        assert ep.solved_B.mean() == summary[f"{name}_success"], name
    assert 0.2 <= summary["frozenlake_success"] <= 0.6
