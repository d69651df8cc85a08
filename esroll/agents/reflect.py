"""RePro's reflection: after an episode ends, the agent reads its finished episode and the outcome and rates the
progress of each of its moves, one symbol per turn: "+" (closer to the goal), "0" (no nearer, no farther), "-"
(farther, or lost). The ratings are the model's text, read as untrusted: `parse_ratings` takes the first line of
at most `MAX_RATING_CHARS` characters, spaces ignored, and accepts exactly one symbol per turn played; anything else
is a malformed reflection (None), never an exception.

Where the environment has a planner, progress has an exact oracle: a move's rating is the sign of the drop in the
number of moves left to the goal (`oracle_ratings`; the environment's `moves_left()` where it has one, as Sokoban,
whose `plan()` searches only the turns left; else the length of `plan()`, as FrozenLake's shortest walk, None from
a hole), which scores the model's ratings
(`rating_agreement`) and writes the demonstrations a reflecting model is built from
(`experiments.pretrain_agent --reflect`). What RePro does with the ratings: `esroll.grpo.estimators.repro`.
"""

from __future__ import annotations

from collections.abc import Sequence

from esroll.agents.base import TextEnv

SYMBOLS = {"+": 1, "0": 0, "-": -1}  # a rating's text -> its value
MAX_RATING_CHARS = 64
HEADER_TOKENS = 16  # the room of the outcome line beyond the final observation's `env.max_observation_tokens`


def reflection_header(observation: str, solved: bool) -> str:
    """The text that follows an episode's last action before the reflection: the final observation, then the outcome
    and the request for one rating per move."""
    return f"{observation}\n{'Solved' if solved else 'Failed'}. Progress:\n"


def parse_ratings(text: str, turns: int) -> list[int] | None:
    """The ratings `text` gives `turns` moves, each in {1, 0, −1}, or None when the text is not exactly `turns`
    symbols of "+", "0", "-" on its first line (spaces ignored, at most `MAX_RATING_CHARS` characters read)."""
    if not isinstance(text, str) or turns < 1:
        return None
    line = text[:MAX_RATING_CHARS].split("\n", 1)[0].replace(" ", "")
    if len(line) != turns or any(c not in SYMBOLS for c in line):
        return None
    return [SYMBOLS[c] for c in line]


def format_ratings(ratings: Sequence[int]) -> str:
    """The text of `ratings` (values in {1, 0, −1}), as `parse_ratings` reads it."""
    symbol = {v: k for k, v in SYMBOLS.items()}
    return "".join(symbol[int(r)] for r in ratings)


def _moves_left(env) -> float:
    """The fewest moves to the goal from the current state, whatever the turns left: 0 when solved, inf when the goal
    cannot be reached."""
    if env.solved:
        return 0.0
    if callable(getattr(env, "moves_left", None)):
        return float(env.moves_left())
    path = env.plan()
    return float("inf") if path is None else float(len(path))


def oracle_ratings(env: TextEnv, seed: int, actions: Sequence[str]) -> list[int] | None:
    """Each move's exact progress on the episode `seed` replayed with `actions`: the sign of the drop in the moves left
    to the goal (`_moves_left`, never bounded by the turns left), a move from where the goal can be reached to where
    it cannot rated −1; None when the environment has no planner. A malformed action changes nothing (0)."""
    if not callable(getattr(env, "plan", None)):
        return None
    env.reset(int(seed))
    before, out = _moves_left(env), []
    for action in actions:
        env.step(action)
        after = _moves_left(env)
        out.append(0 if before == after else (1 if after < before else -1))
        before = after
    return out


def rating_agreement(ratings: Sequence[int], oracle: Sequence[int]) -> tuple[int, int]:
    """(moves whose rating equals the oracle's, moves compared)."""
    return sum(int(a == b) for a, b in zip(ratings, oracle)), min(len(ratings), len(oracle))


def reflection_room(max_turns):
    """The reflection's token room for episodes of at most `max_turns` turns: a rating per turn, the end token and one
    spare (an int, or a config's field reference to one)."""
    return max_turns + 2


def score_reflections(env: TextEnv, seeds, reflections, actions, turns) -> dict[str, float]:
    """Episodes' reflections scored, one entry per episode (its seed, reflection text, actions and turns played):
    `reflection_parsed`, the share whose ratings parse; `reflection_oracle`, the share of the parsed ratings equal to
    the oracle's (replayed on `env`), present only where the environment has a planner and a reflection parsed."""
    parsed = agree = compared = 0
    for seed, text, acted, count in zip(seeds, reflections, actions, turns):
        ratings = parse_ratings(text, int(count))
        if ratings is None:
            continue
        parsed += 1
        oracle = oracle_ratings(env, seed, acted)
        if oracle is not None:
            same, n = rating_agreement(ratings, oracle)
            agree, compared = agree + same, compared + n
    out = {"reflection_parsed": parsed / max(len(seeds), 1)}
    if compared:
        out["reflection_oracle"] = agree / compared
    return out
