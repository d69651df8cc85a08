"""Sokoban in small rooms: push every box onto a target. Our own generator (the `gym-sokoban` package is unmaintained),
with the standard game's rules and rewards.

A room is `size` × `size` with walls around it (`size` 5 or 6: a 3 × 3 or 4 × 4 floor; in a 6 × 6 room up to
`inner_walls` more wall tiles, the floor kept connected), `boxes` boxes (1 or 2) and as many targets. The
observation is the room, one row per line:

    ######
    #_.__#
    #_$__#
    #__@_#
    #____#
    ######

`#` wall, `_` floor, `.` target, `$` box, `*` box on a target, `@` the player, `+` the player on a target.

Actions: up, down, left, right. Walking into a wall or into a box that cannot move (a wall or a box behind it) stays
in place; walking into a box pushes it one tile. A push cannot be undone (there is no pull): a box pushed into a
corner off target is lost. Rewards, as in the standard formulation: −`step_cost` every turn, +1 for a box pushed
onto a target, −1 for one pushed off, +`solve_bonus` when every box is on a target (the episode ends); a malformed
action is a no-op that costs `step_cost` + `invalid_penalty`. At most `max_turns` turns.

Solvable by construction: the generator puts the boxes on their targets and the player on a free tile, then plays
the game backwards for `pulls` random moves, where a move may pull the box behind the player along; a pull is a push
reversed, so reading the moves backwards solves the level. A level is kept when every box is off its target and its
shortest solution (breadth-first search over player and box positions, `solve`) takes from 2 to `max_turns` moves:
`Level.solution` is that solution.
"""

from __future__ import annotations

import dataclasses
import random

from esroll.agents.base import Turn, parse_action, register_env
from esroll.errors import check_fields

ACTIONS = ("up", "down", "left", "right")
MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
OPPOSITE = {"up": "down", "down": "up", "left": "right", "right": "left"}
Pos = tuple[int, int]
# Above the number of (player, boxes) states of any level (16 inner tiles, at most 2 boxes: 16 × 120), so a search
# this deep finds a solution whenever there is one.
MOVES_LIMIT = 2048


@dataclasses.dataclass(frozen=True)
class SokobanOptions:
    """Sokoban's options (`env.options.sokoban.*`): size (5 or 6), boxes (1 or 2), inner_walls (at most this many
    extra wall tiles in a 6 × 6 room), pulls (backward moves that scramble a level), max_turns, step_cost,
    solve_bonus, invalid_penalty."""

    size: int = 6
    boxes: int = 1
    inner_walls: int = 2
    pulls: int = 24
    max_turns: int = 10
    step_cost: float = 0.1
    solve_bonus: float = 10.0
    invalid_penalty: float = 0.1

    def __post_init__(self):
        checks = [
            ("size", self.size in (5, 6), "5 or 6"),
            ("boxes", self.boxes in (1, 2), "1 or 2"),
            ("inner_walls", self.inner_walls >= 0, ">= 0"),
            ("pulls", self.pulls >= 1, ">= 1"),
            ("max_turns", self.max_turns >= 1, ">= 1"),
            ("step_cost", self.step_cost >= 0, ">= 0"),
            ("solve_bonus", self.solve_bonus >= 0, ">= 0"),
            ("invalid_penalty", self.invalid_penalty >= 0, ">= 0"),
        ]
        check_fields(self, checks, "SokobanOptions")


@dataclasses.dataclass(frozen=True)
class Level:
    """A level: the walls, the targets, where the boxes and the player start, and a shortest sequence of actions
    that solves it."""

    size: int
    walls: frozenset[Pos]
    targets: frozenset[Pos]
    boxes: frozenset[Pos]
    player: Pos
    solution: tuple[str, ...]


def _step(pos: Pos, action: str) -> Pos:
    dr, dc = MOVES[action]
    return pos[0] + dr, pos[1] + dc


def _connected(floor: set[Pos]) -> bool:
    start = next(iter(floor))
    seen, todo = {start}, [start]
    while todo:
        pos = todo.pop()
        for action in ACTIONS:
            nxt = _step(pos, action)
            if nxt in floor and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return len(seen) == len(floor)


def make_level(seed: int, o: SokobanOptions) -> Level:
    """The level of `seed`: every box off its target after the backward moves, the solution recorded. Deterministic
    from the seed (and the options)."""
    rng = random.Random(f"sokoban-{seed}")
    border = {(r, c) for r in range(o.size) for c in range(o.size) if r in (0, o.size - 1) or c in (0, o.size - 1)}
    interior = sorted({(r, c) for r in range(o.size) for c in range(o.size)} - border)
    for _ in range(1000):
        walls = set(border)
        if o.size == 6:
            for cell in rng.sample(interior, rng.randint(0, o.inner_walls)):
                if _connected(set(interior) - (walls | {cell})):
                    walls.add(cell)
        floor = [p for p in interior if p not in walls]
        if len(floor) < 2 * o.boxes + 2:
            continue
        targets = rng.sample(floor, o.boxes)
        boxes = set(targets)
        player = rng.choice([p for p in floor if p not in boxes])
        for _ in range(o.pulls):
            action = rng.choice(ACTIONS)
            nxt = _step(player, action)
            if nxt in walls or nxt in boxes:
                continue
            behind = _step(player, OPPOSITE[action])
            if behind in boxes and rng.random() < 0.7:  # pull it along
                boxes.remove(behind)
                boxes.add(player)
            player = nxt
        if not boxes.isdisjoint(targets):
            continue
        solution = solve(frozenset(walls), frozenset(targets), frozenset(boxes), player, o.max_turns)
        if solution is not None and len(solution) >= 2:
            return Level(o.size, frozenset(walls), frozenset(targets), frozenset(boxes), player, solution)
    raise RuntimeError(f"sokoban: no level for seed {seed} in 1000 tries")  # not reached at the allowed options


def solve(walls: frozenset[Pos], targets: frozenset[Pos], boxes: frozenset[Pos], player: Pos, limit: int):
    """A shortest sequence of actions (at most `limit`) that puts every box on a target, or None: breadth-first
    search over (player, boxes), the moves tried in `ACTIONS` order."""
    start = (player, boxes)
    parent: dict = {start: None}
    frontier = [start]
    for _ in range(limit):
        nxt_frontier = []
        for state in frontier:
            pos, bx = state
            for action in ACTIONS:
                nxt = _step(pos, action)
                if nxt in walls:
                    continue
                if nxt in bx:
                    beyond = _step(nxt, action)
                    if beyond in walls or beyond in bx:
                        continue
                    new = (nxt, (bx - {nxt}) | {beyond})
                else:
                    new = (nxt, bx)
                if new in parent:
                    continue
                parent[new] = (state, action)
                if new[1] == targets:
                    path = []
                    while parent[new] is not None:
                        new, action = parent[new]
                        path.append(action)
                    return tuple(reversed(path))
                nxt_frontier.append(new)
        frontier = nxt_frontier
    return None


class Sokoban:
    """One Sokoban episode at a time (`esroll.agents.base.TextEnv`)."""

    actions = ACTIONS
    instructions = "Sokoban: push every $ onto a . target. Actions: up, down, left, right."

    def __init__(self, options: SokobanOptions = SokobanOptions()):
        self.options = options
        self.done = True

    def reset(self, seed: int) -> str:
        self.level = make_level(int(seed), self.options)
        self.boxes, self.player = set(self.level.boxes), self.level.player
        self.turns, self.done = 0, False
        return self.render()

    @property
    def solved(self) -> bool:
        """Whether every box is on a target."""
        return self.boxes == set(self.level.targets)

    def plan(self) -> tuple[str, ...] | None:
        """A shortest solution from the current state within the turns left (`solve`), or None."""
        lv = self.level
        return solve(lv.walls, lv.targets, frozenset(self.boxes), self.player, self.options.max_turns - self.turns)

    def moves_left(self) -> float:
        """The fewest moves from the current state to a solved level, whatever the turns left (inf when none): the
        distance RePro's progress oracle reads (`esroll.agents.reflect.oracle_ratings`)."""
        lv = self.level
        path = solve(lv.walls, lv.targets, frozenset(self.boxes), self.player, MOVES_LIMIT)
        return float("inf") if path is None else float(len(path))

    def render(self) -> str:
        lv = self.level
        rows = []
        for r in range(lv.size):
            row = []
            for c in range(lv.size):
                p = (r, c)
                on_target = p in lv.targets
                if p in lv.walls:
                    row.append("#")
                elif p == self.player:
                    row.append("+" if on_target else "@")
                elif p in self.boxes:
                    row.append("*" if on_target else "$")
                else:
                    row.append("." if on_target else "_")
            rows.append("".join(row))
        return "\n".join(rows)

    def step(self, action: str) -> Turn:
        if self.done:
            raise RuntimeError("Sokoban.step: the episode has ended; reset it first")
        o, targets = self.options, self.level.targets
        self.turns += 1
        reward = -o.step_cost
        index = parse_action(action, ACTIONS)
        if index is None:
            reward -= o.invalid_penalty
        else:
            move = ACTIONS[index]
            nxt = _step(self.player, move)
            if nxt in self.boxes:
                beyond = _step(nxt, move)
                if beyond not in self.level.walls and beyond not in self.boxes:
                    self.boxes.remove(nxt)
                    self.boxes.add(beyond)
                    reward += (beyond in targets) - (nxt in targets)
                    self.player = nxt
            elif nxt not in self.level.walls:
                self.player = nxt
            if self.solved:
                reward += o.solve_bonus
        self.done = self.solved or self.turns >= o.max_turns
        return Turn(self.render(), float(reward), self.done, index is not None)


register_env("sokoban", Sokoban, options=SokobanOptions)
