"""The text environments: FrozenLake (through gymnasium) and Sokoban (our generator) played by hand and by scripts,
their levels solvable (checked by a search written here, on the rendered text), and hostile or malformed actions
answered as penalised no-ops, never evaluated, never an exception."""

from __future__ import annotations

import pytest

from esroll.agents import ENVIRONMENTS, FrozenLake, Level, Sokoban, SokobanOptions, make_env, parse_action, solve
from esroll.errors import InputError

from conftest import lake_path

pytest.importorskip("gymnasium")

MOVES = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}

HOSTILE = [
    "",
    "   ",
    "jump",
    "up up",
    "LEFT!",
    "__import__('os').system('touch /tmp/esroll_env_pwned')",
    "eval('1+1')",
    "right; rm -rf /",
    "{0.__class__}",
    "\x00\x01\x02",
    "up" + "\u200b",  # a zero-width space after the word
    "l" * 1_000_000,
    "\n\nleft",
]


def grid(text: str) -> list[str]:
    return text.split("\n")


def find(text: str, chars: str) -> list[tuple[int, int]]:
    return [(r, c) for r, row in enumerate(grid(text)) for c, ch in enumerate(row) if ch in chars]


# ---- the action words


@pytest.mark.parametrize(
    "text, index",
    [("left", 0), ("Left", 0), ("  up  ", 3), ("right.", 2), ("down\nthen up", 1), ("up up", None), ("", None)],
)
def test_parse_action(text, index):
    assert parse_action(text, ("left", "down", "right", "up")) == index


def test_registry_names_and_options():
    assert {"frozenlake", "sokoban"} <= set(ENVIRONMENTS)
    assert make_env("sokoban", {"size": 5}).options.size == 5
    with pytest.raises(InputError, match=r"'env\.options\.sokoban\.size': 7 \(expected 5 or 6\)"):
        make_env("sokoban", {"size": 7})
    with pytest.raises(InputError, match="env.options.frozenlake.sise"):
        make_env("frozenlake", {"sise": 4})
    with pytest.raises(ValueError, match="unknown environment 'lake'"):
        make_env("lake")


# ---- FrozenLake


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_frozenlake_scripted_episode(seed):
    """The shortest walk, played turn by turn: P moves one tile a turn in the named direction, rewards 0 then 1 at
    G, and the episode ends there. The same seed gives the same map."""
    env = FrozenLake()
    first = env.reset(seed)
    assert first == FrozenLake().reset(seed) and len(grid(first)) == 4 and first.count("G") == 1
    assert find(first, "P") == [(0, 0)]  # gymnasium's random maps start at the top left
    path = lake_path(first)
    assert 1 <= len(path) <= 8
    pos = (0, 0)
    for i, action in enumerate(path):
        turn = env.step(action)
        pos = (pos[0] + MOVES[action][0], pos[1] + MOVES[action][1])
        last = i == len(path) - 1
        assert turn.valid and turn.done == last and turn.reward == (1.0 if last else 0.0)
        assert find(turn.observation, "P") == [pos] and env.solved == last
    with pytest.raises(RuntimeError, match="ended"):
        env.step("up")


def test_frozenlake_hole_edge_and_turn_limit():
    env = FrozenLake()
    seeds = [s for s in range(50) if "H" in env.reset(s)]
    env.reset(seeds[0])
    text = env.render()
    (hole,) = find(text, "H")[:1]
    # A walk into the top-left wall stays in place.
    assert find(env.step("up").observation, "P") == [(0, 0)]
    # Walk to the hole along a path over frozen tiles: the episode ends with 0.
    rows = grid(text)
    rows[hole[0]] = rows[hole[0]][: hole[1]] + "G" + rows[hole[0]][hole[1] + 1 :]
    rows = [row.replace("G", "F") if r != hole[0] else row for r, row in enumerate(rows)]
    walk = lake_path("\n".join(rows))
    for action in walk[:-1]:
        assert not env.step(action).done
    turn = env.step(walk[-1])
    assert turn.done and turn.reward == 0.0 and find(turn.observation, "P") == [hole] and not env.solved
    # Eight turns at most.
    env.reset(seeds[0])
    turns = [env.step("left") for _ in range(8)]
    assert [t.done for t in turns] == [False] * 7 + [True]


@pytest.mark.parametrize("name", ["frozenlake", "sokoban"])
def test_hostile_and_malformed_actions_are_penalised_no_ops(name, tmp_path):
    env = make_env(name, {"max_turns": len(HOSTILE) + 1})
    start = env.reset(3)
    penalty = -0.1 if name == "frozenlake" else -0.2  # Sokoban: its step cost as well
    for action in HOSTILE:
        turn = env.step(action)
        assert not turn.valid and turn.observation == start and not turn.done
        assert turn.reward == pytest.approx(penalty)
    for action in (None, b"up", 3, ["up"]):  # not text at all
        env.reset(3)
        assert not env.step(action).valid
    assert not (tmp_path / "esroll_env_pwned").exists()
    import os

    assert not os.path.exists("/tmp/esroll_env_pwned")


# ---- Sokoban


def sokoban_search(text: str, limit: int) -> int | None:
    """Moves of a shortest solution of the rendered room (breadth-first over player and boxes), or None."""
    walls = set(find(text, "#"))
    targets = frozenset(find(text, ".*+"))
    boxes = frozenset(find(text, "$*"))
    (player,) = find(text, "@+")
    seen = {(player, boxes)}
    frontier = [(player, boxes)]
    for depth in range(1, limit + 1):
        nxt = []
        for pos, bx in frontier:
            for dr, dc in MOVES.values():
                p = (pos[0] + dr, pos[1] + dc)
                if p in walls:
                    continue
                b = bx
                if p in bx:
                    q = (p[0] + dr, p[1] + dc)
                    if q in walls or q in bx:
                        continue
                    b = (bx - {p}) | {q}
                if b == targets:
                    return depth
                if (p, b) not in seen:
                    seen.add((p, b))
                    nxt.append((p, b))
        frontier = nxt
    return None


@pytest.mark.parametrize("size,boxes", [(5, 1), (6, 1), (5, 2), (6, 2)])
def test_sokoban_levels_are_solvable_and_their_solution_solves_them(size, boxes):
    """40 seeds per setting: walls around the room, the right counts of boxes and targets, no box on a target at the
    start, a shortest solution (by the search above) of 2 to max_turns moves, and the level's own solution, played
    through `step`, solves it with the rewards of its pushes."""
    options = SokobanOptions(size=size, boxes=boxes)
    for seed in range(40):
        env = Sokoban(options)
        text = env.reset(seed)
        rows = grid(text)
        assert len(rows) == size and all(len(r) == size for r in rows)
        assert rows[0] == rows[-1] == "#" * size and all(r[0] == r[-1] == "#" for r in rows)
        assert len(find(text, "$")) == boxes and len(find(text, ".+")) == boxes and not find(text, "*")
        shortest = sokoban_search(text, options.max_turns)
        assert shortest is not None and 2 <= shortest == len(env.level.solution) <= options.max_turns
        total = 0.0
        for i, action in enumerate(env.level.solution):
            turn = env.step(action)
            total += turn.reward
            assert turn.done == (i == len(env.level.solution) - 1)
        assert env.solved and len(find(turn.observation, "*")) == boxes
        # Every turn costs 0.1; each box ends on a target (+1 net per box, whatever it crossed); solving: +10.
        assert total == pytest.approx(-0.1 * len(env.level.solution) + boxes + 10.0)
    assert Sokoban(options).reset(5) == Sokoban(options).reset(5)


def hand_level() -> Sokoban:
    """#######        a 5 x 7 room by hand: targets at (1, 4) and (3, 2), boxes at (1, 3) and (2, 4),
    #__$._#        the player at (3, 4)
    #___$_#
    #_.@__#    (drawn: row 3 has the player at column 4)
    #######"""
    env = Sokoban(SokobanOptions(max_turns=20))
    walls = {(r, c) for r in range(5) for c in range(7) if r in (0, 4) or c in (0, 6)}
    env.level = Level(7, frozenset(walls), frozenset({(1, 4), (3, 2)}), frozenset({(1, 3), (2, 4)}), (3, 4), ())
    env.boxes, env.player, env.turns, env.done = set(env.level.boxes), env.level.player, 0, False
    return env


def test_sokoban_pushes_by_hand():
    env = hand_level()
    turn = env.step("up")  # the box at (2, 4) would go to (1, 4): a target: +1, less the step
    assert turn.reward == pytest.approx(0.9) and env.player == (2, 4) and (1, 4) in env.boxes
    turn = env.step("up")  # the box at (1, 4) cannot go into the wall: nothing moves
    assert turn.reward == pytest.approx(-0.1) and env.player == (2, 4) and env.boxes == {(1, 3), (1, 4)}
    env.step("left")  # (2, 3)
    turn = env.step("up")  # the box at (1, 3) cannot go into the wall either
    assert env.player == (2, 3) and turn.valid
    env.step("right"), env.step("right")  # (2, 5)
    turn = env.step("up")  # onto (1, 5)
    assert env.player == (1, 5)
    turn = env.step("left")  # pushes the box at (1, 4) into the box at (1, 3): blocked
    assert env.player == (1, 5) and turn.reward == pytest.approx(-0.1)
    assert sokoban_search(env.render(), 20) is None  # both boxes against the top wall, one target below: lost
    assert solve(env.level.walls, env.level.targets, frozenset(env.boxes), env.player, 20) is None


def test_sokoban_push_off_a_target_costs_one():
    env = hand_level()
    env.step("left"), env.step("left")  # (3, 2): the player on a target
    assert "+" in env.render()
    env.step("up"), env.step("up")  # (1, 2)
    turn = env.step("right")  # pushes (1, 3) onto the target (1, 4)
    assert turn.reward == pytest.approx(0.9) and env.player == (1, 3)
    for action in ("down", "down", "right", "right", "up", "up"):  # around the box at (2, 4) to (1, 5)
        env.step(action)
    assert env.player == (1, 5)
    turn = env.step("left")  # pushes (1, 4) off its target to (1, 3)
    assert turn.reward == pytest.approx(-1.1) and env.boxes == {(1, 3), (2, 4)}


def test_plans_are_shortest_solutions_from_the_current_state():
    """`plan()`, the planner the agent model learns from: FrozenLake's walk has the length of the search above and
    reaches G when played; Sokoban's is the level's solution at the start, and after a first move, one turn fewer is
    left and the plan (when one exists) still solves the level."""
    for seed in range(10):
        lake = FrozenLake()
        text = lake.reset(seed)
        walk = lake.plan()
        assert len(walk) == len(lake_path(text))
        assert [lake.step(a).reward for a in walk][-1] == 1.0
        box = Sokoban()
        box.reset(seed)
        assert box.plan() == box.level.solution
        box.step(box.level.solution[0])
        rest = box.plan()
        assert rest is not None and len(rest) == len(box.level.solution) - 1
        for action in rest:
            turn = box.step(action)
        assert box.solved and turn.done
