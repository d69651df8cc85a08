"""Rock-paper-scissors with a frozen player: the agent writes a one-line memory each round, and a scripted player,
which never learns, plays the move that beats the opponent's move the memory predicts. MemoPilot's setting: the
policy trained is the memory's writer, its reward the frozen player's result, round by round.

Each episode's opponent is drawn from its seed alone: `cycle` (rock, paper, scissors, rock, ... from a seeded start),
`biased` (its seeded favourite move with probability `bias`, else one of the other two, from a seeded generator) or
`copy` (the player's previous move; a seeded first move). The observation says the round and the last one's moves:

    Round 2 of 6. Opponent played rock, player played paper: win.

The memory is untrusted text: the player reads its first line (at most `MAX_ACTION_CHARS` characters) and takes
the last move it names (rock, paper or scissors) as the prediction, nothing else; a memory that names none is a
malformed action, a no-op round (no one plays; the observation says "No round.") that costs `invalid_penalty`.
Reward per round: +1 when the player wins, 0 for a tie, −1 for a loss. `max_turns` rounds (malformed ones included).
Solved: more wins than losses.
"""

from __future__ import annotations

import dataclasses
import random
import re

from esroll.agents.base import MAX_ACTION_CHARS, Turn, register_env
from esroll.errors import check_fields

MOVES = ("rock", "paper", "scissors")
BEATS = {"rock": "paper", "paper": "scissors", "scissors": "rock"}  # move -> the move that beats it
OPPONENTS = ("cycle", "biased", "copy")


def read_prediction(memory: str) -> str | None:
    """The move a memory predicts: the last of rock, paper, scissors named in its first line (at most
    `MAX_ACTION_CHARS` characters, any case), or None. The text is only searched, never evaluated."""
    if not isinstance(memory, str):
        return None
    words = re.findall(r"[a-z]+", memory[:MAX_ACTION_CHARS].split("\n", 1)[0].lower())
    named = [w for w in words if w in MOVES]
    return named[-1] if named else None


def outcome(player: str, opponent: str) -> int:
    """+1 when `player` beats `opponent`, 0 for a tie, −1 for a loss."""
    return 0 if player == opponent else (1 if BEATS[opponent] == player else -1)


@dataclasses.dataclass(frozen=True)
class RpsOptions:
    """Rock-paper-scissors' options (`env.options.rps.*`): max_turns (the rounds of a match), opponents (which
    scripted opponents the seeds draw from, comma-separated among cycle, biased, copy), bias (the biased opponent's
    favourite's probability), invalid_penalty."""

    max_turns: int = 6
    opponents: str = "cycle,biased,copy"
    bias: float = 0.6
    invalid_penalty: float = 0.1

    def __post_init__(self):
        kinds = [k.strip() for k in self.opponents.split(",") if k.strip()]
        checks = [
            ("max_turns", self.max_turns >= 1, ">= 1"),
            ("opponents", bool(kinds) and set(kinds) <= set(OPPONENTS), f"some of {', '.join(OPPONENTS)}"),
            ("bias", 0 <= self.bias <= 1, "in [0, 1]"),
            ("invalid_penalty", self.invalid_penalty >= 0, ">= 0"),
        ]
        check_fields(self, checks, "RpsOptions")

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(k.strip() for k in self.opponents.split(",") if k.strip())


class Rps:
    """One rock-paper-scissors match at a time (`esroll.agents.base.TextEnv`). `actions` are the memories that name
    one move; any line that names a move is read the same way (`read_prediction`)."""

    actions = MOVES
    instructions = "Rock-paper-scissors: write the opponent's next move; a player plays what beats it."

    def __init__(self, options: RpsOptions = RpsOptions()):
        self.options = options
        self.done = True

    def reset(self, seed: int) -> str:
        o = self.options
        self._rng = random.Random(f"rps-{int(seed)}")
        self.opponent = o.kinds[self._rng.randrange(len(o.kinds))]
        self.favourite = MOVES[self._rng.randrange(3)]  # cycle: its start; biased: its favourite; copy: first move
        self.history: list[tuple[str, str]] = []  # (opponent's move, player's move) per round played
        self.wins = self.losses = 0
        self.turns, self.done = 0, False
        self._last = ""
        return self.render()

    @property
    def solved(self) -> bool:
        """Whether the player has more wins than losses."""
        return self.wins > self.losses

    def next_move(self) -> str:
        """The opponent's move this round (its generator advances only when a round is played)."""
        if not self.history:
            return self.favourite
        if self.opponent == "cycle":
            return BEATS[self.history[-1][0]]  # rock -> paper -> scissors -> rock
        if self.opponent == "copy":
            return self.history[-1][1]
        return self._biased

    def render(self) -> str:
        head = f"Round {min(self.turns + 1, self.options.max_turns)} of {self.options.max_turns}."
        return f"{head} {self._last}".strip()

    def plan(self) -> tuple[str, ...] | None:
        """The prediction an observer of the moves so far does best with: the cycle's next move, the player's last
        move against the copier, the favourite against the biased opponent once it has played (rock before any
        move is seen). One memory: the rounds after it depend on the moves."""
        if self.done:
            return None
        if not self.history:
            return ("rock",)
        return (self.favourite if self.opponent == "biased" else self.next_move(),)

    def step(self, action: str) -> Turn:
        if self.done:
            raise RuntimeError("Rps.step: the episode has ended; reset it first")
        o = self.options
        self.turns += 1
        prediction = read_prediction(action)
        if prediction is None:
            reward = -o.invalid_penalty
            self._last = "No round."
        else:
            if self.opponent == "biased" and self.history:
                others = [m for m in MOVES if m != self.favourite]
                self._biased = self.favourite if self._rng.random() < o.bias else others[self._rng.randrange(2)]
            theirs, mine = self.next_move(), BEATS[prediction]
            reward = outcome(mine, theirs)
            self.wins += reward > 0
            self.losses += reward < 0
            self.history.append((theirs, mine))
            result = {1: "win", 0: "tie", -1: "loss"}[reward]
            self._last = f"Opponent played {theirs}, player played {mine}: {result}."
        self.done = self.turns >= o.max_turns
        return Turn(self.render(), float(reward), self.done, prediction is not None)


register_env("rps", Rps, options=RpsOptions)
