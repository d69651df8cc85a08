"""GRAFT: the group's completions merged into a graph whose nodes are states and whose edges are the steps taken,
node values by Bellman iteration over it, each step credited with V(target) − V(source) (`graft`) or with Graph GAE
along its completion's path (`graft_gae`). What it computes, and what its source leaves open: docs/step_level.md."""

from __future__ import annotations

import dataclasses

import numpy as np

from esroll.config import check_fields
from esroll.grpo.advantages import Estimate, Group, per_token, register_advantage, valid_rewards
from esroll.grpo.estimators.step_graph import ROOT, transitions

MAX_SWEEPS = 1000  # at most; a graph without cycles is exact after as many sweeps as its longest path has steps


def node_values(g: Group) -> tuple[list[dict], np.ndarray, np.ndarray]:
    """(values, before [X, M, J], after [X, M, J]): for each prompt, a dict from each state id (and `ROOT`) to its
    value on the graph of the group's valid completions. A node's value is the visit-weighted mean over what leaves
    it: each step out of it (an edge, weighted by the completions that took it) contributes its target's value, and
    each completion that ends there contributes its reward, V(n) = (Σ_ends r + Σ_edges n_e·V(target_e)) /
    (ends + Σ_edges n_e); a node only completions end at (a terminal) has the mean of their rewards. Solved by
    sweeps until no value moves by more than 1e-12: exact after the longest path's length on a graph without cycles;
    on one with cycles (arith_steps' states can form them) the sweeps still converge, geometrically, to the one
    solution of these linear equations, since from every node some completion's path leads to where it ends."""
    r, valid = valid_rewards(g)
    before, after = transitions(g)
    X, M, J = after.shape
    values = []
    for x in range(X):
        edges: dict[tuple[int, int], int] = {}
        ends: dict[int, list[float]] = {}
        for j in np.flatnonzero(valid[x]):
            steps = np.flatnonzero(after[x, j] >= 0)
            for s in steps:
                key = (int(before[x, j, s]), int(after[x, j, s]))
                edges[key] = edges.get(key, 0) + 1
            if steps.size:
                ends.setdefault(int(after[x, j, steps[-1]]), []).append(float(r[x, j]))
        nodes = {n for e in edges for n in e}
        out: dict[int, list[tuple[int, int]]] = {n: [] for n in nodes}
        for (src, dst), count in edges.items():
            out[src].append((dst, count))
        v = dict.fromkeys(nodes, 0.0)
        for _ in range(MAX_SWEEPS):
            new = {}
            for n in nodes:
                total = sum(ends.get(n, ())) + sum(c * v[d] for d, c in out[n])
                weight = len(ends.get(n, ())) + sum(c for _, c in out[n])
                new[n] = total / weight if weight else 0.0
            moved = max((abs(new[n] - v[n]) for n in nodes), default=0.0)
            v = new
            if moved <= 1e-12:
                break
        values.append(v)
    return values, before, after


def _edge_values(g: Group) -> tuple[list[dict], np.ndarray, np.ndarray, np.ndarray]:
    """(`node_values`' values, V(before) [X, M, J], V(after) [X, M, J], valid [X, M]) of every step of the valid
    completions; NaN elsewhere."""
    values, before, after = node_values(g)
    _, valid = valid_rewards(g)
    v_before = np.full(after.shape, np.nan)
    v_after = np.full(after.shape, np.nan)
    for x, v in enumerate(values):
        for j, s in zip(*np.nonzero((after[x] >= 0) & valid[x][:, None])):
            v_before[x, j, s] = v[int(before[x, j, s])]
            v_after[x, j, s] = v[int(after[x, j, s])]
    return values, v_before, v_after, valid


def _root_value(values: list[dict]) -> float:
    """V(prompt), the mean over the prompts with a valid completion (0 without one)."""
    with_root = [v[ROOT] for v in values if ROOT in v]
    return float(np.mean(with_root)) if with_root else 0.0


def graft(g: Group, o=None, state=None) -> Estimate:
    """Per-token advantages: each token gets its step's edge credit V(target) − V(source) on the group's state graph
    (`node_values`); a completion's credits sum to V(its last state) − V(prompt). Invalid completions and tokens past
    a completion's end get 0. Logs `graft_root_value` (V(prompt), mean over prompts with a valid completion) and
    `graft_nodes` (states per prompt, the prompt included, mean)."""
    values, v_before, v_after, _ = _edge_values(g)
    metrics = {"graft_root_value": _root_value(values), "graft_nodes": float(np.mean([len(v) for v in values]))}
    return Estimate(per_token(g, v_after - v_before), metrics=metrics)


@dataclasses.dataclass(frozen=True)
class GraftGaeOptions:
    """Graph GAE's options (`grpo.adv.graft_gae.*`): gamma, the discount per step; lam, GAE's λ (1: the completion's
    discounted reward less V(source); 0: one-step differences)."""

    gamma: float = 1.0
    lam: float = 0.95

    def __post_init__(self):
        checks = [("gamma", 0 <= self.gamma <= 1, "in [0, 1]"), ("lam", 0 <= self.lam <= 1, "in [0, 1]")]
        check_fields(self, checks, "GraftGaeOptions")


def graft_gae(g: Group, o: GraftGaeOptions, state=None) -> Estimate:
    """Per-token advantages by GAE along each completion's path through the state graph (`node_values` as the
    critic): δ_s = γ·V(after step s) − V(before step s) for each step but the last, δ = r − V(before) for the last
    (the reward arrives at the end, and the end has value 0), and A_s = Σ_{t ≥ s} (γλ)^(t−s)·δ_t. Invalid
    completions and tokens past a completion's end get 0. Logs `graft_gae_root_value` (as `graft_root_value`)."""
    r, _ = valid_rewards(g)
    values, v_before, v_after, valid = _edge_values(g)
    X, M, J = v_before.shape
    adv = np.zeros((X, M, J))
    for x, j in zip(*np.nonzero(valid)):
        steps = np.flatnonzero(~np.isnan(v_before[x, j]))
        running = 0.0
        for i in range(len(steps) - 1, -1, -1):
            s = steps[i]
            nxt = r[x, j] if i == len(steps) - 1 else o.gamma * v_after[x, j, s]
            delta = nxt - v_before[x, j, s]
            running = delta + o.gamma * o.lam * running
            adv[x, j, s] = running
    return Estimate(per_token(g, adv), metrics={"graft_gae_root_value": _root_value(values)})


register_advantage("graft", graft, needs=("steps", "states"))
register_advantage("graft_gae", graft_gae, options=GraftGaeOptions, needs=("steps", "states"))
