"""Modifications of GRPO's plain step and loss, selected by name in `grpo.variants` and applied in that order.

A variant is an object with hooks; every hook's default (on `Variant`) leaves the step as it is, so a variant
overrides only what it changes:

    on the host, once per training step (numpy):
        init_state(g) -> dict              its running state (fixed-shape arrays, checkpointed with the run)
        token_weight(g, state, sampled)    a per-token factor on the loss's token weights, and metrics
        update_state(g, state, metrics)    its state for the next step, from this step's averaged metrics
    in the loss, once per microbatch (traced, jax.numpy):
        loss_terms(g, terms) -> terms      per-token advantages and clip ranges (`LossTerms`)
        loss_metrics(g, terms) -> dict     metrics of the microbatch; `reduce_metrics` combines them over the
                                           microbatches of a minibatch (default: their mean)

`needs_reference(g)` makes the step keep the initial policy and score it in the loss; `in_loss` says whether the
compiled update depends on the variant (a host-only one is left out of it, so runs that differ only there share one
compilation); `options` is its frozen options dataclass, if any (`grpo.variant_options.<name>.<key>`).

The built-ins, registered below through `register_variant` as a user's own would be (docs/extending.md):
STARE (`Stare`), ACPO (`Acpo`) and the progress advantage (`Progress`). Their reasoning and sources are in
docs/training_loop.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from esroll.config import GRPOConfig, check_fields
from esroll.registry import Registry

Array = Any  # a jax.Array inside the loss, a numpy array on the host


class Sampled(NamedTuple):
    """What a host hook may read of one step's B = X·M sampled rows (prompt-major) after the advantages."""

    logp: np.ndarray  # [B, N] float32: log π_old of each sampled token
    mask: np.ndarray  # [B, N] bool: completion tokens
    advantage: np.ndarray  # [B, N] float32: the estimator's advantage of each token
    rewards: np.ndarray  # [X, M] float: the rewards the advantages came from
    step: int


class LossTerms(NamedTuple):
    """The per-token quantities of one microbatch that the clipped surrogate reads (all [b, N] or scalars)."""

    logp: Array  # log π_θ (differentiated)
    logp_old: Array  # log π_old (no gradient)
    logp_ref: Array | None  # log π_ref of the initial policy (no gradient), None when no variant or β keeps it
    mask: Array  # completion tokens
    advantage: Array  # [b, N]
    eps_low: Array  # clip half-widths: floats, or [b, N]
    eps_high: Array


class Variant:
    """A modification of the plain GRPO step; the hooks' defaults change nothing (see the module docstring).
    `options`: its frozen options dataclass (None: it takes none), read in a hook as `self.options_of(g)`."""

    in_loss: bool = False
    options: type | None = None
    name: str = ""  # the name it is registered under (`register_variant`)

    def options_of(self, g: GRPOConfig) -> Any:
        """This variant's options in `g` (`grpo.variant_options.<name>`; its defaults when `g` sets none)."""
        return VARIANTS.options_of(g.variant_options, self.name)

    def check(self, g: GRPOConfig) -> None:
        """Raise `esroll.config.ConfigError` for settings of `g` this variant cannot work with."""

    def needs_reference(self, g: GRPOConfig) -> bool:
        return False

    def init_state(self, g: GRPOConfig) -> dict[str, np.ndarray]:
        return {}

    def token_weight(self, g: GRPOConfig, state: dict, sampled: Sampled) -> tuple[np.ndarray | None, dict]:
        return None, {}

    def update_state(self, g: GRPOConfig, state: dict, metrics: dict) -> dict:
        return state

    def loss_terms(self, g: GRPOConfig, terms: LossTerms) -> LossTerms:
        return terms

    def loss_metrics(self, g: GRPOConfig, terms: LossTerms) -> dict:
        return {}

    def reduce_metrics(self, g: GRPOConfig, metrics_U: dict) -> dict:
        return {k: v.mean() for k, v in metrics_U.items()}


VARIANTS: Registry[Variant] = Registry("GRPO variant", "grpo.variants", options_key="grpo.variant_options")


def register_variant(name: str, variant: Variant | None = None, *, replace: bool = False):
    """Register `variant` (a `Variant` instance) as the GRPO variant `grpo.variants` names `name`, with its options
    (`variant.options`: keys `grpo.variant_options.<name>.<field>`). Its running state is checkpointed under its name
    (`GRPOState.host["variants"][name]`). A name already registered is refused unless `replace` is set. Returns the
    variant; without it, a class decorator that registers an instance of the class it decorates."""
    if variant is None:
        return lambda cls: (register_variant(name, cls(), replace=replace), cls)[1]
    VARIANTS.check_new(name, replace=replace)
    if not isinstance(variant, Variant):
        raise TypeError(f"GRPO variant {name!r}: expected a Variant instance, got {variant!r}")
    variant.name = name
    return VARIANTS.add(name, variant, options=variant.options, replace=replace)


def active(g: GRPOConfig) -> list[tuple[str, Variant]]:
    """The variants `g` selects, in order."""
    return [(name, VARIANTS[name]) for name in g.variants]


# ---- STARE: entropy-critical tokens reweighted behind an entropy gate


def stare_token_weights(
    token_logp_BxN: np.ndarray, mask_BxN: np.ndarray, advantage_BxN: np.ndarray, quantile: float, alpha: float
) -> tuple[np.ndarray, np.ndarray]:
    """STARE's token weights [B, N] and the tokens they select: the completion tokens whose surprisal −log π is above
    the batch's `quantile`-quantile (over all of its completion tokens) are entropy-critical; their advantage is
    scaled by 1 + alpha·sign(A): raised where the update would raise the entropy (a surprising token that did well),
    lowered where it would lower it (a surprising token that did badly). Every other token weighs exactly 1.
    `advantage_BxN` may be [B] (one advantage per completion)."""
    mask = np.asarray(mask_BxN, bool)
    surprisal = -np.asarray(token_logp_BxN, np.float64)
    if not mask.any():
        return np.ones(mask.shape, np.float32), np.zeros(mask.shape, bool)
    threshold = np.quantile(surprisal[mask], quantile)
    selected = mask & (surprisal > threshold)
    adv = np.asarray(advantage_BxN, np.float64)
    factor = 1.0 + alpha * np.sign(adv if adv.ndim == 2 else adv[:, None])
    return np.where(selected, factor, 1.0).astype(np.float32), selected


def stare_gate(is_open: bool, entropy: float, low: float, high: float) -> bool:
    """STARE's closed-loop gate with hysteresis: opens when the measured policy entropy falls to `low` or below,
    closes when it rises to `high` or above, and otherwise keeps its state."""
    if entropy <= low:
        return True
    if entropy >= high:
        return False
    return is_open


@dataclasses.dataclass(frozen=True)
class StareOptions:
    """STARE's options (`grpo.variant_options.stare.*`; on when "stare" is in `grpo.variants`): while the
    gate is open, the completion tokens whose surprisal −log π_old is above the batch's `quantile`-quantile get their
    advantage scaled by 1 + alpha·sign(A) (as a token weight, so with β > 0 it scales their KL term too). The gate
    starts closed, opens when the previous step's measured policy entropy is ≤ entropy_low and closes when it is
    ≥ entropy_high."""

    quantile: float = 0.8
    alpha: float = 0.5
    entropy_low: float = 0.3
    entropy_high: float = 0.6

    def __post_init__(self):
        checks = [
            ("quantile", 0 < self.quantile < 1, "in (0, 1)"),
            ("alpha", 0 <= self.alpha <= 1, "in [0, 1]"),
            ("entropy_low", self.entropy_low >= 0, ">= 0"),
            ("entropy_high", self.entropy_high > self.entropy_low, "> entropy_low"),
        ]
        check_fields(self, checks, "StareOptions")


class Stare(Variant):
    """STARE (`StareOptions`): host-side token weights while the gate (state "open") is open; the gate
    reads the step's measured policy entropy and acts on the next step."""

    options = StareOptions

    def init_state(self, g):
        return {"open": np.zeros((), np.float32)}

    def token_weight(self, g, state, sampled):
        is_open = bool(state["open"])
        metrics = {"stare_open": float(is_open)}
        if not is_open:
            return None, metrics
        o = self.options_of(g)
        weight, selected = stare_token_weights(sampled.logp, sampled.mask, sampled.advantage, o.quantile, o.alpha)
        metrics["stare_tokens"] = selected.sum() / max(sampled.mask.sum(), 1)
        return weight, metrics

    def update_state(self, g, state, metrics):
        o = self.options_of(g)
        is_open = stare_gate(bool(state["open"]), float(metrics["entropy"]), o.entropy_low, o.entropy_high)
        return {"open": np.float32(is_open)}


# ---- ACPO: a clip range per token group from the spread of its ratios


def acpo_bounds(
    ratio_BxN: Array,
    logp_old_BxN: Array,
    mask_BxN: Array,
    edges: tuple[float, ...],
    scale: float,
    low: float,
    high: float,
) -> tuple[Array, Array]:
    """ACPO's clip half-widths: (ε per token [B, N], ε per group [Y]). Tokens are grouped by their old probability
    π_old at `edges` (Y = len(edges) + 1 groups, lowest probabilities first); a group's ε_k is scale × the sample std
    of its tokens' ratios, clipped to [low, high] (a group with fewer than 2 tokens gets `low`). No gradient flows
    through the bounds."""
    ratio = jax.lax.stop_gradient(ratio_BxN)
    mask = jnp.asarray(mask_BxN, bool)
    group_BxN = jnp.searchsorted(jnp.asarray(edges, jnp.float32), jnp.exp(logp_old_BxN), side="right")
    Y = len(edges) + 1
    member_YxBxN = (group_BxN[None] == jnp.arange(Y)[:, None, None]) & mask[None]
    n_Y = member_YxBxN.sum((1, 2))
    mean_Y = jnp.where(member_YxBxN, ratio[None], 0.0).sum((1, 2)) / jnp.maximum(n_Y, 1)
    var_Y = jnp.where(member_YxBxN, (ratio[None] - mean_Y[:, None, None]) ** 2, 0.0).sum((1, 2)) / jnp.maximum(
        n_Y - 1, 1
    )
    eps_Y = jnp.where(n_Y >= 2, jnp.clip(scale * jnp.sqrt(var_Y), low, high), low)
    return eps_Y[group_BxN], eps_Y


@dataclasses.dataclass(frozen=True)
class AcpoOptions:
    """ACPO's options (`grpo.variant_options.acpo.*`; on when "acpo" is in `grpo.variants`): the clip
    range of each token is 1 ± ε_k of its group k (tokens grouped by π_old at `edges`),
    ε_k = clip(scale·std_k(ρ), min, max), the ratios' spread in that group of the microbatch; `grpo.epsilon_low` /
    `epsilon_high` are then unused. Ratios leave 1 only off-policy (μ ≥ 2 or several minibatches), so on-policy every
    ε_k is `min` and nothing changes."""

    edges: tuple[float, ...] = (0.1, 0.5, 0.9)
    scale: float = 2.0
    min: float = 0.1
    max: float = 0.4

    def __post_init__(self):
        checks = [
            (
                "edges",
                all(0 < e < 1 for e in self.edges) and list(self.edges) == sorted(set(self.edges)),
                "increasing probabilities in (0, 1)",
            ),
            ("scale", self.scale > 0, "> 0"),
            ("min", 0 < self.min <= self.max, "in (0, max]"),
            ("max", self.max < 1, "< 1 (the lower bound 1 − ε must stay positive)"),
        ]
        check_fields(self, checks, "AcpoOptions")


class Acpo(Variant):
    """ACPO (`AcpoOptions`): each token's clip range from its π_old group's ratio spread in the
    microbatch, computed from the ratio to π_old (exactly 1 on-policy); logged as acpo_eps_<k>."""

    in_loss = True
    options = AcpoOptions

    def _bounds(self, g, t: LossTerms):
        o = self.options_of(g)
        ratio = jnp.exp(t.logp - t.logp_old)
        return acpo_bounds(ratio, t.logp_old, t.mask, o.edges, o.scale, o.min, o.max)

    def loss_terms(self, g, terms):
        eps_BxN, _ = self._bounds(g, terms)
        return terms._replace(eps_low=eps_BxN, eps_high=eps_BxN)

    def loss_metrics(self, g, terms):
        _, eps_Y = self._bounds(g, terms)
        return {f"acpo_eps_{k}": eps_Y[k] for k in range(eps_Y.shape[0])}


# ---- the progress advantage: + η·(log π_θ − log π_ref) per token


PROGRESS_BUCKETS = 8


def progress_by_position(sum_N: Array, tokens_N: Array, buckets: int = PROGRESS_BUCKETS) -> dict[str, Array]:
    """Where training has moved the policy along the completion: `progress_pos_k` is the mean of log π_θ − log π_ref
    over the completion tokens at positions [k·N/K, (k+1)·N/K) (K = min(buckets, N) equal spans of the N completion
    positions; NaN where no completion reached). From per-position sums and token counts over a step's rows."""
    N = sum_N.shape[0]
    edges = np.linspace(0, N, min(buckets, N) + 1).round().astype(int)
    out = {}
    for k, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        n = tokens_N[lo:hi].sum()
        out[f"progress_pos_{k}"] = jnp.where(n > 0, sum_N[lo:hi].sum() / jnp.maximum(n, 1.0), jnp.nan)
    return out


@dataclasses.dataclass(frozen=True)
class ProgressOptions:
    """The progress advantage's options (`grpo.variant_options.progress.*`; on when "progress" is in
    `grpo.variants`): every token's advantage gets + coef·(log π_θ − log π_ref), no gradient through
    it, π_ref the initial policy (kept for it): zero at the reference, so it adds to the advantage and never scales
    it."""

    coef: float = 0.1

    def __post_init__(self):
        check_fields(self, [("coef", self.coef > 0, "> 0")], "ProgressOptions")


class Progress(Variant):
    """The progress advantage (`ProgressOptions`): keeps the initial policy and adds
    coef·(log π_θ − log π_ref) to every token's advantage (no gradient through it). Logs `progress_mean`, the token
    mean of log π_θ − log π_ref, and its means by completion position (`progress_by_position`)."""

    in_loss = True
    options = ProgressOptions

    def needs_reference(self, g):
        return True

    def loss_terms(self, g, terms):
        drift = jax.lax.stop_gradient(terms.logp - terms.logp_ref)
        return terms._replace(advantage=terms.advantage + self.options_of(g).coef * drift)

    def loss_metrics(self, g, terms):
        drift_BxN = jnp.where(terms.mask, jax.lax.stop_gradient(terms.logp - terms.logp_ref), 0.0)
        tokens_N = jnp.asarray(terms.mask, jnp.float32).sum(0)
        return {"progress_pos_sum": drift_BxN.sum(0), "progress_pos_tokens": tokens_N}

    def reduce_metrics(self, g, metrics_U):
        sum_N, tokens_N = metrics_U["progress_pos_sum"].sum(0), metrics_U["progress_pos_tokens"].sum(0)
        return {
            "progress_mean": sum_N.sum() / jnp.maximum(tokens_N.sum(), 1.0),
            **progress_by_position(sum_N, tokens_N),
        }


register_variant("stare", Stare())
register_variant("acpo", Acpo())
register_variant("progress", Progress())
