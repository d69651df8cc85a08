"""FrozenLake through gymnasium (the maintained standard; nothing to download): walk from S to G on a grid of
frozen tiles (F) without falling into a hole (H), not slippery, so an action moves exactly where it says.

Each episode's map is gymnasium's `generate_random_map(size, p_frozen, seed)` (a map with a path from S to G,
drawn from the seed alone). The observation is the grid, one row per line, with the player's tile shown as P:

    PFFF
    FHFH
    FFFH
    HFFG

Actions: left, down, right, up (a move into the edge stays in place, as in gymnasium). Reward: 1 on reaching G (the
episode ends), 0 on falling into a hole (it ends), 0 otherwise; a malformed action is a no-op that costs
`invalid_penalty`. At most `max_turns` turns.
"""

from __future__ import annotations

import dataclasses

from esroll.agents.base import Turn, parse_action, register_env
from esroll.errors import check_fields

ACTIONS = ("left", "down", "right", "up")  # gymnasium's action ids 0-3, in its order


@dataclasses.dataclass(frozen=True)
class FrozenLakeOptions:
    """FrozenLake's options (`env.options.frozenlake.*`). size: the grid's side; p_frozen: the probability that a
    tile of the random map is frozen; max_turns: turns per episode; invalid_penalty: what a malformed action costs."""

    size: int = 4
    p_frozen: float = 0.8
    max_turns: int = 8
    invalid_penalty: float = 0.1

    def __post_init__(self):
        checks = [
            ("size", 2 <= self.size <= 12, "in [2, 12]"),
            ("p_frozen", 0 < self.p_frozen <= 1, "in (0, 1]"),
            ("max_turns", self.max_turns >= 1, ">= 1"),
            ("invalid_penalty", self.invalid_penalty >= 0, ">= 0"),
        ]
        check_fields(self, checks, "FrozenLakeOptions")


class FrozenLake:
    """One FrozenLake episode at a time (`esroll.agents.base.TextEnv`)."""

    actions = ACTIONS
    instructions = "FrozenLake: walk P to G, never onto H. Actions: left, down, right, up."

    def __init__(self, options: FrozenLakeOptions = FrozenLakeOptions()):
        try:
            import gymnasium  # noqa: F401
        except ImportError:
            raise ImportError("the frozenlake environment needs gymnasium: pip install -e '.[agents]'") from None
        self.options = options
        self._env = None
        self.turns = 0
        self.done = True

    def reset(self, seed: int) -> str:
        import gymnasium
        from gymnasium.envs.toy_text.frozen_lake import generate_random_map

        o = self.options
        self.map = generate_random_map(size=o.size, p=o.p_frozen, seed=int(seed))
        self._env = gymnasium.make("FrozenLake-v1", desc=self.map, is_slippery=False).unwrapped
        self.state, _ = self._env.reset(seed=int(seed))
        self.turns, self.done = 0, False
        return self.render()

    @property
    def solved(self) -> bool:
        """Whether the player stands on G."""
        size = self.options.size
        return self.map[self.state // size][self.state % size] == "G"

    def render(self) -> str:
        """The grid with the player's tile as P."""
        size = self.options.size
        rows = [list(row) for row in self.map]
        rows[self.state // size][self.state % size] = "P"
        return "\n".join("".join(row) for row in rows)

    def plan(self) -> tuple[str, ...] | None:
        """A shortest walk from the player's tile to G over non-hole tiles (breadth-first), or None (none from a
        hole: the episode is lost)."""
        size, rows = self.options.size, self.map
        start = (self.state // size, self.state % size)
        if rows[start[0]][start[1]] == "H":
            return None
        parent = {start: None}
        frontier = [start]
        while frontier:
            nxt = []
            for pos in frontier:
                if rows[pos[0]][pos[1]] == "G":
                    path = []
                    while parent[pos] is not None:
                        pos, action = parent[pos]
                        path.append(action)
                    return tuple(reversed(path))
                for action, (dr, dc) in zip(ACTIONS, ((0, -1), (1, 0), (0, 1), (-1, 0))):
                    r, c = pos[0] + dr, pos[1] + dc
                    if 0 <= r < size and 0 <= c < size and rows[r][c] != "H" and (r, c) not in parent:
                        parent[(r, c)] = (pos, action)
                        nxt.append((r, c))
            frontier = nxt
        return None

    def step(self, action: str) -> Turn:
        if self.done:
            raise RuntimeError("FrozenLake.step: the episode has ended; reset it first")
        self.turns += 1
        index = parse_action(action, ACTIONS)
        if index is None:
            reward, terminated = -self.options.invalid_penalty, False
        else:
            self.state, reward, terminated, _, _ = self._env.step(index)
            reward = float(reward)
        self.done = bool(terminated) or self.turns >= self.options.max_turns
        return Turn(self.render(), reward, self.done, index is not None)


register_env("frozenlake", FrozenLake, options=FrozenLakeOptions)
