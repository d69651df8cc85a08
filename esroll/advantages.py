"""Fitness shaping (ES) and group advantages (GRPO): one signature, shared by both estimators.

Every function maps rewards [X groups, M members] (or [members], treated as one group) to an array of the same shape:

    fn(rewards, valid=None) -> shaped

`valid` (bool, same shape) marks the entries that take part: statistics are computed over valid entries of each
group only, and invalid entries come out as 0 whatever their value (NaN included), so a non-finite reward never
leaks into the others. std is the population standard deviation (ddof 0) and std₁ the sample one (ddof 1, taken as
0 for a group of one). A group with fewer than 2 valid entries has nothing to compare: every shaping but `raw` gives
it 0.

    raw                  r                               (ES: keeps the estimators unbiased)
    zscore               (r − mean) / (std + 1e-8)       (ES; evosax divides by √(var + 1e-8) instead)
    centered_ranks       rank / (n − 1) − 1/2, in [−1/2, 1/2], ties share their mean rank (ES; OpenAI-ES, evosax)
    grpo                 (r − mean) / (std₁ + 1e-4)      (GRPO as TRL computes it: scale_rewards="group")
    grpo_population_std  (r − mean) / (std + 1e-4)       (GRPO with the population std: √(M/(M−1)) × grpo)
    dr_grpo              r − mean                        (Dr. GRPO: no std division)
    rloo                 r_i − mean_{j≠i} r_j            (RLOO: the policy-gradient twin of LOO-ROLL)

The group-advantage estimators of GRPO (`ESTIMATORS`, `estimate`) read more than the rewards: the step (schedules),
the completions' log-probabilities, a cluster key per prompt, the parsed answers (label-free rewards) and a small
running state that the trainer checkpoints. Each is a pure function

    fn(group: Group, options: AdvantageConfig, state) -> Estimate(advantage [X, M], token_weight [X, M, N] | None,
                                                                  state, metrics)

(numpy, on the host, float64 inside). Every shaping above is one as well (no state, no token weights). What each
estimator computes, and what its source leaves open, is written down in docs/advantages.md:

    agrae     A-GRAE: GRPO advantages, positive ones scaled by a scheduled factor, groups weighted by a difficulty
              focus that moves from easy to hard over `horizon` steps
    bv_blend  BV-Blend: each group standardised by a blend of its own mean / variance and its cluster's EMA history,
              blended by a confidence weight from the history's standard error
    gmae      GMAE: a response's centred advantage averaged over the group contexts (subsets of the others) it could
              have been sampled into; closed form k/(k+1)·RLOO when rewards do not depend on the context
    maxpo     MaxPO: the unbiased max@K (pass@K on 0/1 rewards) policy-gradient weights with the leave-two-out
              baseline, exactly centred in each group
    lampo     LamPO: pairwise reward gaps weighted by a confidence from the pair's log-probability difference
    ntf       negative token filtering: a batch-level baseline (one rollout per prompt is enough) and no penalty on
              the tokens of a negative sample that the policy already found likely
    ddrl      DDRL (label-free only): fixed ±a advantages from the group's answer consistency, ambiguous groups
              excluded, positives and negatives balanced over the batch

Both registries are open: `register_shaping(name, fn)` adds a shaping (and the estimator of the same name),
`register_advantage(name, fn, init)` an estimator. The built-ins are registered through them as a user's own would
be (docs/extending.md).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from esroll.config import AdvantageConfig
from esroll.data import Example, cluster_key
from esroll.registry import Registry

Array = jax.Array
Shaping = Callable[..., Array]


def _grouped(fn: Callable[[Array, Array], Array]) -> Shaping:
    """Lift fn(r_XxM, valid_XxM) to the public signature: 1-D input, default mask, invalid entries zeroed."""

    def shaped(rewards: Array, valid: Array | None = None) -> Array:
        r = jnp.asarray(rewards, jnp.float32)
        valid = jnp.ones(r.shape, bool) if valid is None else jnp.asarray(valid, bool)
        valid = valid & jnp.isfinite(r)
        squeeze = r.ndim == 1
        r_XxM, valid_XxM = (r[None], valid[None]) if squeeze else (r, valid)
        out = jnp.where(valid_XxM, fn(jnp.where(valid_XxM, r_XxM, 0.0), valid_XxM), 0.0)
        return out[0] if squeeze else out

    shaped.__name__, shaped.__doc__ = fn.__name__, fn.__doc__
    return shaped


# ---- the registries: what `es.shaping`, `es.prompt_shaping` and `grpo.advantage` name

Estimator = Callable[..., "Estimate"]  # fn(group: Group, options: AdvantageConfig, state: dict | None) -> Estimate

SHAPINGS: Registry[Shaping] = Registry("fitness shaping", "es.shaping")  # name -> the lifted shaping
# name -> (estimator, initial state or None); every shaping is one too, under its own name
ESTIMATORS: Registry[tuple[Estimator, Callable[[AdvantageConfig], Any] | None]] = Registry(
    "advantage estimator", "grpo.advantage"
)
SINGLE_ROLLOUT: set[str] = set()  # estimators that work with one completion per prompt
# name -> the fields of `grpo.adv` (AdvantageConfig) the estimator reads; None: not declared (taken as all of them)
OPTIONS: dict[str, tuple[str, ...] | None] = {}
LABEL_FREE_ONLY: set[str] = set()  # estimators that need the parsed answers (data.reward = "majority")


def register_shaping(name: str, fn: Callable[[Array, Array], Array] | None = None, *, replace: bool = False):
    """Register the fitness shaping `es.shaping = name` / `es.prompt_shaping = name` selects; it is also the
    stateless group-advantage estimator `grpo.advantage = name` (as every built-in shaping is).

    fn(r_XxM, valid_XxM) -> [X, M]: rewards as float32 [X groups, M members] whose invalid entries (masked out, or
    non-finite) are already 0, and the bool mask of the valid ones; compute each group's statistics over its valid
    entries only. It is registered lifted to the public signature of this module's shapings (1-D input, default mask,
    invalid entries of the result set to 0), which is what `get(name)` returns, and what this function returns.
    Write it with jax.numpy: `es.shaping` is applied inside the jitted ES update, `es.prompt_shaping` and GRPO on
    host arrays.

    A name already registered (as a shaping or an estimator) is refused unless `replace` is set. Without `fn`, a
    decorator that registers what it decorates and returns it lifted."""
    if fn is None:
        return lambda f: register_shaping(name, f, replace=replace)
    _check_new(name, fn, replace, SHAPINGS)
    shaped = _grouped(fn)
    SHAPINGS[name] = shaped
    _set_estimator(name, _from_shaping(shaped), None, single_rollout=False, label_free_only=False, options=())
    return shaped


def register_advantage(
    name: str,
    fn: Estimator | None = None,
    init: Callable[[AdvantageConfig], dict] | None = None,
    *,
    single_rollout: bool = False,
    label_free_only: bool = False,
    options: Iterable[str] | None = None,
    replace: bool = False,
):
    """Register the group-advantage estimator `grpo.advantage = name` selects.

    fn(group: Group, options: AdvantageConfig, state: dict | None) -> Estimate: one step's X prompts × M completions
    (`Group`: rewards [X, M], the step, the seed, the completions' log-probabilities, the parsed answers in the
    label-free mode) to advantages [X, M] (0 on invalid entries), optional per-token loss weights [X, M, N], the
    running state after the step and metrics to log. It runs on the host, in numpy, once per step; `options` is the
    config's `grpo.adv` section. init(options) -> dict: the running state of the first step, a dict of numpy arrays
    whose shapes never change (it is checkpointed with the run); None (the default): the estimator keeps none and
    is passed state None. single_rollout: it works with one completion per prompt (grpo.group_size 1 is then
    allowed); label_free_only: it reads `group.answers` and needs data.reward = "majority"; options: the fields of
    `grpo.adv` it reads (the others are refused when set on the command line with this estimator; None: all of them).

    A name already registered is refused unless `replace` is set. Returns `fn`; without `fn`, a decorator."""
    if fn is None:
        return lambda f: register_advantage(
            name,
            f,
            init,
            single_rollout=single_rollout,
            label_free_only=label_free_only,
            options=options,
            replace=replace,
        )
    _check_new(name, fn, replace)
    if init is not None and not callable(init):
        raise TypeError(f"advantage estimator {name!r}: init must be callable, got {init!r}")
    if options is not None:
        options = tuple(options)
        known = [f.name for f in dataclasses.fields(AdvantageConfig)]
        unknown = [o for o in options if o not in known]
        if unknown:
            raise ValueError(f"advantage estimator {name!r}: option {unknown[0]!r} is not a field of grpo.adv")
    SHAPINGS.pop(name, None)  # a replaced shaping of that name is no longer one
    _set_estimator(name, fn, init, single_rollout=single_rollout, label_free_only=label_free_only, options=options)
    return fn


def _check_new(name: str, fn, replace: bool, *also_in: dict) -> None:
    """Shapings and estimators share one namespace: every shaping is also the estimator of its name."""
    ESTIMATORS.check_new(name, replace=replace, also_in=also_in)
    if not callable(fn):
        raise TypeError(f"{name!r}: {fn!r} is not callable")


def _set_estimator(name: str, fn: Estimator, init, *, single_rollout: bool, label_free_only: bool, options) -> None:
    ESTIMATORS[name] = (fn, init)
    OPTIONS[name] = options
    for flag, names in ((single_rollout, SINGLE_ROLLOUT), (label_free_only, LABEL_FREE_ONLY)):
        if flag:
            names.add(name)
        else:
            names.discard(name)


def _from_shaping(shaping: Shaping) -> Estimator:
    def estimate(g: Group, o: AdvantageConfig, state=None) -> Estimate:
        return Estimate(np.asarray(shaping(g.rewards, g.valid), np.float32))

    estimate.__name__, estimate.__doc__ = shaping.__name__, shaping.__doc__
    return estimate


def _count(valid_XxM: Array) -> Array:
    return valid_XxM.sum(-1, keepdims=True)


def _mean(r_XxM: Array, valid_XxM: Array) -> Array:
    return r_XxM.sum(-1, keepdims=True) / jnp.maximum(_count(valid_XxM), 1)


def _std(r_XxM: Array, valid_XxM: Array, ddof: int = 0) -> Array:
    centered = jnp.where(valid_XxM, r_XxM - _mean(r_XxM, valid_XxM), 0.0)
    return jnp.sqrt((centered**2).sum(-1, keepdims=True) / jnp.maximum(_count(valid_XxM) - ddof, 1))


@register_shaping("raw")
def raw(r_XxM: Array, valid_XxM: Array) -> Array:
    """The rewards themselves."""
    return r_XxM


@register_shaping("zscore")
def zscore(r_XxM: Array, valid_XxM: Array) -> Array:
    """(r − mean) / (std + 1e-8): scale-free; a group of equal rewards gives zeros."""
    return (r_XxM - _mean(r_XxM, valid_XxM)) / (_std(r_XxM, valid_XxM) + 1e-8)


@register_shaping("centered_ranks")
def centered_ranks(r_XxM: Array, valid_XxM: Array) -> Array:
    """Ranks scaled to [−1/2, 1/2]; robust to outliers; tied rewards get equal values (so they cancel); 0 in a
    group of fewer than 2 valid entries."""
    both = valid_XxM[:, :, None] & valid_XxM[:, None, :]
    below = ((r_XxM[:, None, :] < r_XxM[:, :, None]) & both).sum(-1)
    ties = ((r_XxM[:, None, :] == r_XxM[:, :, None]) & both).sum(-1)
    rank = below + (ties - 1) / 2  # mean rank among equal rewards, 0-based
    n = _count(valid_XxM)
    return jnp.where(n >= 2, rank / jnp.maximum(n - 1, 1) - 0.5, 0.0)  # a lone entry has no rank to speak of


@register_shaping("grpo")
def grpo(r_XxM: Array, valid_XxM: Array) -> Array:
    """(r − mean_g) / (std₁_g + 1e-4), the GRPO group advantage as TRL computes it (sample std, eps 1e-4)."""
    return (r_XxM - _mean(r_XxM, valid_XxM)) / (_std(r_XxM, valid_XxM, ddof=1) + 1e-4)


@register_shaping("grpo_population_std")
def grpo_population_std(r_XxM: Array, valid_XxM: Array) -> Array:
    """(r − mean_g) / (std_g + 1e-4) with the population std (ddof 0), as some GRPO implementations divide."""
    return (r_XxM - _mean(r_XxM, valid_XxM)) / (_std(r_XxM, valid_XxM) + 1e-4)


@register_shaping("dr_grpo")
def dr_grpo(r_XxM: Array, valid_XxM: Array) -> Array:
    """r − mean_g (Dr. GRPO drops the std division, which biases towards easy and hard groups)."""
    return r_XxM - _mean(r_XxM, valid_XxM)


@register_shaping("rloo")
def rloo(r_XxM: Array, valid_XxM: Array) -> Array:
    """r_i − mean_{j≠i} r_j: the baseline excludes the sample itself, so it is independent of it; 0 in a group of
    fewer than 2 valid entries (no other sample to form a baseline from)."""
    n = _count(valid_XxM)
    others = (r_XxM.sum(-1, keepdims=True) - r_XxM) / jnp.maximum(n - 1, 1)
    return jnp.where(n >= 2, r_XxM - others, 0.0)


def get(name: str) -> Shaping:
    """The shaping / advantage function called `name`."""
    if name not in SHAPINGS:
        raise ValueError(f"unknown fitness shaping / advantage {name!r}; known: {', '.join(SHAPINGS)}")
    return SHAPINGS[name]


# ---- group-advantage estimators (GRPO): rewards plus what a method reads, and a small running state


class Group(NamedTuple):
    """What an estimator may read about one step's X prompts × M completions (rows prompt-major)."""

    rewards: np.ndarray  # [X, M] float
    step: int = 0  # the optimizer step this batch is for (schedules are functions of it)
    seed: int = 0  # the run's seed (estimators that subsample draw from (seed, step))
    valid: np.ndarray | None = None  # [X, M] bool; None: all valid (non-finite rewards are never valid)
    seq_logp: np.ndarray | None = None  # [X, M] mean log π_old per completion token
    token_logp: np.ndarray | None = None  # [X, M, N] log π_old of each sampled token
    token_mask: np.ndarray | None = None  # [X, M, N] bool: completion tokens
    cluster: np.ndarray | None = None  # [X] int in [0, bv_clusters): the prompt's cluster; None: from `examples`
    answers: np.ndarray | None = None  # [X, M] int64 parsed-answer ids (`answer_id`), -1 for no answer
    examples: list[Example] | None = None  # the X prompts' examples (their task, difficulty, meta)


class Estimate(NamedTuple):
    advantage: np.ndarray  # [X, M] float32; 0 on invalid entries
    token_weight: np.ndarray | None = None  # [X, M, N]: multiplies the loss's token weights (None: all 1)
    state: dict | None = None  # the running state after this step (None: the estimator has none)
    metrics: dict | None = None  # logged (None: nothing)


def _valid(g: Group) -> tuple[np.ndarray, np.ndarray]:
    r = np.asarray(g.rewards, np.float64)
    valid = np.ones(r.shape, bool) if g.valid is None else np.asarray(g.valid, bool)
    valid = valid & np.isfinite(r)
    return np.where(valid, r, 0.0), valid


def _progress(step: int, horizon: int) -> float:
    """t in [0, 1]: how far the schedules over `horizon` steps have gone (0 when there is no horizon)."""
    return min(step / horizon, 1.0) if horizon > 0 else 0.0


def agrae(g: Group, o: AdvantageConfig, state=None) -> Estimate:
    """A-GRAE: GRPO's advantage with positive entries scaled by β_t and each group weighted by its difficulty focus.

    β_t runs linearly from `agrae_positive` to `agrae_positive_final` over `horizon` steps; a group of success rate p
    (its mean reward, clipped to [0, 1]) is weighted 1 + κ·(1 − 2t)·(2p − 1): at t = 0 easy groups weigh up to 1 + κ
    and hard ones down to 1 − κ, at t = 1/2 all weigh 1, at t = 1 the other way round. With β = 1 and κ = 0 it is
    `grpo` exactly."""
    r, valid = _valid(g)
    t = _progress(g.step, o.horizon)
    beta = o.agrae_positive + (o.agrae_positive_final - o.agrae_positive) * t
    base = np.asarray(grpo(r, valid), np.float64)
    n = np.maximum(valid.sum(1), 1)
    p = np.clip(r.sum(1) / n, 0.0, 1.0)
    weight = 1.0 + o.agrae_focus * (1.0 - 2.0 * t) * (2.0 * p - 1.0)
    adv = np.where(base > 0, beta * base, base) * weight[:, None]
    return Estimate(np.where(valid, adv, 0.0).astype(np.float32), metrics={"agrae_positive": beta, "agrae_t": t})


def bv_blend_init(o: AdvantageConfig) -> dict:
    """BV-Blend's history: per cluster, the EMA weight (effective count) and the EMA first and second moments."""
    return {k: np.zeros(o.bv_clusters, np.float32) for k in ("weight", "mean", "sq")}


def bv_blend(g: Group, o: AdvantageConfig, state: dict) -> Estimate:
    """BV-Blend: standardise each group by a blend of its own statistics and its cluster's history (before this step).

    History of cluster c: EMA weight W, mean μ_h, variance v_h. Its standard error is √((v_h + prior)/W) (infinite
    without history); the confidence λ = bv_blend_max / (1 + (SEM / bv_sem)²). The group's baseline and variance are
    those of the mixture (1 − λ)·group + λ·history: μ = (1 − λ)μ_g + λμ_h,
    σ² = (1 − λ)σ_g² + λv_h + λ(1 − λ)(μ_g − μ_h)², and A = (r − μ) / (σ + 1e-4). An all-equal group gets λ(μ_g − μ_h) / σ, at most √(λ/(1 − λ)) in size: non-zero
    exactly when history says the group is unusual. Then the history takes in this step's rewards."""
    if g.cluster is None and g.examples is None:
        raise ValueError("bv_blend needs a cluster id per prompt (Group.cluster) or the prompts (Group.examples)")
    r, valid = _valid(g)
    if g.cluster is None:  # the prompts' cluster keys (options.cluster_key) hashed into the table
        c = np.array([cluster_id(cluster_key(e, o.cluster_key), o.bv_clusters) for e in g.examples])
    else:
        c = np.asarray(g.cluster, int)
    W, mu_h, sq_h = (np.asarray(state[k], np.float64)[c] for k in ("weight", "mean", "sq"))
    var_h = np.maximum(sq_h - mu_h**2, 0.0)
    n = np.maximum(valid.sum(1), 1)
    mu_g = r.sum(1) / n
    var_g = np.where(valid, (r - mu_g[:, None]) ** 2, 0.0).sum(1) / n
    with np.errstate(divide="ignore"):
        sem = np.where(W > 0, np.sqrt((var_h + o.bv_prior_var) / np.maximum(W, 1e-30)), np.inf)
    lam = np.where(W > 0, o.bv_blend_max / (1.0 + (sem / o.bv_sem) ** 2), 0.0)
    mu = (1 - lam) * mu_g + lam * mu_h
    var = (1 - lam) * var_g + lam * var_h + lam * (1 - lam) * (mu_g - mu_h) ** 2
    adv = (r - mu[:, None]) / (np.sqrt(var)[:, None] + 1e-4)
    # The history takes in this step: W' = d·W + n, m' = (d·W·m + Σr) / W' for both moments, per cluster.
    new = {k: np.asarray(v, np.float64).copy() for k, v in state.items()}
    d = o.bv_decay
    counts = np.zeros_like(new["weight"])
    sums, sqs = np.zeros_like(counts), np.zeros_like(counts)
    np.add.at(counts, c, valid.sum(1))
    np.add.at(sums, c, r.sum(1))
    np.add.at(sqs, c, (r**2).sum(1))
    seen = counts > 0
    w_new = np.where(seen, d * new["weight"] + counts, new["weight"])
    for k, total in (("mean", sums), ("sq", sqs)):
        new[k] = np.where(seen, (d * new["weight"] * new[k] + total) / np.maximum(w_new, 1e-30), new[k])
    new["weight"] = w_new
    high, low = np.where(valid, r, -np.inf).max(1), np.where(valid, r, np.inf).min(1)
    equal = high <= low
    metrics = {
        "bv_blend_weight": float(lam.mean()),
        "bv_equal_groups_with_signal": float(np.mean(equal & np.any(np.abs(adv) > 1e-6, axis=1))),
    }
    state = {k: v.astype(np.float32) for k, v in new.items()}
    return Estimate(np.where(valid, adv, 0.0).astype(np.float32), None, state, metrics)


def majority_rewards(answers: np.ndarray) -> np.ndarray:
    """The label-free reward: 1 where a response's answer is a modal answer of its row (ties: every tied answer),
    0 elsewhere and for no answer (-1). answers [X, M] int -> [X, M] float32.

    A response's reward depends on the other responses of its row. In ES (`esroll.es_train.member_fitness`) a row
    holds every member's answers to one prompt, so member i's fitness depends on the other members' perturbations
    and theirs on member i's: LOO-ROLL's leave-one-out baseline is then not independent of member i's direction, and
    neither ES estimator is unbiased for the population field (docs/theory.md)."""
    a = np.asarray(answers)
    same = (a[:, :, None] == a[:, None, :]) & (a[:, None, :] >= 0)
    counts = same.sum(-1)  # how many responses of the row share each response's answer
    top = counts.max(1, keepdims=True)
    return ((counts == top) & (a >= 0) & (top > 0)).astype(np.float32)


def gmae_contexts(M: int, k: int, i: int, max_contexts: int, rng: np.random.Generator) -> list[tuple[int, ...]]:
    """The groups T = {i} ∪ S, S a k-subset of the other M − 1 responses: all of them, or a uniform sample of
    `max_contexts` of them when there are more."""
    others = [j for j in range(M) if j != i]
    if math.comb(M - 1, k) <= max_contexts:
        subsets = list(itertools.combinations(others, k))
    else:
        subsets = [tuple(sorted(rng.choice(others, k, replace=False))) for _ in range(max_contexts)]
    return [tuple(sorted((i, *s))) for s in subsets]


def gmae_enumerate(
    M: int,
    k: int,
    context_reward: Callable[[tuple[int, ...]], np.ndarray],
    max_contexts: int = 256,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """GMAE of one group by enumeration: for each response i, the mean over its contexts T of
    r_i(T) − mean_{j∈T} r_j(T), with `context_reward(T)` the rewards of T's members when T is the group."""
    rng = rng or np.random.default_rng(0)
    out = np.zeros(M)
    for i in range(M):
        total = 0.0
        contexts = gmae_contexts(M, k, i, max_contexts, rng)
        for T in contexts:
            rT = np.asarray(context_reward(T), np.float64)
            total += rT[T.index(i)] - rT.mean()
        out[i] = total / len(contexts)
    return out


def gmae(g: Group, o: AdvantageConfig, state=None) -> Estimate:
    """GMAE: a response's advantage in expectation over the group contexts it could have been sampled into.

    A context is {i} ∪ S, S a uniform k-subset of the other responses (k = gmae_context, default M // 2); the
    advantage in a context is Dr. GRPO's r_i(T) − mean_T r(T). When rewards do not depend on the context (gold
    labels) this is k/(k + 1)·RLOO in closed form. With label-free rewards (`Group.answers`), r_i(T) is the majority
    vote of T (`majority_rewards`), enumerated over every context (or a seeded sample of gmae_max_contexts)."""
    r, valid = _valid(g)
    X, M = r.shape
    if g.answers is None:  # context-free rewards: the closed form
        k = o.gmae_context or M // 2
        adv = np.asarray(rloo(r, valid), np.float64)
        n = valid.sum(1, keepdims=True)
        k_eff = np.minimum(k, np.maximum(n - 1, 0))
        return Estimate(np.where(valid, k_eff / (k_eff + 1) * adv, 0.0).astype(np.float32))
    answers = np.asarray(g.answers)
    rng = np.random.default_rng([g.seed, g.step, 19])
    adv = np.zeros((X, M))
    for x in range(X):
        idx = np.flatnonzero(valid[x])
        n = len(idx)
        if n < 2:
            continue
        k = min(o.gmae_context or M // 2, n - 1)
        a = answers[x, idx]
        adv[x, idx] = gmae_enumerate(n, k, lambda T: majority_rewards(a[list(T)][None])[0], o.gmae_max_contexts, rng)
    return Estimate(adv.astype(np.float32))


def _max_at_k(values: np.ndarray, K: int) -> float:
    """The unbiased estimate of E[max of K draws] from n ≥ K i.i.d. values: the mean of max over all K-subsets,
    Σ_m C(m, K−1) / C(n, K) · v_(m) over the sorted values (0-based m)."""
    v = np.sort(values)
    n = len(v)
    return float(sum(math.comb(m, K - 1) * v[m] for m in range(K - 1, n)) / math.comb(n, K))


def maxpo_group(r: np.ndarray, K: int) -> np.ndarray:
    """MaxPO's advantage in one group of G > K rewards (quadratic time):

        A_i = (G/K)·s_i − ρ̂_K(r_{−i}),  s_i = (1 / C(G, K)) Σ_{|S|=K, S∋i} max_{j∈S} r_j,

    s_i being the weight on ∇log π(y_i) in the unbiased policy gradient of max@K (each K-subset's max times the
    score of its members, averaged over subsets), and ρ̂_K(r_{−i}) the unbiased max@K estimate of the other G − 1
    (the leave-two-out baseline: each subset term's baseline replaces y_i by another response j, so the pair (i, j)
    is left out; it never reads y_i, so the gradient stays unbiased). Σ_i A_i = 0 exactly; K = 1 gives RLOO."""
    r = np.asarray(r, np.float64)
    G = len(r)
    if G <= K:
        raise ValueError(f"maxpo needs more responses than K: group of {G}, K = {K}")
    order = np.argsort(r, kind="stable")
    pos = np.empty(G, int)
    pos[order] = np.arange(G)  # a strict order; ties do not change any maximum
    total = math.comb(G, K)
    adv = np.empty(G)
    for i in range(G):
        own = r[i] * math.comb(pos[i], K - 1)  # subsets whose maximum is i: the other K−1 from below i
        above = sum(r[q] * math.comb(pos[q] - 1, K - 2) for q in range(G) if pos[q] > pos[i]) if K >= 2 else 0.0
        s_i = (own + above) / total
        adv[i] = G / K * s_i - _max_at_k(np.delete(r, i), K)
    return adv


def maxpo(g: Group, o: AdvantageConfig, state=None) -> Estimate:
    """MaxPO (max@K, pass@K on 0/1 rewards) with the leave-two-out baseline, group by group (`maxpo_group`);
    a group with no more valid responses than K gets 0."""
    r, valid = _valid(g)
    adv = np.zeros(r.shape)
    for x in range(r.shape[0]):
        idx = np.flatnonzero(valid[x])
        if len(idx) > o.maxpo_k:
            adv[x, idx] = maxpo_group(r[x, idx], o.maxpo_k)
    return Estimate(adv.astype(np.float32))


def lampo(g: Group, o: AdvantageConfig, state=None) -> Estimate:
    """LamPO: A_i = (1/(n−1)) Σ_{j≠i} w_ij (r_i − r_j), w_ij = 2σ(−τ·sign(r_i − r_j)·(ℓ_i − ℓ_j)), ℓ the mean token
    log-probability of a completion. A pair the policy already orders right (the better response is the likelier)
    weighs less than 1, one it orders wrong more (up to 2); w is symmetric, so each group sums to 0; τ = 0 is RLOO."""
    if g.seq_logp is None:
        raise ValueError("lampo needs the completions' mean log-probabilities (Group.seq_logp)")
    r, valid = _valid(g)
    ell = np.where(valid, np.asarray(g.seq_logp, np.float64), 0.0)
    gap = r[:, :, None] - r[:, None, :]
    z = -o.lampo_temperature * np.sign(gap) * (ell[:, :, None] - ell[:, None, :])
    w = 2.0 / (1.0 + np.exp(-z))
    pair = valid[:, :, None] & valid[:, None, :]
    n = valid.sum(1, keepdims=True)
    adv = np.where(pair, w * gap, 0.0).sum(-1) / np.maximum(n - 1, 1)
    return Estimate(np.where(valid, adv, 0.0).astype(np.float32))


def ntf_init(o: AdvantageConfig) -> dict:
    """The EMA of earlier batches' mean reward and its weight."""
    return {"mean": np.zeros((), np.float32), "weight": np.zeros((), np.float32)}


def ntf(g: Group, o: AdvantageConfig, state: dict) -> Estimate:
    """Negative token filtering for single-rollout training (any group size, 1 included).

    Baseline b: the batch's mean reward (ntf_baseline = batch) or the EMA of earlier batches' means (ema; the batch
    mean while there is no history); A = (r − b), divided by the batch's reward std (+1e-4) with ntf_normalize. The
    tokens of a negative sample (A < 0) that the policy gave probability ≥ ntf_filter_prob get token weight 0: in a
    group they would be shared with its positive samples and cancel; alone they would be penalised for being right.
    (The probabilities are the policy's at temperature 1, as `generate` scores them; a filtered token keeps its place
    in its sequence's length under seq_mean_token_mean, so the other tokens are not reweighted. With the EMA
    baseline, the normalisation is still the batch's own std.)"""
    r, valid = _valid(g)
    n = max(int(valid.sum()), 1)
    batch_mean = r.sum() / n
    W, m = float(state["weight"]), float(state["mean"])
    b = m if (o.ntf_baseline == "ema" and W > 0) else batch_mean
    adv = r - b
    if o.ntf_normalize:
        adv = adv / (np.sqrt(np.where(valid, (r - batch_mean) ** 2, 0.0).sum() / n) + 1e-4)
    adv = np.where(valid, adv, 0.0)
    weight, metrics = None, {"ntf_baseline": b}
    if g.token_logp is not None:
        mask = np.ones(np.shape(g.token_logp), bool) if g.token_mask is None else np.asarray(g.token_mask, bool)
        likely = np.asarray(g.token_logp, np.float64) >= np.log(o.ntf_filter_prob)
        drop = (adv < 0)[:, :, None] & likely & mask
        weight = np.where(drop, 0.0, 1.0).astype(np.float32)
        negative_tokens = ((adv < 0)[:, :, None] & mask).sum()
        metrics["ntf_filtered_fraction"] = float(drop.sum() / max(negative_tokens, 1))
    d = o.ntf_decay
    W_new = d * W + 1.0
    state = {"mean": np.float32((d * W * m + batch_mean) / W_new), "weight": np.float32(W_new)}
    return Estimate(adv.astype(np.float32), weight, state, metrics)


def ddrl(g: Group, o: AdvantageConfig, state=None) -> Estimate:
    """DDRL (label-free): fixed advantages from answer consistency, ambiguous groups left out, classes balanced.

    A group's consistency c is the fraction of it holding its modal answer. c ≥ ddrl_high: the modal answers are
    positive (+a), the others negative (−a); c ≤ ddrl_low: all negative (no consensus); in between, and a group of
    fewer than 2 valid responses (a lone answer is no consensus, nor its absence a disagreement): left out (0).
    Then the larger class is subsampled to the size of the smaller over the whole batch (a seeded draw from
    (seed, step)), so positives and negatives carry equal weight; a batch with no positives (or no negatives) keeps
    nothing, and its update is zero."""
    if g.answers is None:
        raise ValueError("ddrl needs the parsed answers (label-free mode: data.reward = 'majority')")
    _, valid = _valid(g)
    a = np.where(valid, np.asarray(g.answers), -1)
    X, M = a.shape
    same = (a[:, :, None] == a[:, None, :]) & (a[:, None, :] >= 0)
    counts = np.where(a >= 0, same.sum(-1), 0)
    c = counts.max(1) / np.maximum(valid.sum(1), 1)
    modal = (counts == counts.max(1, keepdims=True)) & (counts > 0)
    label = np.zeros((X, M))
    enough = valid.sum(1) >= 2
    high, low = enough & (c >= o.ddrl_high), enough & (c <= o.ddrl_low)
    label[high] = np.where(modal[high], 1.0, -1.0)
    label[low] = -1.0
    label = np.where(valid, label, 0.0)
    rng = np.random.default_rng([g.seed, g.step, 23])
    pos, neg = np.flatnonzero(label.ravel() > 0), np.flatnonzero(label.ravel() < 0)
    keep = min(len(pos), len(neg))
    flat = np.zeros(X * M)
    flat[rng.permutation(pos)[:keep]] = o.ddrl_value
    flat[rng.permutation(neg)[:keep]] = -o.ddrl_value
    metrics = {
        "ddrl_excluded_groups": float(np.mean(~high & ~low)),
        "ddrl_kept_fraction": float(2 * keep / max(int(valid.sum()), 1)),
    }
    return Estimate(flat.reshape(X, M).astype(np.float32), metrics=metrics)


register_advantage("agrae", agrae, options=("horizon", "agrae_positive", "agrae_positive_final", "agrae_focus"))
register_advantage(
    "bv_blend",
    bv_blend,
    bv_blend_init,
    options=("cluster_key", "bv_clusters", "bv_decay", "bv_blend_max", "bv_sem", "bv_prior_var"),
)
register_advantage("gmae", gmae, options=("gmae_context", "gmae_max_contexts"))
register_advantage("maxpo", maxpo, options=("maxpo_k",))
register_advantage("lampo", lampo, options=("lampo_temperature",))
register_advantage(
    "ntf", ntf, ntf_init, single_rollout=True, options=("ntf_baseline", "ntf_decay", "ntf_normalize", "ntf_filter_prob")
)
register_advantage("ddrl", ddrl, label_free_only=True, options=("ddrl_low", "ddrl_high", "ddrl_value"))


def init_state(name: str, options: AdvantageConfig) -> dict | None:
    """The running state estimator `name` starts from (None if it keeps none)."""
    init = _estimator(name)[1]
    return None if init is None else init(options)


def estimate(name: str, group: Group, options: AdvantageConfig, state: dict | None = None) -> Estimate:
    """Estimator `name` on one step's groups; `state` is what the previous call returned (or `init_state`)."""
    return _estimator(name)[0](group, options, state)


def _estimator(name: str):
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {', '.join(ESTIMATORS)}")
    return ESTIMATORS[name]


def answer_id(answer: str | None) -> int:
    """A parsed answer as a stable non-negative integer below 2^52 (exact in float64, the same on every host and
    process); -1 for no answer."""
    import hashlib

    if answer is None:
        return -1
    return int(hashlib.blake2b(answer.encode(), digest_size=8).hexdigest(), 16) >> 12


def cluster_id(key: str, clusters: int) -> int:
    """A cluster key (any string) hashed into [0, clusters)."""
    return answer_id(key) % clusters
