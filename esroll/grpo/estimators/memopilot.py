"""MemoPilot's turn-level advantage for fixed-round games: each round's reward against the same round of the other
episodes of its game (a context-independent normalisation: the rounds of one seed are comparable because every
episode plays the same number of them). Our reading of the source; what it computes and where it stops being
sound: docs/agents.md."""

from __future__ import annotations

import dataclasses

import numpy as np

from esroll.config import check_fields
from esroll.grpo.advantages import Estimate, Group, register_advantage, valid_rewards
from esroll.grpo.estimators.turns import EPS, normalise, turn_tokens


@dataclasses.dataclass(frozen=True)
class MemoPilotOptions:
    """`grpo.adv.memopilot.*`. std: divide by the round's sample std (+ eps) as GRPO's group std; eps."""

    std: bool = True
    eps: float = EPS

    def __post_init__(self):
        check_fields(self, [("eps", self.eps > 0, "> 0")], "MemoPilotOptions")


def memopilot(g: Group, o: MemoPilotOptions, state=None) -> Estimate:
    """Per-token advantages A_{i,t} = (r_{i,t} − mean_j r_{j,t}) / (std_j r_{j,t} + eps) over the valid episodes j of
    the same game (the group's prompt) that played round t, on round t's action tokens; a round that only one
    episode played gets 0, and an invalid episode 0 everywhere. Sound only when the group's episodes play the same
    number of rounds (rock-paper-scissors: `max_turns`): where they do not, the t-th turns of different episodes are
    different situations (as verl-project/verl#7244 notes for per-turn-index normalisation), and
    `memopilot_ragged` logs the share of groups whose episodes played different numbers of turns."""
    _, valid = valid_rewards(g)
    X, M = valid.shape
    turns = g.turns
    reward = np.asarray(turns.reward_BxW, np.float64)
    count = np.asarray(turns.count_B)
    value = np.zeros_like(reward)
    ragged = 0
    for x in range(X):
        rows = x * M + np.flatnonzero(valid[x])
        ragged += len(set(count[rows].tolist())) > 1
        for t in range(reward.shape[1]):
            present = rows[count[rows] > t]
            value[present, t] = normalise(reward[present, t], o.std, o.eps)
    return Estimate(turn_tokens(g, value), metrics={"memopilot_ragged": ragged / max(X, 1)})


register_advantage("memopilot", memopilot, options=MemoPilotOptions, needs=("turns",))
