"""ProGPO (progress- and reliability-oriented group policy optimisation): exact-prefix comparison of the steps taken
from one prefix, where the group took more than one, plus a transition credit from state potentials estimated from
the group's rollouts at several history depths and fused by inverse variance. What it computes, and what its source
leaves open (its semantic expansion is left out): docs/step_level.md."""

from __future__ import annotations

import dataclasses

import numpy as np

from esroll.config import check_fields
from esroll.grpo.advantages import Estimate, Group, per_token, register_advantage, valid_rewards


@dataclasses.dataclass(frozen=True)
class ProgpoOptions:
    """ProGPO's options (`grpo.adv.progpo.*`). depths: H, the history depths h = 1..H whose potentials are fused (a
    state at depth h is the text of the last h steps); transition_weight: the weight of the transition credit added
    to the exact-prefix comparison."""

    depths: int = 3
    transition_weight: float = 1.0

    def __post_init__(self):
        checks = [
            ("depths", self.depths >= 1, ">= 1"),
            ("transition_weight", self.transition_weight >= 0, ">= 0"),
        ]
        check_fields(self, checks, "ProgpoOptions")


def potentials(texts: list[tuple[str, ...]], rewards: list[float], depths: int) -> list[np.ndarray]:
    """For each completion (its steps' texts and its reward; the valid completions of one prompt), Φ after each of
    its steps: at depth h the state after step s is the text of steps s − h + 1..s, and its potential p_h is the mean
    reward of the completions that pass through that state (each counted once), n_h of them; the depths are fused by
    inverse variance, Φ = Σ_h (p_h / v_h) / Σ_h (1 / v_h) with v_h = p̃(1 − p̃) / n_h and p̃ = (n_h·p_h + 1/2) / (n_h +
    1) (the Bernoulli variance of a mean of 0/1 rewards, smoothed so that a state whose rewards all agree keeps a
    finite weight)."""
    tables = []
    for h in range(1, depths + 1):
        seen: dict[tuple[str, ...], list[float]] = {}
        for steps, r in zip(texts, rewards):
            for key in {tuple(steps[max(0, s - h + 1) : s + 1]) for s in range(len(steps))}:
                seen.setdefault(key, []).append(r)
        tables.append({k: (float(np.mean(v)), len(v)) for k, v in seen.items()})
    out = []
    for steps in texts:
        phi = np.zeros(len(steps))
        for s in range(len(steps)):
            num = den = 0.0
            for h, table in enumerate(tables, start=1):
                p, n = table[tuple(steps[max(0, s - h + 1) : s + 1])]
                smooth = (n * p + 0.5) / (n + 1)
                weight = n / (smooth * (1 - smooth))
                num, den = num + weight * p, den + weight
            phi[s] = num / den
        out.append(phi)
    return out


def progpo_steps(g: Group, o: ProgpoOptions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(peer [X, M, J], transition [X, M, J], has_peers [X, M, J]) per step of the valid completions (NaN elsewhere).

    peer: from the exact text before step s, the mean reward of the completions that took this same step less the
    mean reward of all completions from that prefix; 0 where every completion from the prefix took the same step (no
    comparison). transition: Φ(after step s) − Φ(before), Φ from `potentials`, Φ(prompt) = the group's mean reward."""
    r, valid = valid_rewards(g)
    X, M = r.shape
    J = max(int(np.asarray(g.steps.count_B).max(initial=0)), 1)
    peer = np.full((X, M, J), np.nan)
    transition = np.full((X, M, J), np.nan)
    has_peers = np.zeros((X, M, J), bool)
    for x in range(X):
        rows = [j for j in np.flatnonzero(valid[x]) if g.steps.count_B[x * M + j] > 0]
        texts = [tuple(g.steps.text[x * M + j][: g.steps.count_B[x * M + j]]) for j in rows]
        if not rows:
            continue
        rewards = [float(r[x, j]) for j in rows]
        phi = potentials(texts, rewards, o.depths)
        root = float(np.mean(rewards))
        for i, j in enumerate(rows):
            for s in range(len(texts[i])):
                prefix, step = texts[i][:s], texts[i][s]
                same_prefix = [k for k in range(len(rows)) if len(texts[k]) > s and texts[k][:s] == prefix]
                taken = {texts[k][s] for k in same_prefix}
                has_peers[x, j, s] = len(taken) > 1
                if len(taken) > 1:
                    same_step = [rewards[k] for k in same_prefix if texts[k][s] == step]
                    peer[x, j, s] = np.mean(same_step) - np.mean([rewards[k] for k in same_prefix])
                else:
                    peer[x, j, s] = 0.0
                before = root if s == 0 else phi[i][s - 1]
                transition[x, j, s] = phi[i][s] - before
    return peer, transition, has_peers


def progpo(g: Group, o: ProgpoOptions, state=None) -> Estimate:
    """Per-token advantages: each token gets its step's exact-prefix comparison plus `transition_weight` × its
    transition credit (`progpo_steps`). Invalid completions and tokens past a completion's end get 0. Logs
    `progpo_steps_with_peers` (the fraction of steps whose prefix saw more than one step taken)."""
    peer, transition, has_peers = progpo_steps(g, o)
    known = ~np.isnan(peer)
    with_peers = float(has_peers[known].mean()) if known.any() else 0.0
    adv = np.where(known, peer + o.transition_weight * transition, np.nan)
    return Estimate(per_token(g, adv), metrics={"progpo_steps_with_peers": with_peers})


register_advantage("progpo", progpo, options=ProgpoOptions, needs=("steps",))
