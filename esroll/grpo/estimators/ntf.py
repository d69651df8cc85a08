"""Negative token filtering: a batch-level baseline (one rollout per prompt is enough) and no penalty on the tokens of a
negative sample that the policy already found likely. What it computes, and what its source leaves open:
docs/advantages.md."""

from __future__ import annotations

import dataclasses

import numpy as np

from esroll.config import check_fields
from esroll.grpo.advantages import Estimate, Group, register_advantage, valid_rewards


@dataclasses.dataclass(frozen=True)
class NTFOptions:
    """Negative token filtering's options (`grpo.adv.ntf.*`). baseline: batch | ema (the EMA of earlier batches' mean
    reward, decay `decay`); normalize: divide by the batch's reward std; filter_prob: a negative sample's tokens
    sampled with probability ≥ this are not penalised (1: nothing filtered)."""

    baseline: str = "batch"
    decay: float = 0.9
    normalize: bool = True
    filter_prob: float = 0.5

    def __post_init__(self):
        checks = [
            ("baseline", self.baseline in ("batch", "ema"), "batch or ema"),
            ("decay", 0 <= self.decay < 1, "in [0, 1)"),
            ("filter_prob", 0 < self.filter_prob <= 1, "in (0, 1]"),
        ]
        check_fields(self, checks, "NTFOptions")


def ntf_init(o: NTFOptions) -> dict:
    """The EMA of earlier batches' mean reward and its weight."""
    return {"mean": np.zeros((), np.float32), "weight": np.zeros((), np.float32)}


def ntf(g: Group, o: NTFOptions, state: dict) -> Estimate:
    """Negative token filtering for single-rollout training (any group size, 1 included).

    Baseline b: the batch's mean reward (`baseline` = batch) or the EMA of earlier batches' means (ema; the batch
    mean while there is no history); A = (r − b), divided by the batch's reward std (+1e-4) with `normalize`. The
    tokens of a negative sample (A < 0) that the policy gave probability ≥ `filter_prob` get token weight 0: in a
    group they would be shared with its positive samples and cancel; alone they would be penalised for being right.
    (The probabilities are the policy's at temperature 1, as `generate` scores them; a filtered token keeps its place
    in its sequence's length under seq_mean_token_mean, so the other tokens are not reweighted. With the EMA
    baseline, the normalisation is still the batch's own std.)"""
    r, valid = valid_rewards(g)
    n = max(int(valid.sum()), 1)
    batch_mean = r.sum() / n
    W, m = float(state["weight"]), float(state["mean"])
    b = m if (o.baseline == "ema" and W > 0) else batch_mean
    adv = r - b
    if o.normalize:
        adv = adv / (np.sqrt(np.where(valid, (r - batch_mean) ** 2, 0.0).sum() / n) + 1e-4)
    adv = np.where(valid, adv, 0.0)
    weight, metrics = None, {"ntf_baseline": b}
    if g.token_logp is not None:
        mask = np.ones(np.shape(g.token_logp), bool) if g.token_mask is None else np.asarray(g.token_mask, bool)
        likely = np.asarray(g.token_logp, np.float64) >= np.log(o.filter_prob)
        drop = (adv < 0)[:, :, None] & likely & mask
        weight = np.where(drop, 0.0, 1.0).astype(np.float32)
        negative_tokens = ((adv < 0)[:, :, None] & mask).sum()
        metrics["ntf_filtered_fraction"] = float(drop.sum() / max(negative_tokens, 1))
    d = o.decay
    W_new = d * W + 1.0
    state = {"mean": np.float32((d * W * m + batch_mean) / W_new), "weight": np.float32(W_new)}
    return Estimate(adv.astype(np.float32), weight, state, metrics)


register_advantage("ntf", ntf, ntf_init, options=NTFOptions, needs=("logprobs",), single_rollout=True)
