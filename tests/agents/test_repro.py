"""RePro (`esroll.agents.reflect`, `esroll.grpo.estimators.repro`): the ratings read from untrusted text, the exact
progress oracle on maps worked by hand, the estimator on a hand-built group, the reflection decoded after each
episode in the episode's own cache (its log-probabilities those of a cache-free forward over the whole text), the
refusals, and RePro training by name."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from esroll.agents import FrozenLake, Sokoban, Turns
from esroll.agents.multiturn import play
from esroll.agents.reflect import (
    MAX_RATING_CHARS,
    format_ratings,
    oracle_ratings,
    parse_ratings,
    rating_agreement,
    reflection_header,
)
from esroll.config import ConfigError
from esroll.grpo.advantages import Group
from esroll.grpo.estimators.repro import ReproOptions, reflection_reward, repro

pytest.importorskip("gymnasium")


def test_ratings_are_read_from_untrusted_text():
    """Exactly one "+", "0" or "-" per move on the first line, spaces ignored; every other text is malformed (None),
    never evaluated, and no more than MAX_RATING_CHARS characters are read."""
    assert parse_ratings("+0-", 3) == [1, 0, -1]
    assert parse_ratings(" + 0 - \nanything after", 3) == [1, 0, -1]
    assert format_ratings([1, 0, -1]) == "+0-" and parse_ratings(format_ratings([-1, -1]), 2) == [-1, -1]
    hostile = ["++", "++++", "+x-", "__import__('os').system('true')", "", "\n+0-", "+0-" + "\x00", "1 0 -1", None, 3]
    for text in hostile:
        assert parse_ratings(text, 3) is None, text
    assert parse_ratings("+" * MAX_RATING_CHARS, MAX_RATING_CHARS) == [1] * MAX_RATING_CHARS
    assert parse_ratings("+" * (MAX_RATING_CHARS + 1), MAX_RATING_CHARS + 1) is None  # read only this far
    assert parse_ratings("", 0) is None


def test_the_oracle_rates_moves_by_the_drop_in_moves_left():
    """FrozenLake seed 1's map is SHFH / FFHF / FFFF / FFFG: from S the goal is 6 moves away. "up" bumps the edge
    (6 → 6: 0), "jump" is malformed (0), "down" reaches (1, 0), 5 away (+), "up" goes back (−), "right" falls into
    the hole at (0, 1), from where the goal cannot be reached (−). The shortest walk is all "+". A Sokoban level's
    own plan is all "+", and a malformed action in it 0, also when the malformed actions leave too few turns to
    finish: the moves left are counted whatever the turn limit."""
    env = FrozenLake()
    assert env.reset(1).split("\n") == ["PHFH", "FFHF", "FFFF", "FFFG"]
    assert oracle_ratings(FrozenLake(), 1, ["up", "jump", "down", "up", "right"]) == [0, 0, 1, -1, -1]
    walk = ["down", "down", "down", "right", "right", "right"]
    assert oracle_ratings(FrozenLake(), 1, walk) == [1] * 6
    assert rating_agreement([1, 1, 0, 1, 1, 1], [1] * 6) == (5, 6)
    sokoban = Sokoban()
    sokoban.reset(5)
    plan = list(sokoban.plan())
    assert oracle_ratings(Sokoban(), 5, ["push", *plan]) == [0] + [1] * len(plan)
    wasted = sokoban.options.max_turns - len(plan) + 1  # then the plan no longer fits the turns left
    assert len(plan) >= 2 and oracle_ratings(Sokoban(), 5, ["push"] * wasted + plan[:-1]) == [0] * wasted + [1] * (
        len(plan) - 1
    )
    assert oracle_ratings(type("NoPlanner", (), {"reset": lambda self, s: ""})(), 0, ["up"]) is None


def test_the_reflection_reward_asks_for_ratings_that_agree_with_the_outcome():
    assert reflection_reward(None, True) == -1.0 and reflection_reward(None, False) == -1.0
    assert reflection_reward([1, 0, 1], True) == 1.0 and reflection_reward([1, -1], True) == 0.0
    assert reflection_reward([1, -1, 0], False) == 1.0 and reflection_reward([1, 1], False) == 0.0


N = 12  # tokens per row: turn t's action is tokens [4t, 4t + 2), the reflection [8, 10)


def _group(rows, rewards):
    """rows: (turns played, solved, reflection text); X groups of len(rows[x]) episodes."""
    X, M = len(rows), len(rows[0])
    B, W = X * M, 2
    flat = [r for g in rows for r in g]
    start, end = np.zeros((B, W), int), np.zeros((B, W), int)
    count = np.array([r[0] for r in flat])
    for b in range(B):
        for t in range(count[b]):
            start[b, t], end[b, t] = 4 * t, 4 * t + 2
    turns = Turns(start, end, np.zeros((B, W)), count, [["s"] * W for _ in range(B)], None,
                  np.array([r[1] for r in flat]), [r[2] for r in flat], np.full(B, 8), np.full(B, 10))  # fmt: skip
    mask = np.zeros((X, M, N), bool)
    mask[..., :10] = True
    return Group(rewards=np.array(rewards, np.float64), token_mask=mask, turns=turns)


def test_repro_credits_moves_by_their_ratings_and_reflections_by_their_agreement():
    """Group 0: episode a (2 turns, solved, return 1) rates "++"; b (2 turns, failed, 0) rates "+-"; c (1 turn,
    failed, 0) writes "ok" (malformed). Episode advantages: returns (1, 0, 0), mean 1/3, sample std √(1/3), so
    (2/3, −1/3, −1/3)/(√(1/3) + 1e-4). Rated turns: a's (1, 1) and b's (1, −1): mean 1/2, centred
    (1/2, 1/2, 1/2, −3/2), sample std √((3/4 + 9/4)/3) = 1. Reflection rewards: a 1 (sum 2 > 0, solved), b 1 (sum 0,
    failed), c −1: mean 1/3, centred (2/3, 2/3, −4/3), sample std √((4/9 + 4/9 + 16/9)/2) = √(4/3).
    Group 1: d (2 turns, solved, return 1) rates "+0"; e and f are invalid (return NaN): d alone gets no episode or
    reflection advantage, its two rated turns (1, 0) are centred to (1/2, −1/2) over std √(1/2); e and f get 0."""
    rows = [[(2, True, "++"), (2, False, "+-"), (1, False, "ok")], [(2, True, "+0"), (2, False, "++"), (1, False, "-")]]
    g = _group(rows, [[1.0, 0.0, 0.0], [1.0, math.nan, math.nan]])
    out = repro(g, ReproOptions(omega=0.5, reflect_weight=2.0))
    adv = out.advantage
    eps = 1e-4
    episode = np.array([2 / 3, -1 / 3, -1 / 3]) / (math.sqrt(1 / 3) + eps)
    step = np.array([[0.5, 0.5], [0.5, -1.5]]) / (1 + eps)
    reflect = np.array([2 / 3, 2 / 3, -4 / 3]) / (math.sqrt(4 / 3) + eps)
    for j, (turns, steps) in enumerate([(2, step[0]), (2, step[1]), (1, [0.0])]):
        for t in range(turns):
            np.testing.assert_allclose(adv[0, j, 4 * t : 4 * t + 2], episode[j] + 0.5 * steps[t], rtol=1e-5)
        np.testing.assert_allclose(adv[0, j, 8:10], 2.0 * reflect[j], rtol=1e-5)
    assert adv[0, 2, 4:8].tolist() == [0.0] * 4  # c played one turn
    d = np.array([0.5, -0.5]) / (math.sqrt(0.5) + eps)
    np.testing.assert_allclose(adv[1, 0, [0, 4]], 0.5 * d, rtol=1e-5)
    assert adv[1, 0, 8:10].tolist() == [0.0, 0.0] and not adv[1, 1:].any()
    assert out.metrics["repro_parsed"] == pytest.approx(3 / 4) and out.metrics["repro_consistent"] == 1.0
    with pytest.raises(ValueError, match="env.reflect_tokens"):
        repro(g._replace(turns=g.turns._replace(reflections=None)), ReproOptions())


@pytest.fixture(scope="module")
def model():
    from transformers import AutoTokenizer

    from conftest import SHIPPED_MODEL
    from esroll.models import load_hf

    cfg, params = load_hf(SHIPPED_MODEL)
    return cfg, params, AutoTokenizer.from_pretrained(SHIPPED_MODEL)


@pytest.mark.parametrize("max_turns, scripted", [(8, False), (2, False), (3, True)])
def test_the_reflection_follows_each_episode_in_its_cache(model, max_turns, scripted):
    """After each episode (6 rows, sampled; with max_turns 2 most are cut before the environment ends them; scripted
    with actions that fill all 6 action tokens, so that each one's last token is still to be cached when the
    header comes) comes the header the environment writes — the final observation and the outcome — with no loss,
    then the model's reflection, with loss; the episode itself is the one played without a reflection, and every
    model token's recorded log-probability is that of a cache-free forward over the whole text."""
    from test_multiturn import check_logprobs_by_full_forward

    cfg, params, tok = model
    seeds = list(range(6))
    kwargs = dict(max_turns=max_turns, max_action_tokens=6, max_observation_tokens=32, temperature=1.0,
                  eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)  # fmt: skip
    if scripted:
        kwargs["actions"] = lambda turn, observations: ["jumpjumpjump"] * 6  # malformed: no move, no end
    plain = play(cfg, params, tok, [FrozenLake() for _ in seeds], seeds, jax.random.key(4), **kwargs)
    ep = play(cfg, params, tok, [FrozenLake() for _ in seeds], seeds, jax.random.key(4), reflect_tokens=7, **kwargs)
    assert plain.reflections is None and len(ep.reflections) == 6
    for b in range(6):
        assert ep.actions[b] == plain.actions[b] and ep.turns_B[b] == plain.turns_B[b]
        last = int(ep.action_end_BxW[b, ep.turns_B[b] - 1])
        header = tok.encode(reflection_header(ep.observations[b][-1], bool(ep.solved_B[b])), add_special_tokens=False)
        s, e = int(ep.reflection_start_B[b]), int(ep.reflection_end_B[b])
        assert s == last + len(header) and list(ep.tokens_BxT[b, last:s]) == header
        assert not ep.loss_mask_BxT[b, last:s].any() and ep.loss_mask_BxT[b, s:e].all() and 1 <= e - s <= 7
        assert e == ep.length_B[b] and list(ep.tokens_BxT[b, :last]) == list(plain.tokens_BxT[b, :last])
        text = tok.decode([int(i) for i in ep.tokens_BxT[b, s:e] if i != tok.eos_token_id])
        assert ep.reflections[b] == text
    if max_turns == 2:
        assert not ep.done_B.all()  # some rows were cut: their last answer is not repeated before the header
    if scripted:  # every action took all 6 tokens, its end token last
        assert ((ep.action_end_BxW - ep.action_start_BxW)[:, :3] == 6).all() and ep.turns_B.tolist() == [3] * 6
    check_logprobs_by_full_forward(model, ep)


def test_reflection_settings_are_refused_where_nothing_reads_them():
    """repro without a reflection's room, a reflection with an estimator that does not read it, and a reflection
    with ES: each refused in one line naming env.reflect_tokens."""
    from configs import agents as agent_configs
    from esroll.config import from_config_dict
    from esroll.experiment import check_names

    def build(variant, **overrides):
        cd = agent_configs.get_config(variant)
        for key, value in overrides.items():
            section, name = key.split(".")
            cd[section][name] = value
        return check_names(from_config_dict(cd.to_dict()))

    assert build("quick,repro").env.reflect_tokens == 10
    for game in ("rps", "locate"):
        with pytest.raises(ValueError, match="repro plays the reflecting agent model"):
            agent_configs.get_config(f"{game},repro")
    for variant, value in (("quick,repro", 0), ("quick,gigpo", 10), ("quick,looroll", 10)):
        with pytest.raises(ConfigError, match=r"env\.reflect_tokens") as e:
            build(variant, **{"env.reflect_tokens": value, "train.max_new_tokens": 400})
        assert "\n" not in str(e.value)


@pytest.mark.e2e
def test_repro_trains_by_name(tmp_path):
    """configs/agents.py:quick,repro takes GRPO steps from the reflecting agent model with a reflection after every
    episode: each step logs the share of reflections that parse and their agreement with the oracle, and RePro's
    own figures."""
    from configs import agents
    from conftest import shipped_config
    from esroll.metrics import read_metrics
    from esroll.train import train_and_evaluate

    cfg = shipped_config(agents.get_config, "quick,repro")
    assert cfg.model.path.endswith("tiny-qwen3-reflect") and cfg.env.reflect_tokens == 10
    train_and_evaluate(cfg, tmp_path, progress=False)
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "repro_parsed" in r]
    assert len(steps) == 2
    for r in steps:
        assert 0 <= r["reflection_parsed"] <= 1 and ("reflection_oracle" in r) == (r["reflection_parsed"] > 0)
        assert r["repro_parsed"] == pytest.approx(r["reflection_parsed"])  # every episode of a quick step is valid
