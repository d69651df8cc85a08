"""The two games without a map: locate-and-commit (`locate`) and rock-paper-scissors with a frozen player (`rps`),
played by hand and by their planners; a perfect and a random memory against the cycling opponent worked out in
closed form; hostile actions and memories answered as penalised no-ops, never evaluated."""

from __future__ import annotations

import itertools
import os

import pytest

from esroll.agents import ENVIRONMENTS, make_env
from esroll.agents.locate import target_of
from esroll.agents.rps import BEATS, MOVES, read_prediction
from esroll.errors import InputError

HOSTILE = [
    "",
    "   ",
    "jump",
    "look",
    "answer 12",
    "look 1 look 2",
    "__import__('os').system('touch /tmp/esroll_game_pwned')",
    "eval('1+1')",
    "{0.__class__}",
    "\x00\x01\x02",
    "look 1" + "\u200b",
    "l" * 1_000_000,
    "\n\nlook 1",
]


def test_registry_and_options():
    assert {"locate", "rps"} <= set(ENVIRONMENTS)
    with pytest.raises(InputError, match=r"'env\.options\.locate\.boxes': 1 \(expected in \[2, 9\]\)"):
        make_env("locate", {"boxes": 1})
    with pytest.raises(InputError, match=r"env\.options\.rps\.opponents"):
        make_env("rps", {"opponents": "cycle,mirror"})


# ---- locate


def _seed_with_target(box: int, boxes: int = 4) -> int:
    return next(s for s in range(100) if target_of(s, boxes) == box)


def test_locate_by_hand():
    """Target in box 3: `look 1` shows it empty (0), `look 3` finds it (0.5), looking again shows the same (0),
    `answer 3` commits (1) and ends the episode, solved. A wrong answer ends it with 0, unsolved; four turns at most."""
    env = make_env("locate")
    seed = _seed_with_target(3)
    assert env.reset(seed) == "Boxes 1-4. Seen: none."
    turns = [env.step(a) for a in ("look 1", "Look 3", "look 3.", "answer 3")]
    assert [t.observation for t in turns[:3]] == [
        "Boxes 1-4. Seen: 1 empty.",
        "Boxes 1-4. Seen: 1 empty, 3 target.",
        "Boxes 1-4. Seen: 1 empty, 3 target.",
    ]
    assert [t.reward for t in turns] == [0.0, 0.5, 0.0, 1.0]
    assert [t.done for t in turns] == [False, False, False, True] and env.solved
    env.reset(seed)
    wrong = env.step("answer 2")
    assert wrong.done and wrong.reward == 0.0 and not env.solved
    env.reset(seed)
    assert [env.step("look 1").done for _ in range(4)] == [False, False, False, True] and not env.solved


def test_locate_planner_solves_every_seed_from_what_it_sees():
    """The planner looks into boxes 1, 2, 3 in order until it sees the target, then answers it; with box 4 left it
    answers 4 unseen. Its return: 1.5 when it saw the target (discovery + commitment), 1.0 for box 4; every target box
    comes up over 40 seeds."""
    targets = set()
    for seed in range(40):
        env = make_env("locate")
        env.reset(seed)
        target = target_of(seed, 4)
        targets.add(target)
        plan = env.plan()
        expected = tuple(f"look {b}" for b in range(1, min(target, 3) + 1)) + (f"answer {target}",)
        if target == 4:
            expected = ("look 1", "look 2", "look 3", "answer 4")
        assert plan == expected
        total = sum(env.step(a).reward for a in plan)
        assert env.solved and env.done and total == (1.0 if target == 4 else 1.5)
    assert targets == {1, 2, 3, 4}


# ---- rock-paper-scissors


def _seed_of(kind: str) -> int:
    for seed in range(200):
        env = make_env("rps")
        env.reset(seed)
        if env.opponent == kind:
            return seed
    raise AssertionError(kind)


def test_reading_a_memory():
    assert read_prediction("rock") == "rock"
    assert read_prediction("They cycle: Rock, then PAPER.") == "paper"
    assert read_prediction("scissors\nrock") == "scissors"  # the first line only
    assert read_prediction("rocky road") is None and read_prediction("") is None
    assert read_prediction("x" * 100 + " rock") is None  # past the first 64 characters
    for text in (None, b"rock", 3, ["rock"]):
        assert read_prediction(text) is None


def test_a_perfect_memory_beats_the_cycle_every_round_after_the_first():
    """Against the cycling opponent (rock → paper → scissors → rock from a seeded start), a memory that predicts the
    successor of the opponent's last move, read from the observation alone, wins every round after the first; the
    first round's result is whatever its blind guess gives."""
    env = make_env("rps", {"max_turns": 6})
    observation = env.reset(_seed_of("cycle"))
    assert observation == "Round 1 of 6."
    rewards = []
    memory = "rock"
    for _ in range(6):
        turn = env.step(memory)
        rewards.append(turn.reward)
        last = turn.observation.split("Opponent played ", 1)[1].split(",", 1)[0]
        memory = BEATS[last]  # the cycle's next move
    assert rewards[1:] == [1.0] * 5 and turn.done and env.solved


@pytest.mark.parametrize("kind", ["cycle", "copy"])
def test_a_random_memory_scores_zero_in_expectation(kind):
    """Every one of the 3^4 memory sequences, equally likely: the player's move is uniform and independent of the
    opponent's (the cycle ignores it; the copier plays the player's previous move), so each round is a win, a tie
    or a loss with probability 1/3 each and the expected return is exactly 0."""
    seed = _seed_of(kind)
    totals = []
    for memories in itertools.product(MOVES, repeat=4):
        env = make_env("rps", {"max_turns": 4})
        env.reset(seed)
        totals.append(sum(env.step(m).reward for m in memories))
    assert sum(totals) == 0


def test_the_copier_and_the_biased_opponent():
    """The copier plays the player's previous move; the biased opponent plays its favourite about `bias` of the
    time (0.6: between 0.5 and 0.7 over 300 rounds), the same way for the same seed."""
    env = make_env("rps", {"max_turns": 5})
    env.reset(_seed_of("copy"))
    played = []
    for memory in ("rock", "paper", "paper", "scissors", "rock"):
        turn = env.step(memory)
        played.append(turn.observation)
    mine = [o.split("player played ", 1)[1].split(":", 1)[0] for o in played]
    theirs = [o.split("Opponent played ", 1)[1].split(",", 1)[0] for o in played]
    assert mine == ["paper", "scissors", "scissors", "rock", "paper"] and theirs[1:] == mine[:-1]
    seed = _seed_of("biased")
    runs = []
    for _ in range(2):
        env = make_env("rps", {"max_turns": 300})
        env.reset(seed)
        runs.append([env.step("rock").observation for _ in range(300)])
    assert runs[0] == runs[1]
    moves = [o.split("Opponent played ", 1)[1].split(",", 1)[0] for o in runs[0]]
    assert 0.5 < moves.count(env.favourite) / 300 < 0.7
    assert env.plan() is None  # ended
    env.reset(seed)
    assert env.plan() == ("rock",)
    env.step("rock")
    assert env.plan() == (env.favourite,)


@pytest.mark.parametrize("name", ["locate", "rps"])
def test_hostile_actions_are_penalised_no_ops(name, tmp_path):
    env = make_env(name, {"max_turns": len(HOSTILE) + 1})
    start = env.reset(3)
    for action in HOSTILE:
        turn = env.step(action)
        assert not turn.valid and not turn.done and turn.reward == pytest.approx(-0.1)
        if name == "locate":
            assert turn.observation == start
        else:
            assert turn.observation.endswith("No round.") and not env.history
    for action in (None, b"look 1", 3, ["rock"]):
        env.reset(3)
        assert not env.step(action).valid
    assert not (tmp_path / "esroll_game_pwned").exists() and not os.path.exists("/tmp/esroll_game_pwned")
