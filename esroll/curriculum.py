"""Training-loop methods that choose what each step trains on, for ES and GRPO alike: adaptive data scheduling (ADS)
and AdaPrefix's assisted prompts. Pure numpy functions of a small state that the trainer checkpoints with the
parameters, so a resumed run takes exactly the steps of an uninterrupted one; every random draw comes from
(seed, step). What they read back from a step is each prompt's success (its mean reward over the step's
completions: GRPO's group, or every ES member's answer).

ADS (adaptive data scheduling). Examples are grouped into clusters (`esroll.data.cluster_key`). Each cluster keeps an
EMA of its success s_c (0.5 before it is seen) and each example its own (unknown before it is seen). A step draws
`ads_candidates` × X candidates: a cluster with probability ∝ exp(β·4·s_c(1 − s_c)) (1 at s = ½, 0 at s ∈ {0, 1}:
clusters at the policy's boundary are drawn more), then an example of it uniformly; of the distinct candidates it
keeps the X nearest the boundary by their own success (s_e(1 − s_e), unknown counted as ½), ties in a seeded random
order (topped up uniformly if fewer than X are distinct). After the step each cluster present takes one EMA step
toward its examples' mean success.

AdaPrefix. Every training example holds a prefix length k_e (in tokens of its reference solution: `solution`, or
`target_text` for tasks whose answers are direct). Its prompt is then followed by the first round(k_e·(1 − t))
tokens of that solution as the forced start of the answer, t = min(step / horizon, 1), so assistance is withdrawn by
the horizon (evaluation never gets a prefix). After each step a feedback controller sets
k_e ← clip(k_e + gain·(target − success_e), 0, length_e) for the step's examples: more help where an example fails,
less where it succeeds. The reward scores prefix + completion as one answer; in GRPO the prefix is part
of the prompt, so its tokens are outside the loss.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from esroll.config import CurriculumConfig, ExperimentConfig
from esroll.data import Example, batch_indices, cluster_key

PREFIX_SOURCES = ("solution", "target")  # what AdaPrefix takes its prefix from (`CurriculumConfig.prefix_source`)


# ---- ADS


def ads_init(cluster_of: np.ndarray) -> dict:
    """ADS's state for examples whose cluster indices are `cluster_of` [n] (0 .. C−1)."""
    C = int(np.max(cluster_of)) + 1
    return {
        "cluster_success": np.full(C, 0.5, np.float32),
        "example_success": np.full(len(cluster_of), np.nan, np.float32),
    }


def ads_weights(state: dict, temperature: float) -> np.ndarray:
    """The probability of drawing each cluster: ∝ exp(β·4·s_c(1 − s_c))."""
    s = np.asarray(state["cluster_success"], np.float64)
    logits = temperature * 4.0 * s * (1.0 - s)
    w = np.exp(logits - logits.max())
    return w / w.sum()


def ads_select(
    state: dict, cluster_of: np.ndarray, size: int, cfg: CurriculumConfig, seed: int, step: int
) -> np.ndarray:
    """The `size` training examples of step `step`: clusters by `ads_weights`, candidates uniformly within them,
    the ones nearest the boundary kept (see the module docstring). Deterministic in (seed, step, state)."""
    rng = np.random.default_rng([seed, step, 31])
    clusters = np.arange(len(state["cluster_success"]))
    members = [np.flatnonzero(cluster_of == c) for c in clusters]
    present = np.array([len(m) > 0 for m in members])
    w = ads_weights(state, cfg.ads_temperature) * present
    w = w / w.sum()
    drawn = rng.choice(clusters, size * cfg.ads_candidates, p=w)
    candidates = np.array([members[c][rng.integers(len(members[c]))] for c in drawn])
    s = np.asarray(state["example_success"], np.float64)[candidates]
    closeness = np.where(np.isnan(s), 0.25, s * (1 - s))
    order = np.lexsort((rng.random(len(candidates)), -closeness))  # nearest the boundary first, ties at random
    chosen = list(dict.fromkeys(candidates[order].tolist()))[:size]  # each example at most once
    if len(chosen) < size:  # too few distinct candidates: the rest uniformly from the examples not chosen
        rest = np.setdiff1d(np.arange(len(cluster_of)), chosen)
        need = size - len(chosen)
        chosen += rng.choice(rest, need, replace=len(rest) < need).tolist()
    return np.array(chosen)


def ads_update(state: dict, cluster_of: np.ndarray, idx: np.ndarray, success: np.ndarray, decay: float) -> dict:
    """The state after a step on examples `idx` (distinct) with success rates `success`: one EMA step per example
    (its first success taken as it is) and one per cluster present, towards the mean success of its examples in the
    step."""
    state = {k: np.array(v, np.float64) for k, v in state.items()}
    idx, success = np.asarray(idx), np.asarray(success, np.float64)
    old = state["example_success"][idx]
    state["example_success"][idx] = np.where(np.isnan(old), success, decay * old + (1 - decay) * success)
    for c in np.unique(cluster_of[idx]):
        mean = success[cluster_of[idx] == c].mean()
        state["cluster_success"][c] = decay * state["cluster_success"][c] + (1 - decay) * mean
    return {k: v.astype(np.float32) for k, v in state.items()}


def ads_metrics(state: dict, idx: np.ndarray, names: list[str], temperature: float) -> dict[str, float]:
    """What ADS acts on: each cluster's weight (`ads_weight[<cluster>]`) and the fraction of the step's examples
    whose own success was known and strictly between 0 and 1 (`ads_boundary`)."""
    w = ads_weights(state, temperature)
    s = np.asarray(state["example_success"], np.float64)[np.asarray(idx)]
    out = {f"ads_weight[{name}]": float(w[c]) for c, name in enumerate(names)}
    out["ads_boundary"] = float(np.mean((s > 0) & (s < 1)))
    return out


# ---- AdaPrefix


def prefix_init(lengths: np.ndarray, fraction: float) -> np.ndarray:
    """Every example's starting prefix length k: `fraction` of its solution's length (in tokens)."""
    return (np.asarray(lengths, np.float64) * fraction).astype(np.float32)


def assistance(step: int, horizon: int) -> float:
    """1 − t: the share of each k given at `step`, withdrawn linearly to 0 at the horizon."""
    return max(0.0, 1.0 - step / horizon)


def prefix_tokens(k: np.ndarray, step: int, horizon: int) -> np.ndarray:
    """The prefix lengths given at `step`: round(k·(1 − t))."""
    return np.rint(np.asarray(k, np.float64) * assistance(step, horizon)).astype(int)


def prefix_update(
    k: np.ndarray, idx: np.ndarray, success: np.ndarray, lengths: np.ndarray, target: float, gain: float
) -> np.ndarray:
    """The controller: k_e ← clip(k_e + gain·(target − success_e), 0, length_e) for the step's examples."""
    k = np.array(k, np.float64)
    idx = np.asarray(idx)
    k[idx] = np.clip(k[idx] + gain * (target - np.asarray(success, np.float64)), 0.0, np.asarray(lengths)[idx])
    return k.astype(np.float32)


# ---- the trainer's view: each step's batch and the state it checkpoints


class Batch(NamedTuple):
    """One step's training prompts: the examples (with any assisted prefix), their indices in the training split,
    and the prefix tokens each was given (AdaPrefix; 0 without it)."""

    examples: list[Example]
    idx: np.ndarray  # [X] int
    given: np.ndarray  # [X] int


class Curriculum:
    """The training batch of each step and the state of the curriculum methods (`esroll.curriculum`): without them,
    `get_batch`'s fixed order; with ADS, the scheduler's choice; with AdaPrefix, each example's assisted prefix. Its
    state is saved in the checkpoint beside the parameters (key "curriculum")."""

    def __init__(self, cfg: ExperimentConfig, train: list, tokenizer):
        self.cfg, self.c, self.train, self.tokenizer = cfg, cfg.curriculum, train, tokenizer
        self.state: dict[str, np.ndarray] = {}
        if self.c.ads:
            keys = [cluster_key(e, self.c.ads_cluster_key) for e in train]
            self.names = sorted(set(keys))
            self.cluster_of = np.array([self.names.index(k) for k in keys])
            self.state.update(ads_init(self.cluster_of))
        if self.c.prefix:
            self.source_ids = [self._source_ids(e) for e in train]
            self.lengths = np.array([len(ids) for ids in self.source_ids])
            self.state["prefix_k"] = prefix_init(self.lengths, self.c.prefix_init)

    def _source_ids(self, e) -> list[int]:
        text = e.solution if self.c.prefix_source == "solution" else e.target_text
        return self.tokenizer.encode(text, add_special_tokens=False)

    def saved(self) -> dict[str, np.ndarray]:
        """What the checkpoint holds of the curriculum: its state (empty when both methods are off); the trainer
        places it replicated on the mesh, so every process has it."""
        return dict(self.state)

    def restore(self, state: dict) -> None:
        """Continue from `saved()` as a checkpoint restored it (host arrays)."""
        if self.state:
            self.state = {k: np.asarray(v) for k, v in state.items()}

    def batch(self, step: int) -> Batch:
        X, seed = self.cfg.train.prompts_per_step, self.cfg.data.batch_seed
        if self.c.ads:
            idx = ads_select(self.state, self.cluster_of, X, self.c, seed, step)
        else:
            idx = batch_indices(len(self.train), X, seed, step)
        examples = [self.train[i] for i in idx]
        given = np.zeros(len(idx), int)
        if self.c.prefix:
            given = prefix_tokens(self.state["prefix_k"][idx], step, self.c.prefix_horizon)
            examples = [
                dataclasses.replace(e, prefix=self.tokenizer.decode(self.source_ids[i][:n]) if n else "")
                for e, i, n in zip(examples, idx, given)
            ]
        return Batch(examples, np.asarray(idx), np.asarray(given))

    def update(self, step: int, batch: Batch, success: np.ndarray) -> dict[str, float]:
        """Take in the per-prompt success of the step that trained on `batch`; the metrics of what the methods act
        on."""
        out: dict[str, float] = {}
        if self.c.ads:
            updated = ads_update(self.state, self.cluster_of, batch.idx, success, self.c.ads_decay)
            self.state.update(updated)
            out.update(ads_metrics(self.state, batch.idx, self.names, self.c.ads_temperature))
        if self.c.prefix:
            k = prefix_update(
                self.state["prefix_k"], batch.idx, success, self.lengths, self.c.prefix_target, self.c.prefix_gain
            )
            self.state["prefix_k"] = k
            out["prefix_tokens"] = float(batch.given.mean())
            out["prefix_assistance"] = assistance(step, self.c.prefix_horizon)
            out["prefix_k_mean"] = float(k.mean())
            # the spread of the per-example controller states (tokens, before the withdrawal's scaling)
            out.update({f"prefix_k_q{q}": float(v) for q, v in zip((10, 50, 90), np.percentile(k, (10, 50, 90)))})
        return out
