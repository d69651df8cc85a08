"""Locate-and-commit: one of `boxes` closed boxes holds the target; look into boxes, then commit to one. The game
A2Agent's per-turn rewards are made for: a reward for *discovering* the target and one for *committing* to it.

Each episode's target box is drawn from its seed alone. The observation lists what has been seen so far:

    Boxes 1-4. Seen: 1 empty, 3 empty.

Actions: `look N` opens box N and shows what it holds (a box already open shows the same again); `answer N`
commits to box N and ends the episode. Rewards: `discover_reward` the first time a look finds the target,
`commit_reward` for an answer naming the target's box, 0 for a wrong answer (the episode ends either way), 0 for
every other turn; a malformed action is a no-op that costs `invalid_penalty`. At most `max_turns` turns (the default,
as many as there are boxes, leaves room to look into all but one and answer). Solved: the answer named the target.
"""

from __future__ import annotations

import dataclasses
import random

from esroll.agents.base import Turn, parse_action, register_env
from esroll.errors import check_fields


@dataclasses.dataclass(frozen=True)
class LocateOptions:
    """Locate's options (`env.options.locate.*`): boxes (2 to 9), max_turns, discover_reward, commit_reward,
    invalid_penalty."""

    boxes: int = 4
    max_turns: int = 4
    discover_reward: float = 0.5
    commit_reward: float = 1.0
    invalid_penalty: float = 0.1

    def __post_init__(self):
        checks = [
            ("boxes", 2 <= self.boxes <= 9, "in [2, 9]"),
            ("max_turns", self.max_turns >= 1, ">= 1"),
            ("discover_reward", self.discover_reward >= 0, ">= 0"),
            ("commit_reward", self.commit_reward > 0, "> 0"),
            ("invalid_penalty", self.invalid_penalty >= 0, ">= 0"),
        ]
        check_fields(self, checks, "LocateOptions")


def target_of(seed: int, boxes: int) -> int:
    """The box (1-based) that holds the target in the episode of `seed`."""
    return random.Random(f"locate-{int(seed)}").randrange(boxes) + 1


class Locate:
    """One locate-and-commit episode at a time (`esroll.agents.base.TextEnv`)."""

    def __init__(self, options: LocateOptions = LocateOptions()):
        self.options = options
        n = options.boxes
        self.actions = tuple(f"look {i}" for i in range(1, n + 1)) + tuple(f"answer {i}" for i in range(1, n + 1))
        self.instructions = f"Locate: one of boxes 1-{n} holds the target. Actions: look N, answer N."
        self.done = True

    def reset(self, seed: int) -> str:
        self.target = target_of(seed, self.options.boxes)
        self.seen: dict[int, bool] = {}  # box -> holds the target, in the order looked into
        self.answer: int | None = None
        self.turns, self.done = 0, False
        return self.render()

    @property
    def solved(self) -> bool:
        """Whether the answer named the target's box."""
        return self.answer == self.target

    def render(self) -> str:
        seen = ", ".join(f"{b} {'target' if t else 'empty'}" for b, t in self.seen.items()) or "none"
        return f"Boxes 1-{self.options.boxes}. Seen: {seen}."

    def plan(self) -> tuple[str, ...] | None:
        """What a player who sees only the observations does best from here: answer the target's box once it has
        been seen or once one unopened box is left, else look into the lowest unopened box. None once the episode
        has ended."""
        if self.done:
            return None
        seen = dict(self.seen)
        actions = []
        for _ in range(self.options.max_turns - self.turns):
            unopened = [b for b in range(1, self.options.boxes + 1) if b not in seen]
            found = [b for b, t in seen.items() if t]
            if found or len(unopened) == 1 or len(actions) + 1 == self.options.max_turns - self.turns:
                actions.append(f"answer {found[0] if found else unopened[0]}")
                break
            seen[unopened[0]] = unopened[0] == self.target
            actions.append(f"look {unopened[0]}")
        return tuple(actions)

    def step(self, action: str) -> Turn:
        if self.done:
            raise RuntimeError("Locate.step: the episode has ended; reset it first")
        o = self.options
        self.turns += 1
        index = parse_action(action, self.actions)
        reward = 0.0
        if index is None:
            reward = -o.invalid_penalty
        elif index < o.boxes:  # look
            box = index + 1
            if box == self.target and box not in self.seen:
                reward = o.discover_reward
            self.seen.setdefault(box, box == self.target)
        else:
            self.answer = index - o.boxes + 1
            reward = o.commit_reward if self.solved else 0.0
        self.done = self.answer is not None or self.turns >= o.max_turns
        return Turn(self.render(), float(reward), self.done, index is not None)


register_env("locate", Locate, options=LocateOptions)
