"""APPO (Agentic Procedural Policy Optimization): branch inside each completion at the tokens a Branching Score picks
(the policy's uncertainty there times how much training has raised the likelihood of what follows), then credit each
token with the outcomes of the initial completions and of the branches that share it, scaled by that likelihood gain.
What it computes and what is chosen where the source leaves it open: docs/step_level.md.

Shape letters (see `esroll`): X prompts, M completions per prompt, N tokens, K branch positions per completion, A
continuations per position."""

from __future__ import annotations

import dataclasses

import numpy as np

from esroll.config import check_fields
from esroll.grpo.advantages import Estimate, Group, register_advantage, valid_rewards

EPS = 1e-6  # the z-scores' guard: a row whose values are all equal gets z = 0


@dataclasses.dataclass(frozen=True)
class AppoOptions:
    """`grpo.adv.appo.*`. positions: branch points per completion (the source's B = 3); branches: continuations from
    each (1); half_life: in tokens, of the discount γ = 2^(−1/half_life) in the future likelihood gain Ω (32, the
    source's); omega_low, omega_high: Ω's clip range in the score and the scaling (the source's [1, 1.2]); scale: b in
    Â = Â_base · (1 + b · clip(Ω)) (0.5, the source's)."""

    positions: int = 3
    branches: int = 1
    half_life: float = 32.0
    omega_low: float = 1.0
    omega_high: float = 1.2
    scale: float = 0.5

    def __post_init__(self):
        check_fields(
            self,
            [
                ("positions", self.positions >= 1, ">= 1"),
                ("branches", self.branches >= 1, ">= 1"),
                ("half_life", self.half_life > 0, "> 0"),
                ("omega_low", 0 < self.omega_low <= self.omega_high, f"in (0, omega_high = {self.omega_high}]"),
                ("scale", self.scale >= 0, ">= 0"),
            ],
            "AppoOptions",
        )

    @property
    def gamma(self) -> float:
        return 2.0 ** (-1.0 / self.half_life)


def future_gain(logratio_BxN: np.ndarray, mask_BxN: np.ndarray, gamma: float) -> np.ndarray:
    """[B, N] Ω_t = exp(Σ_{k ≥ t} γ^{k−t} (log π_θ − log π_ref)(token k)), the sum over the row's tokens from t on
    (`mask_BxN` marks them); 1 past the end."""
    x = np.where(mask_BxN, np.asarray(logratio_BxN, np.float64), 0.0)
    acc = np.zeros(x.shape[0])
    out = np.zeros_like(x)
    for t in reversed(range(x.shape[1])):
        acc = x[:, t] + gamma * acc
        out[:, t] = acc
    return np.exp(np.clip(np.where(mask_BxN, out, 0.0), -50.0, 50.0))  # clipped far outside any Ω clip: no overflow


def zscores(x_BxN: np.ndarray, mask_BxN: np.ndarray) -> np.ndarray:
    """[B, N] (x − mean) / (std + EPS) over each row's tokens (population std); 0 past the end."""
    m = np.asarray(mask_BxN, bool)
    x = np.asarray(x_BxN, np.float64)
    n = np.maximum(m.sum(1, keepdims=True), 1)
    mean = np.where(m, x, 0.0).sum(1, keepdims=True) / n
    std = np.sqrt(np.where(m, (x - mean) ** 2, 0.0).sum(1, keepdims=True) / n)
    return np.where(m, (x - mean) / (std + EPS), 0.0)


def branching_scores(entropy_BxN, logratio_BxN, mask_BxN, o: AppoOptions):
    """(BS, z(H), z(Ω)) [B, N]: BS_t = z(H)_t · z(clip(Ω)_t), each z-scored within its row (`zscores`), Ω the future
    likelihood gain (`future_gain`) clipped to [omega_low, omega_high]."""
    omega = np.clip(future_gain(logratio_BxN, mask_BxN, o.gamma), o.omega_low, o.omega_high)
    z_h, z_o = zscores(entropy_BxN, mask_BxN), zscores(omega, mask_BxN)
    return z_h * z_o, z_h, z_o


def choose_positions(bs_BxN, z_h_BxN, z_o_BxN, length_B, count: int) -> np.ndarray:
    """[B, count] positions t (1 ≤ t ≤ length − 1, distinct, -1 where a row has fewer): first the tokens whose
    entropy and gain are both above their row's mean (z > 0: a product of two negative z-scores is positive too, and
    picks nothing uncertain) by BS, highest first; then the rest by entropy alone, highest first (so that where Ω is
    the same everywhere, as at the initial policy, the most uncertain tokens are chosen). Ties: the higher entropy,
    then the earlier position."""
    B = len(length_B)
    out = np.full((B, count), -1, np.int64)
    for b in range(B):
        t = np.arange(1, int(length_B[b]))
        if not len(t):
            continue
        eligible = (z_h_BxN[b, t] > 0) & (z_o_BxN[b, t] > 0)
        key = np.where(eligible, bs_BxN[b, t], -np.inf)
        order = np.lexsort((t, -z_h_BxN[b, t], -key, ~eligible))
        chosen = t[order[:count]]
        out[b, : len(chosen)] = chosen
    return out


def branch_points(o: AppoOptions, g: Group) -> tuple[np.ndarray, int]:
    """([X, M, K] positions, A): where each valid completion is branched (`choose_positions` on `branching_scores`),
    K = `positions`, and the continuations from each, A = `branches`."""
    X, M, N = g.token_mask.shape
    mask = np.asarray(g.token_mask, bool).reshape(X * M, N)
    bs, z_h, z_o = branching_scores(g.entropy.reshape(X * M, N), g.ref_logratio.reshape(X * M, N), mask, o)
    _, valid = valid_rewards(g)
    length = np.where(valid.reshape(-1), mask.sum(1), 0)
    return choose_positions(bs, z_h, z_o, length, o.positions).reshape(X, M, o.positions), o.branches


def _z(r: np.ndarray, of: np.ndarray) -> np.ndarray:
    """(r − mean(of)) / std(of), population std; 0 where `of` has fewer than two values or no spread."""
    if of.size < 2 or of.std() == 0:
        return np.zeros_like(r)
    return (r - of.mean()) / of.std()


def appo(g: Group, o: AppoOptions, state=None) -> Estimate:
    """Per-token advantages Â = Â_base · (1 + b · clip(Ω)) on the initial completions (the branches only give
    rewards). Â_base of token i of completion n is the mean over the two groups it belongs to of its z-score there:
    the initial completions' group, z(R_n) against the prompt's valid completions; and, where branches share the
    token (those from a position t > i: their first t tokens are the completion's), the branches' group, the mean
    z-score of those branches' rewards against all of the prompt's branches. Tokens with no branch through them get
    z(R_n) alone. Invalid completions and tokens past the end get 0. Logs `appo_shared` (the share of tokens that
    branches share), `appo_position` (a branch point's mean position over its completion's length),
    `appo_branch_reward` (the branches' mean reward), `appo_scale` (mean 1 + b·clip(Ω) over tokens) and
    `appo_entropy_overlap` (the share of branch points that are among their completion's as many most uncertain
    tokens: 1 where the score chose as entropy alone would)."""
    r, valid = valid_rewards(g)
    X, M, N = g.token_mask.shape
    mask = np.asarray(g.token_mask, bool) & valid[..., None]
    omega = np.clip(future_gain(g.ref_logratio.reshape(X * M, N), mask.reshape(X * M, N), o.gamma), o.omega_low,
                    o.omega_high).reshape(X, M, N)  # fmt: skip
    pos = np.asarray(g.branch_positions)
    br = np.asarray(g.branch_rewards, np.float64)
    taken = (pos >= 1)[..., None] & np.isfinite(br) & valid[..., None, None]  # [X, M, K, A]
    base = np.zeros((X, M, N))
    shared = np.zeros((X, M, N), bool)
    for x in range(X):
        z_init = _z(r[x], r[x, valid[x]])
        z_branch = np.where(taken[x], _z(np.nan_to_num(br[x]), br[x][taken[x]]), 0.0)  # [M, K, A]
        for j in range(M):
            sums, counts = np.zeros(N), np.zeros(N)
            for k in np.flatnonzero(pos[x, j] >= 1):
                n = taken[x, j, k].sum()
                sums[: pos[x, j, k]] += z_branch[j, k].sum()
                counts[: pos[x, j, k]] += n
            through = counts > 0
            base[x, j] = np.where(through, 0.5 * (z_init[j] + sums / np.maximum(counts, 1)), z_init[j])
            shared[x, j] = through
    overlap = []  # of each completion's branch points, the share among its most uncertain tokens (t ≥ 1)
    entropy = np.asarray(g.entropy, np.float64)
    for x, j in zip(*np.nonzero((pos >= 1).any(-1) & valid)):
        chosen = pos[x, j][pos[x, j] >= 1]
        t = np.arange(1, int(mask[x, j].sum()))
        top = t[np.lexsort((t, -entropy[x, j, t]))[: len(chosen)]]
        overlap.append(np.isin(chosen, top).mean())
    scale = 1.0 + o.scale * omega
    advantage = np.where(mask, base * scale, 0.0)
    lengths = mask.sum(-1)
    rel = [pos[x, j, k] / lengths[x, j] for x, j, k in zip(*np.nonzero((pos >= 1) & (lengths > 0)[..., None]))]
    metrics = {
        "appo_shared": float(shared[mask].mean()) if mask.any() else 0.0,
        "appo_position": float(np.mean(rel)) if rel else 0.0,
        "appo_branch_reward": float(br[taken].mean()) if taken.any() else 0.0,
        "appo_scale": float(scale[mask].mean()) if mask.any() else 0.0,
        "appo_entropy_overlap": float(np.mean(overlap)) if overlap else 0.0,
    }
    return Estimate(advantage.astype(np.float32), metrics=metrics)


register_advantage("appo", appo, options=AppoOptions, needs=("logprobs", "token_branches"), branch_points=branch_points)
