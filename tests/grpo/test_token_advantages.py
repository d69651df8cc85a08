"""Token-level advantages: an estimator may return one advantage per token [X, M, N]. The loss against a token-by-token
reference with per-token advantages; a per-token advantage constant over each completion gives exactly the loss,
gradient and GRPO step of the per-completion one (with the variants' token factors applied on top); a malformed one is
refused naming the estimator."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from esroll import parallel
from esroll.config import Options
from esroll.data import get_batch, make_splits
from esroll.grpo import AGGREGATIONS, advantages, make_grpo_method, token_weights
from esroll.grpo import grpo_loss as _grpo_loss
from esroll.grpo.variants import StareOptions
from esroll.task import load_task

from conftest import quick_config
from test_grpo import BETA, EPS_HIGH, EPS_LOW, hand_built, reference


@pytest.fixture
def estimators():
    """The estimator registry, restored after the test."""
    saved = dict(advantages.ESTIMATORS), dict(advantages.ESTIMATORS.options)
    yield advantages
    for registry, items in zip((advantages.ESTIMATORS, advantages.ESTIMATORS.options), saved):
        dict.clear(registry)
        dict.update(registry, items)


def _loss_and_grad(logp_new, logp_old, logp_ref, advantage, mask, aggregation, weights=None):
    def loss(lp):
        out, _ = _grpo_loss(
            lp,
            logp_old,
            logp_ref,
            advantage,
            mask,
            eps_low=EPS_LOW,
            eps_high=EPS_HIGH,
            beta=BETA,
            aggregation=aggregation,
            weights_BxN=weights,
        )
        return out

    value, grad = jax.value_and_grad(loss)(jnp.asarray(logp_new, jnp.float32))
    return float(value), np.asarray(grad)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_per_token_advantages_against_a_token_by_token_reference(aggregation):
    """Each token's term −min(ρ_t a_t, clip(ρ_t) a_t) + β·k3 with its own a_t (signs mixed within a completion),
    against GRPO's float64 token-by-token reference (`test_grpo.reference`), loss and d loss / d log π."""
    logp_new, logp_old, logp_ref, _, mask = hand_built()
    a = np.array([[1.0, -0.5, 2.0, 9.0, 9.0], [-1.5, 9.0, 9.0, 9.0, 9.0], [0.3, 0.0, -0.8, 1.2, 9.0]])  # 9: padding
    loss, grad = reference(logp_new, logp_old, logp_ref, a, mask, aggregation)
    got_loss, got_grad = _loss_and_grad(logp_new, logp_old, logp_ref, a, mask, aggregation)
    np.testing.assert_allclose(got_loss, loss, rtol=1e-5)
    np.testing.assert_allclose(got_grad, grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_constant_per_token_advantages_are_the_per_completion_loss_exactly(aggregation):
    """Loss and gradient bit-identical, with plain and with reweighted tokens (a variant's factors)."""
    logp_new, logp_old, logp_ref, _, mask = hand_built(1)
    per_completion = np.array([1.3, -0.7, -1.1], np.float32)
    per_token = np.repeat(per_completion[:, None], mask.shape[1], 1)
    factor = np.where(np.random.default_rng(2).random(mask.shape) < 0.5, 1.5, 1.0).astype(np.float32)
    for weights in (None, np.asarray(token_weights(mask, aggregation)) * factor):
        seq = _loss_and_grad(logp_new, logp_old, logp_ref, per_completion, mask, aggregation, weights)
        tok = _loss_and_grad(logp_new, logp_old, logp_ref, per_token, mask, aggregation, weights)
        assert seq[0] == tok[0]
        np.testing.assert_array_equal(seq[1], tok[1])


def _per_token(name: str):
    """An estimator returning `name`'s advantages copied to every token position [X, M, N]."""

    def fn(group, options, state):
        out = advantages.estimate(name, group)
        N = group.token_mask.shape[-1]
        return out._replace(advantage=np.repeat(out.advantage[..., None], N, -1))

    return fn


@pytest.mark.e2e
def test_a_per_token_estimator_constant_per_completion_takes_grpos_step_exactly(estimators):
    """One GRPO step with `grpo` and with an estimator returning grpo's advantages on every token: parameters,
    optimizer state and metrics bit-identical (the logged mean |A| to rounding), also with STARE's token factors applied (gate open); an estimator
    returning another shape or a non-finite token advantage is refused, naming it."""
    estimators.register_advantage("grpo_tokens", _per_token("grpo"), needs=("logprobs",))
    estimators.register_advantage("bad_shape", lambda g, o, s: advantages.Estimate(np.zeros((1, 2, 3), np.float32)))
    estimators.register_advantage(
        "nan_tokens",
        lambda g, o, s: advantages.Estimate(np.full(g.token_mask.shape, np.nan, np.float32)),
        needs=("logprobs",),
    )
    base = quick_config("grpo_quick")
    train, held_out = make_splits(base.data)
    mesh = parallel.make_mesh(1)
    task, params = load_task(base, train, held_out, mesh)
    examples = get_batch(train, base.train.prompts_per_step, base.data.seed, 0)

    def step(advantage: str, stare: bool = False):
        grpo = dict(advantage=advantage)
        if stare:
            grpo.update(variants=("stare",), variant_options=Options(stare=StareOptions(quantile=0.5, alpha=1.0)))
        cfg = dataclasses.replace(base, grpo=dataclasses.replace(base.grpo, **grpo))
        method = make_grpo_method(cfg, task, mesh)
        state = method.init(params, jax.random.key(0))
        if stare:
            state = state._replace(host={"variants": {"stare": {"open": jnp.ones((), jnp.float32)}}})
        out = method.step(params, state, examples, 0)
        metrics = {k: float(v) for k, v in out.metrics.items() if not k.startswith("s_")}
        return jax.device_get((out.params, out.state.opt_state)), metrics

    for stare in (False, True):
        plain, plain_m = step("grpo", stare)
        tokens, tokens_m = step("grpo_tokens", stare)
        chex.assert_trees_all_equal(tokens, plain)
        # |A| is averaged per completion in float32, per token in float64: equal to rounding
        assert tokens_m.pop("advantage_abs") == pytest.approx(plain_m.pop("advantage_abs"), rel=1e-6)
        assert tokens_m == plain_m and plain_m["grad_norm"] > 0
    with pytest.raises(ValueError, match=r"estimator 'bad_shape' returned advantages of shape \(1, 2, 3\)"):
        step("bad_shape")
    with pytest.raises(ValueError, match="estimator 'nan_tokens' returned a non-finite advantage"):
        step("nan_tokens")
