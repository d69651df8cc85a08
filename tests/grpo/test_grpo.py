"""GRPO: the loss against a loop-by-loop reference, exact microbatch accumulation, ρ = 1 on the first update, KL = 0
at the reference, FSDP on 8 devices == 1 device, exact resumption; the memory knobs (per-layer remat, chunked
completion log-probabilities) leave loss and gradient unchanged, and masked padding rows leave the update unchanged;
STARE and ACPO, switched off by their config keys (STARE with its gate closed, ACPO on-policy), leave the step
bit-identical to plain GRPO."""

from __future__ import annotations

import dataclasses
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec

from configs.default import get_config
from esroll import parallel
from esroll.config import ConfigError, OptimConfig, from_config_dict, make_optimizer
from esroll.data import get_batch, make_splits
from esroll.experiment import check_names
from esroll.config import Options
from esroll.grpo import (
    AGGREGATIONS,
    GRPOConfig,
    GRPOState,
    Rollouts,
    make_grpo_method,
    make_update,
    pad_rows,
    token_weights,
)
from esroll.grpo import grpo_loss as _grpo_loss
from esroll.grpo.variants import (
    PROGRESS_BUCKETS,
    AcpoOptions,
    ProgressOptions,
    StareOptions,
    VARIANTS,
    LossTerms,
    acpo_bounds,
    progress_by_position,
    stare_gate,
    stare_token_weights,
)
from esroll.models import forward, load_hf
from esroll.scoring import sequence_logprobs
from esroll.task import load_task

from conftest import EIGHT, build_tiny_hf, quick_config, strict_quick

EPS_LOW, EPS_HIGH, BETA = 0.2, 0.28, 0.1
grpo_loss = jax.jit(_grpo_loss, static_argnames=("eps_low", "eps_high", "beta", "aggregation"))


def hand_built(seed=0):
    """3 completions of lengths 3, 1, 4 (N = 5), advantages of both signs, ratios inside and outside the clip range."""
    rng = np.random.default_rng(seed)
    mask = np.arange(5)[None, :] < np.array([3, 1, 4])[:, None]
    logp_old = -rng.uniform(0.1, 3.0, (3, 5))
    logp_new = logp_old + rng.choice([-0.6, -0.1, 0.05, 0.15, 0.5], (3, 5))
    logp_ref = logp_old + rng.normal(0, 0.3, (3, 5))
    advantage = np.array([1.3, -0.7, -1.1])
    return logp_new, logp_old, logp_ref, advantage, mask


def reference(logp_new, logp_old, logp_ref, advantage, mask, aggregation, eps_low=EPS_LOW, eps_high=EPS_HIGH):
    """Loss and d loss / d logp_new, token by token in float64, with the aggregation written out per mode; the
    advantage is one per completion [B] or one per token [B, N]; the clip range 1 − ε_low .. 1 + ε_high is a scalar
    or one per token ([B, N]: ACPO's)."""
    B, N = mask.shape
    eps_low, eps_high = np.broadcast_to(eps_low, (B, N)), np.broadcast_to(eps_high, (B, N))
    advantage = np.asarray(advantage)
    advantage_BxN = np.broadcast_to(advantage[:, None] if advantage.ndim == 1 else advantage, (B, N))
    loss_t, grad_t = np.zeros((B, N)), np.zeros((B, N))
    for i in range(B):
        for t in range(N):
            a = advantage_BxN[i, t]
            ratio = np.exp(logp_new[i, t] - logp_old[i, t])
            clipped = min(max(ratio, 1 - eps_low[i, t]), 1 + eps_high[i, t])
            unclipped_active = ratio * a <= clipped * a
            d = logp_ref[i, t] - logp_new[i, t]
            loss_t[i, t] = -min(ratio * a, clipped * a) + BETA * (np.exp(d) - d - 1)
            grad_t[i, t] = (-ratio * a if unclipped_active else 0.0) + BETA * (1 - np.exp(d))
    lengths = mask.sum(1)
    if aggregation == "seq_mean_token_mean":
        scale = np.array([[1 / (lengths[i] * B)] * N for i in range(B)])
    elif aggregation == "token_mean":
        scale = np.full((B, N), 1 / lengths.sum())
    else:
        scale = np.full((B, N), 1 / (B * N))
    return float((loss_t * scale * mask).sum()), grad_t * scale * mask


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_loss_and_gradient_match_reference(aggregation):
    logp_new, logp_old, logp_ref, advantage, mask = hand_built()
    kw = dict(eps_low=EPS_LOW, eps_high=EPS_HIGH, beta=BETA, aggregation=aggregation)

    def loss_fn(new):
        return grpo_loss(
            new, jnp.asarray(logp_old, jnp.float32), jnp.asarray(logp_ref, jnp.float32), advantage, mask, **kw
        )

    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.asarray(logp_new, jnp.float32))
    ref_loss, ref_grad = reference(logp_new, logp_old, logp_ref, advantage, mask, aggregation)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-5, atol=1e-7)
    ratio = np.exp(logp_new - logp_old)
    clipped = ((ratio < 1 - EPS_LOW) & (advantage[:, None] < 0)) | ((ratio > 1 + EPS_HIGH) & (advantage[:, None] > 0))
    assert 0 < (clipped & mask).sum() < mask.sum()  # the hand-built case exercises both branches
    np.testing.assert_allclose(float(metrics["clip_fraction"]), (clipped & mask).sum() / mask.sum(), rtol=1e-6)
    d = logp_ref - logp_new
    np.testing.assert_allclose(float(metrics["kl"]), ((np.exp(d) - d - 1) * mask).sum() / mask.sum(), rtol=1e-5)


@pytest.mark.parametrize("eps_low, eps_high", [(0.0, EPS_HIGH), (EPS_LOW, 0.0), (0.0, 0.0), (EPS_LOW, EPS_HIGH)])
@pytest.mark.parametrize("advantage", [1.5, -1.5])
def test_on_policy_gradient_is_the_unclipped_one_for_any_epsilon(eps_low, eps_high, advantage):
    """At ρ = 1 the clip is inactive whatever ε ≥ 0 (a tie takes the unclipped branch): token_mean over n = 2 tokens
    gives ∂L/∂log p = −A/n per token exactly, both with π_old := stop_gradient(π_θ) (the on-policy update) and with
    π_old passed as equal values. (Selecting by jnp.minimum / jnp.clip split the gradient at the ties: −0.5625 for
    A = 1.5 with one ε = 0, −0.46875 with both, instead of −0.75.)"""
    logp = jnp.asarray([[-0.7, -1.2]], jnp.float32)
    mask = np.ones((1, 2), bool)
    kw = dict(eps_low=eps_low, eps_high=eps_high, beta=0.0, aggregation="token_mean")
    expected = np.full((1, 2), -advantage / 2)

    def on_policy(new):
        return _grpo_loss(new, jax.lax.stop_gradient(new), None, jnp.asarray([advantage]), mask, **kw)

    def equal_old(new):
        return _grpo_loss(new, logp, None, jnp.asarray([advantage]), mask, **kw)

    for loss_fn in (on_policy, equal_old):
        (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(logp)
        np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-6)
        np.testing.assert_allclose(float(loss), -advantage, rtol=1e-6)
        assert float(metrics["clip_fraction"]) == 0.0


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_microbatch_losses_sum_to_minibatch_loss(aggregation):
    """Weights from the whole minibatch make the split exact, token_mean included (a mean of means would not be)."""
    logp_new, logp_old, logp_ref, advantage, mask = (jnp.asarray(x) for x in hand_built(1))
    kw = dict(eps_low=EPS_LOW, eps_high=EPS_HIGH, beta=BETA, aggregation=aggregation)
    whole, _ = grpo_loss(logp_new, logp_old, logp_ref, advantage, mask, **kw)
    w = token_weights(mask, aggregation)
    parts = [
        grpo_loss(logp_new[s], logp_old[s], logp_ref[s], advantage[s], mask[s], weights_BxN=w[s], **kw)[0]
        for s in (slice(0, 1), slice(1, 3))
    ]
    np.testing.assert_allclose(float(sum(parts)), float(whole), rtol=1e-6)


def test_kl_is_zero_when_policy_equals_reference():
    logp_new, logp_old, _, advantage, mask = (jnp.asarray(x, jnp.float32) for x in hand_built(2))
    kw = dict(eps_low=EPS_LOW, eps_high=EPS_HIGH, aggregation="token_mean")

    def loss_fn(new, beta, ref):
        return grpo_loss(new, logp_old, ref, advantage, mask, beta=beta, **kw)

    (with_kl, metrics), g_kl = jax.value_and_grad(loss_fn, has_aux=True)(logp_new, BETA, logp_new)
    (without, _), g = jax.value_and_grad(loss_fn, has_aux=True)(logp_new, 0.0, None)
    assert float(metrics["kl"]) == 0.0 and float(with_kl) == float(without)
    np.testing.assert_array_equal(np.asarray(g_kl), np.asarray(g))


@pytest.mark.e2e
def test_first_update_has_ratio_exactly_one():
    """μ = 1, one minibatch: nothing clips even at ε = 0, the gradient flows, the KL to the (equal) reference is zero,
    and parameters, optimizer state and reference come back split over the 8 devices of a 4 × 2 mesh. (Taking π_old from
    generate's KV-cache log-probabilities, ~1e-6 off a full forward, instead clips 7% of this batch's tokens at ε = 0
    and cuts the gradient norm tenfold: measured once, by hand.)"""
    cfg = strict_quick(EIGHT, 2)
    assert cfg.grpo.inner_iterations == cfg.grpo.minibatches == 1 and cfg.grpo.beta > 0
    train, held_out = make_splits(cfg.data)
    mesh = parallel.make_mesh(8, model=2)
    task, params = load_task(cfg, train, held_out, mesh)
    method = make_grpo_method(cfg, task, mesh)
    state = method.init(params, jax.random.key(0))
    examples = get_batch(train, cfg.train.prompts_per_step, cfg.data.seed, 0)
    new_params, state, metrics, *_ = method.step(params, state, examples, 0)
    assert 0 < metrics["reward_mean"] < 1 and metrics["frac_groups_all_equal"] < 1  # some advantage is nonzero
    assert float(metrics["clip_fraction"]) == 0.0 and float(metrics["grad_norm"]) > 0
    assert abs(float(metrics["kl"])) < 1e-6
    for leaf in (new_params["layers"]["gate"], state.opt_state[1][0].mu["layers"]["gate"], state.ref_params["embed"]):
        assert {"data", "model"} <= set(leaf.sharding.spec) and leaf.addressable_shards[0].data.size * 8 == leaf.size


@pytest.mark.e2e
def test_config_errors():
    cd = get_config("grpo_quick")
    cd.grpo.minibatches = 3  # 4 prompts × 4 completions = 16 rows
    with pytest.raises(ValueError, match="invalid value for 'grpo.minibatches': 3"):
        check_names(from_config_dict(cd.to_dict()))
    cd = get_config("grpo_quick")
    cd.grpo.logprob_chunk = -1
    with pytest.raises(ValueError, match="invalid value for 'grpo.logprob_chunk'"):
        from_config_dict(cd.to_dict())
    # Names are checked against the registries once the config is built (`check_names`), and by the factories.
    for field, value in (("aggregation", "sum"), ("remat", "some"), ("advantage", "nope"), ("variants", ("nope",))):
        cd = get_config("grpo_quick")
        cd.grpo[field] = value
        cfg = from_config_dict(cd.to_dict())
        with pytest.raises(
            ConfigError, match=rf"^config: invalid value for 'grpo.{field}': {re.escape(repr(value))} \(expected "
        ):
            check_names(cfg)
        with pytest.raises(ConfigError, match=rf"^GRPOConfig: invalid value for '{field}': {re.escape(repr(value))}"):
            make_update(None, cfg.grpo, cfg.optimizer, None)
        with pytest.raises(ConfigError, match=rf"^config: invalid value for 'grpo.{field}': {re.escape(repr(value))}"):
            make_grpo_method(cfg, None, parallel.make_mesh(1))
    cd = get_config("grpo_quick")
    cd.grpo.group_size = 1  # one completion has no group to compare with, but for the single-rollout estimators
    with pytest.raises(ConfigError, match=r"^config: invalid value for 'grpo.group_size': 1 \(expected >= 2"):
        check_names(from_config_dict(cd.to_dict()))
    cd.grpo.advantage = "ntf"
    check_names(from_config_dict(cd.to_dict()))


# ---- the memory knobs: per-layer remat and chunked completion log-probabilities


@pytest.fixture(scope="module", params=["untied", "tied"])
def tiny(request, tmp_path_factory):
    """(cfg, params) of a random 2-layer model: Qwen3 with an lm_head, or Qwen2 with the head tied to the embedding."""
    folder = tmp_path_factory.mktemp(f"grpo_{request.param}")
    build_tiny_hf("qwen3" if request.param == "untied" else "qwen2", folder, initializer_range=0.2)
    cfg, params = load_hf(folder)
    assert cfg.tie_word_embeddings == (request.param == "tied")
    return cfg, params


def scored_rows(vocab: int, rows: int = 3, P: int = 5, N: int = 7, seed: int = 0):
    """Left-padded prompts of lengths 5, 2, 3, ... and completions of lengths 7, 4, 1, ... (N = 7, not a multiple of
    the chunk 3), random tokens."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, (rows, P)).astype(np.int32)
    prompt_mask = np.arange(P)[None, :] >= P - np.resize([5, 2, 3, 4, 1], rows)[:, None]
    completion = rng.integers(0, vocab, (rows, N)).astype(np.int32)
    completion_mask = np.arange(N)[None, :] < np.resize([7, 4, 1, 6, 3, 5, 2], rows)[:, None]
    return prompt, prompt_mask, completion, completion_mask


def full_softmax_logprobs(cfg, params, prompt, prompt_mask, completion, completion_mask):
    """The pre-chunking computation: logits over every position, log-softmax, completion positions taken after."""
    P = prompt.shape[1]
    tokens = jnp.concatenate([prompt, completion], 1)
    mask = jnp.concatenate([prompt_mask, completion_mask], 1)
    logits = forward(cfg, params, tokens, mask_BxT=mask)[0][:, P - 1 : -1]
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), completion[..., None], -1)[..., 0]
    entropy = -(jax.nn.softmax(logits) * jax.nn.log_softmax(logits)).sum(-1)
    return jnp.where(completion_mask, logp, 0.0), jnp.where(completion_mask, entropy, 0.0)


# Both remat policies and both kinds of chunking (one chunk; chunks of 3 under `lax.map`, N = 7 not a multiple: the
# code of chunks of 1 too), the layer scan one layer and two layers an iteration; the tied head chunked and
# rematerialised (no remat is the reference's own forward). Compile time is most of these tests' time.
@pytest.mark.parametrize(
    "tiny,remat,chunk,unroll",
    [("untied", "dots", 0, 1), ("untied", "full", 3, 2), ("tied", "full", 3, 2)],
    indirect=["tiny"],
)
def test_remat_and_chunks_keep_loss_and_gradient(tiny, remat, chunk, unroll):
    """A GRPO-like loss (advantage-weighted log-probabilities) and its gradient in every parameter: per-layer remat,
    chunked completion log-probabilities and the layer scan's `unroll`, against the full forward + log-softmax over
    all positions, one layer per scan iteration."""
    cfg, params = tiny
    rows = scored_rows(cfg.vocab_size)
    weight = np.random.default_rng(1).normal(size=rows[3].shape).astype(np.float32)

    def loss_of(logprobs):
        return jax.jit(jax.value_and_grad(lambda p: (weight * logprobs(p)).sum()))(params)

    ref_loss, ref_grad = loss_of(lambda p: full_softmax_logprobs(cfg, p, *rows)[0])
    loss, grad = loss_of(lambda p: sequence_logprobs(cfg, p, *rows, remat=remat, chunk=chunk, unroll=unroll))
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grad), jax.tree.leaves(ref_grad), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5 * float(np.abs(r).max()))


@pytest.mark.parametrize("chunk", [0, 3])
def test_entropy_is_that_of_the_full_softmax(tiny, chunk):
    cfg, params = tiny
    rows = scored_rows(cfg.vocab_size)
    ref_logp, ref_entropy = jax.jit(lambda p: full_softmax_logprobs(cfg, p, *rows))(params)
    logp, entropy = jax.jit(lambda p: sequence_logprobs(cfg, p, *rows, chunk=chunk, with_entropy=True))(params)
    assert float(ref_entropy.max()) > 1.0  # a spread-out distribution, not a near-one-hot one
    np.testing.assert_allclose(np.asarray(entropy), np.asarray(ref_entropy), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(logp), np.asarray(ref_logp), rtol=1e-5, atol=1e-6)


@pytest.mark.e2e
@pytest.mark.parametrize("tiny", ["untied"], indirect=True)  # one model will do
@pytest.mark.parametrize("data,model", [(8, 1), (2, 4)])  # the 4 × 2 mesh: tests/test_sharded.py
def test_update_on_any_mesh_equals_one_device(tiny, data, model):
    """6 rows per microbatch (2 microbatches) on a data × model mesh of fake devices, padded by `pad_rows` to a
    multiple of the data axis (8 on 8 devices; none on 2, whose model axis of 4 exceeds the 2 key-value heads),
    against the same 6 rows on 1 device: the same
    parameters after one optimizer step, loss and metrics (β > 0, off-policy ratios). The masters and the optimizer
    state come out split over "data" and, on a model axis, tensor-parallel over it (the decoding layout).
    Plain SGD at lr 1, so that the parameters' difference is the gradients' (AdamW's first step lr·g/(|g| + 1e-8)
    would magnify float noise in near-zero gradient entries, see tests/test_sharded.py). They agree to 1e-5
    of the largest gradient entry: the float32 noise of splitting rows over devices at all (6 unpadded rows on 2
    devices differ from 1 device by as much, 3e-6 of it: measured once, by hand)."""
    cfg, params = tiny
    rng = np.random.default_rng(2)
    U, b = 2, 6
    prompt, prompt_mask, completion, completion_mask = scored_rows(cfg.vocab_size, rows=U * b)
    logp_old = np.where(completion_mask, -rng.uniform(0.5, 5.0, completion_mask.shape), 0.0).astype(np.float32)
    advantage = rng.normal(size=U * b).astype(np.float32)
    weight = np.asarray(token_weights(completion_mask, "seq_mean_token_mean"))
    fields = (prompt, prompt_mask, completion, completion_mask, logp_old, advantage, weight)
    grpo = GRPOConfig(group_size=2, beta=0.1, remat="full", logprob_chunk=3)
    optim = OptimConfig(name="sgd", lr=1.0)  # new params = params - gradient: compares the gradients themselves
    reference = jax.tree.map(lambda x: x * 1.05, params)  # a KL term that is not zero

    def one_step(mesh, rows: int):
        update = make_update(cfg, grpo, optim, mesh)
        state = GRPOState(make_optimizer(optim).init(params), reference)
        batch = Rollouts(*(pad_rows(x.reshape(U, b, *x.shape[1:]), rows) for x in fields))
        return update(params, state, batch, jnp.asarray(False))

    padded = -(-b // data) * data
    unpadded, _, metrics = jax.device_get(one_step(parallel.make_mesh(1), b))
    new_params, _, sharded_metrics = one_step(parallel.make_mesh(data * model, model=model), padded)
    gate = new_params["layers"]["gate"]  # [L, D, I]: D over "data", I over "model"
    assert gate.sharding.spec == (PartitionSpec(None, "data", "model") if model > 1 else PartitionSpec(None, "data"))
    assert gate.addressable_shards[0].data.size * data * model == gate.size
    largest = max(float(np.abs(x - p).max()) for x, p in zip(jax.tree.leaves(unpadded), jax.tree.leaves(params)))
    for x, y in zip(jax.tree.leaves(unpadded), jax.tree.leaves(jax.device_get(new_params)), strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-5 * largest)
    for key in ("loss", "kl", "clip_fraction", "grad_norm", "entropy"):
        np.testing.assert_allclose(sharded_metrics[key], metrics[key], rtol=1e-5, err_msg=key)
    assert float(metrics["grad_norm"]) > 0 and float(metrics["kl"]) > 0 and float(metrics["entropy"]) > 0


@pytest.mark.e2e
def test_float32_masters_keep_small_updates_of_a_bf16_model():
    """The shipped model decoded in bfloat16: 3 GRPO steps of AdamW at lr 1e-6 (no weight decay) move >= 99% of the
    float32 master entries that received a non-zero gradient (Adam's second moment > 0: embedding rows of tokens never
    seen receive none). bfloat16 masters, as the baseline once had, keep most of them: an update of ~lr is below half
    a bfloat16 spacing of most weights, so it rounds away."""

    def changed_fraction(master_dtype: str) -> float:
        cfg = quick_config("grpo_quick", grpo={"beta": 0.0}, steps=3)
        cfg = dataclasses.replace(
            cfg,
            model=dataclasses.replace(cfg.model, dtype="bfloat16", master_dtype=master_dtype),
            optimizer=dataclasses.replace(cfg.optimizer, lr=1e-6, weight_decay=0.0),
        )
        train, held_out = make_splits(cfg.data)
        mesh = parallel.make_mesh(1)
        task, params = load_task(cfg, train, held_out, mesh)
        initial = jax.device_get(params)
        method = make_grpo_method(cfg, task, mesh)
        state = method.init(params, jax.random.key(0))
        for step in range(cfg.train.steps):
            examples = get_batch(train, cfg.train.prompts_per_step, cfg.data.seed, step)
            params, state, *_ = method.step(params, state, examples, step)
        moved = graded = 0
        for before, after, nu in zip(
            jax.tree.leaves(initial),
            jax.tree.leaves(jax.device_get(params)),
            jax.tree.leaves(jax.device_get(optax.tree.get(state.opt_state, "nu"))),
            strict=True,
        ):
            assert after.dtype == np.dtype(master_dtype)
            moved += np.sum((after != before) & (nu > 0))
            graded += np.sum(nu > 0)
        assert graded > 0.5 * sum(x.size for x in jax.tree.leaves(initial))
        return moved / graded

    assert changed_fraction("float32") >= 0.99  # 0.9997 measured
    assert changed_fraction("bfloat16") < 0.5  # 0.016 measured


# ---- token-level methods: STARE's reweighting and gate, the progress advantage


def test_stare_reweights_exactly_the_tokens_above_the_surprisal_quantile():
    # surprisals (−log π) of 3 completions; the third token of row 1 is padding (its value must not count)
    surprisal = np.array([[0.1, 2.0, 0.5], [3.0, 0.2, 9.0], [1.0, 0.3, 4.0]])
    mask = np.array([[1, 1, 1], [1, 1, 0], [1, 1, 1]], bool)
    advantage = np.array([1.5, -0.5, 0.0])
    weights, selected = stare_token_weights(-surprisal, mask, advantage, quantile=0.5, alpha=0.4)
    # the 8 completion tokens' median surprisal is (0.5 + 1.0) / 2 = 0.75: above it are 2.0, 3.0, 1.0 and 4.0
    np.testing.assert_array_equal(selected, [[0, 1, 0], [1, 0, 0], [1, 0, 1]])
    np.testing.assert_allclose(weights, [[1, 1.4, 1], [0.6, 1, 1], [1, 1, 1]])  # sign(0) = 0: a zero advantage stays
    off, _ = stare_token_weights(-surprisal, mask, advantage, quantile=0.5, alpha=0.0)
    assert np.all(off == 1.0)
    # the gate: opens at or below 0.3, closes at or above 0.6, keeps its state in between
    assert stare_gate(False, 0.3, 0.3, 0.6) and not stare_gate(False, 0.45, 0.3, 0.6)
    assert stare_gate(True, 0.45, 0.3, 0.6) and not stare_gate(True, 0.6, 0.3, 0.6)


def test_stare_off_and_progress_off_leave_the_loss_bit_identical():
    """At the loss: α = 0 STARE weights change nothing (the config switch: test_stare_switch_in_the_step)."""
    logp_new, logp_old, logp_ref, advantage, mask = hand_built()
    args = dict(eps_low=EPS_LOW, eps_high=EPS_HIGH, beta=BETA, aggregation="token_mean")
    plain = grpo_loss(logp_new, logp_old, logp_ref, advantage, mask, **args)[0]
    w = np.asarray(token_weights(mask, "token_mean"))
    ones, _ = stare_token_weights(logp_old, mask, advantage, quantile=0.5, alpha=0.0)
    stare_off = grpo_loss(logp_new, logp_old, logp_ref, advantage, mask, weights_BxN=w * ones, **args)[0]
    assert float(plain) == float(stare_off)


@pytest.mark.e2e
def test_stare_switch_in_the_step():
    """STARE through its config switch ("stare" in `grpo.variants`, read by the GRPO step on the host): off, with
    every STARE option changed, the step is plain GRPO's bit for bit (parameters, optimizer state, metrics; no gate
    state, no STARE metric); on with its gate closed (as a run starts) it is too; with the gate open it reweights the
    step's most surprising tokens and the update changes. The same completions throughout (sampling is keyed by
    (seed, step)), one compiled update (`update_config` drops STARE, a host-only variant)."""
    base = quick_config("grpo_quick")
    train, held_out = make_splits(base.data)
    mesh = parallel.make_mesh(1)
    task, params = load_task(base, train, held_out, mesh)
    examples = get_batch(train, base.train.prompts_per_step, base.data.seed, 0)

    def step(open_gate: bool = False, **grpo):
        cfg = dataclasses.replace(base, grpo=dataclasses.replace(base.grpo, **grpo))
        method = make_grpo_method(cfg, task, mesh)
        state = method.init(params, jax.random.key(0))
        if open_gate:
            state = state._replace(host={"variants": {"stare": {"open": jnp.ones((), jnp.float32)}}})
        out = method.step(params, state, examples, 0)
        metrics = {k: float(v) for k, v in out.metrics.items() if not k.startswith("s_")}  # wall seconds differ
        return jax.device_get((out.params, out.state.opt_state)), out.state.host, metrics

    plain, plain_host, plain_m = step()
    assert plain_host is None and 0 < plain_m["reward_mean"] < 1 and plain_m["grad_norm"] > 0
    options = StareOptions(quantile=0.5, alpha=1.0, entropy_low=50.0, entropy_high=60.0)
    off, off_host, off_m = step(variant_options=Options(stare=options))
    chex.assert_trees_all_equal(off, plain)
    assert off_host is None and off_m == plain_m
    stare = dict(variants=("stare",), variant_options=Options(stare=StareOptions(quantile=0.5, alpha=1.0)))
    closed, closed_host, closed_m = step(**stare)
    chex.assert_trees_all_equal(closed, plain)
    assert closed_m == {**plain_m, "stare_open": 0.0} and "open" in closed_host["variants"]["stare"]
    opened, _, opened_m = step(open_gate=True, **stare)
    assert opened_m["stare_open"] == 1.0 and 0.3 < opened_m["stare_tokens"] < 0.7  # about half the tokens
    assert opened_m["grad_norm"] != plain_m["grad_norm"]
    assert not all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(opened[0]), jax.tree.leaves(plain[0])))


def with_variants(names, grpo: GRPOConfig, logp_new, logp_old, logp_ref, advantage, mask, **args):
    """grpo_loss after the loss hooks of the variants `names` (as `make_update`'s loss applies them)."""
    adv = jnp.asarray(advantage, jnp.float32)[:, None]
    terms = LossTerms(*(jnp.asarray(x, jnp.float32) for x in (logp_new, logp_old, logp_ref)), mask, adv, 0.0, 0.0)
    terms = terms._replace(eps_low=args.pop("eps_low"), eps_high=args.pop("eps_high"))
    for name in names:
        terms = VARIANTS[name].loss_terms(grpo, terms)
    return _grpo_loss(*terms[:3], terms.advantage, mask, eps_low=terms.eps_low, eps_high=terms.eps_high, **args)


def test_progress_advantage_adds_to_each_tokens_advantage():
    """The loss with η > 0 against the surrogate written out token by token with a_t = A_i + η·(log π_θ − log π_ref)_t
    (β = 0: the surrogate alone; ratios inside and outside the clip range)."""
    logp_new, logp_old, logp_ref, advantage, mask = hand_built()
    eta = 0.7
    args = dict(eps_low=EPS_LOW, eps_high=EPS_HIGH, beta=0.0, aggregation="token_mean")
    loss, _ = with_variants(
        ["progress"], GRPOConfig(variant_options=Options(progress=ProgressOptions(eta))), *hand_built(), **args
    )
    a = advantage[:, None] + eta * (logp_new - logp_ref)
    ratio = np.exp(logp_new - logp_old)
    surrogate = np.minimum(ratio * a, np.clip(ratio, 1 - EPS_LOW, 1 + EPS_HIGH) * a)
    expected = -(surrogate * mask).sum() / mask.sum()
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    plain, _ = _grpo_loss(logp_new, logp_old, logp_ref, advantage, mask, **args)
    assert abs(float(loss) - float(plain)) > 1e-3  # the term matters here


def test_acpo_bounds_follow_the_ratio_spread_of_each_probability_group():
    # old probabilities 0.05 (group 0: below 0.1), 0.3 (group 1), 0.95 (group 3); none in [0.5, 0.9) (group 2)
    p_old = np.array([[0.05, 0.05, 0.3, 0.3, 0.95], [0.05, 0.3, 0.3, 0.95, 0.95]])
    ratio = np.array([[0.7, 1.3, 1.0, 1.02, 1.0], [1.0, 0.98, 5.0, 1.0, 1.0]])
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]], bool)  # the last token's 5.0-free slot is padding
    eps_BxN, eps_Y = acpo_bounds(ratio, np.log(p_old), mask, (0.1, 0.5, 0.9), 2.0, 0.1, 0.4)

    def expected(values):
        return float(np.clip(2.0 * np.std(values, ddof=1), 0.1, 0.4)) if len(values) >= 2 else 0.1

    groups = [[0.7, 1.3, 1.0], [1.0, 1.02, 0.98, 5.0], [], [1.0, 1.0]]
    np.testing.assert_allclose(np.asarray(eps_Y), [expected(g) for g in groups], rtol=1e-6)
    assert float(eps_Y[1]) == pytest.approx(0.4) and float(eps_Y[3]) == pytest.approx(0.1)  # clipped both ways
    np.testing.assert_allclose(np.asarray(eps_BxN)[0], np.asarray(eps_Y)[[0, 0, 1, 1, 3]], rtol=1e-6)
    # on-policy every ratio is 1: every group at the minimum
    _, on_policy = acpo_bounds(np.ones_like(ratio), np.log(p_old), mask, (0.1, 0.5, 0.9), 2.0, 0.1, 0.4)
    np.testing.assert_allclose(np.asarray(on_policy), 0.1)


def test_progress_by_position_buckets_hand_built_sums():
    sum_N = jnp.asarray([1.0, 2.0, 3.0, 0.0, 0.0])
    tokens_N = jnp.asarray([2.0, 2.0, 1.0, 0.0, 0.0])  # no completion reached the last two positions
    out = {k: float(v) for k, v in progress_by_position(sum_N, tokens_N, buckets=3).items()}
    # 5 positions in 3 spans: [0, 2), [2, 3), [3, 5)
    assert list(out) == ["progress_pos_0", "progress_pos_1", "progress_pos_2"]
    assert out["progress_pos_0"] == pytest.approx(3.0 / 4.0) and out["progress_pos_1"] == 3.0
    assert np.isnan(out["progress_pos_2"])
    assert len(progress_by_position(sum_N, tokens_N, buckets=8)) == 5  # never more spans than positions


def test_acpo_off_is_plain_grpo_and_on_clips_per_token():
    """Off (no per-token bounds): the loss and gradient of the token-by-token float64 reference with the scalar
    ε_low / ε_high. On: a different ε for each token against the same reference clipping each token at its own ε (a
    loss that differs from the scalar one here); every token at one symmetric ε is the scalar loss bit for bit. (Off
    and on through the config switch of the real update: test_acpo_switch_in_updates.)"""
    logp_new, logp_old, logp_ref, advantage, mask = hand_built()
    args = dict(eps_low=EPS_LOW, eps_high=EPS_HIGH, beta=BETA, aggregation="token_mean")
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731

    def loss_and_grad(**kw):
        def loss_fn(new):
            return _grpo_loss(new, f32(logp_old), f32(logp_ref), advantage, mask, **{**args, **kw})

        (loss, _), grad = jax.value_and_grad(loss_fn, has_aux=True)(f32(logp_new))
        return float(loss), np.asarray(grad)

    off_loss, off_grad = loss_and_grad()
    ref_loss, ref_grad = reference(logp_new, logp_old, logp_ref, advantage, mask, "token_mean")
    np.testing.assert_allclose(off_loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(off_grad, ref_grad, rtol=1e-5, atol=1e-7)
    eps = np.random.default_rng(5).choice([0.02, 0.1, 0.3, 0.7], mask.shape)
    on_loss, on_grad = loss_and_grad(eps_low=f32(eps), eps_high=f32(eps))
    ref_loss, ref_grad = reference(logp_new, logp_old, logp_ref, advantage, mask, "token_mean", eps, eps)
    np.testing.assert_allclose(on_loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(on_grad, ref_grad, rtol=1e-5, atol=1e-7)
    assert abs(on_loss - off_loss) > 1e-3  # the per-token bounds clip other tokens than the scalar ones
    # with every token's ε equal to ε_low = ε_high, per-token bounds are the scalar ones
    sym = dict(args, eps_low=0.25, eps_high=0.25)
    scalar, _ = _grpo_loss(logp_new, logp_old, logp_ref, advantage, mask, **sym)
    tokenwise, _ = _grpo_loss(
        logp_new,
        logp_old,
        logp_ref,
        advantage,
        mask,
        **{**sym, "eps_low": np.full(mask.shape, 0.25), "eps_high": np.full(mask.shape, 0.25)},
    )
    assert float(scalar) == float(tokenwise)


@pytest.mark.e2e
@pytest.mark.parametrize("tiny", ["untied"], indirect=True)
def test_progress_advantage_and_acpo_in_updates(tiny):
    """The progress advantage η·(log π_θ − log π_ref) is exactly 0 while θ is the reference and non-zero once θ has
    moved. ACPO on the same updates: on-policy every ratio is 1 and every group's ε is acpo_min; off-policy (π_old from
    elsewhere, as on a second pass of μ ≥ 2) the groups' bounds spread inside [acpo_min, acpo_max], and are logged."""
    cfg, params = tiny
    prompt, prompt_mask, completion, completion_mask = scored_rows(cfg.vocab_size, rows=6)
    rng = np.random.default_rng(4)
    logp_old = np.where(completion_mask, np.log(rng.uniform(0.01, 0.99, completion_mask.shape)), 0.0)
    advantage = rng.normal(size=6).astype(np.float32)
    weight = np.asarray(token_weights(completion_mask, "seq_mean_token_mean"))
    fields = (prompt, prompt_mask, completion, completion_mask, logp_old.astype(np.float32), advantage, weight)
    batch = Rollouts(*(x.reshape(1, 6, *x.shape[1:]) for x in fields))
    optim = OptimConfig(name="sgd", lr=0.1)
    grpo = GRPOConfig(
        group_size=2,
        variants=("progress", "acpo"),
        variant_options=Options(progress=ProgressOptions(0.5)),
        remat="none",
        logprob_chunk=0,
    )
    update = make_update(cfg, grpo, optim, parallel.make_mesh(1))
    state = GRPOState(make_optimizer(optim).init(params), params)
    moved, state, first = update(params, state, batch, jnp.asarray(True))
    assert float(first["progress_mean"]) == 0.0
    positions = [k for k in range(PROGRESS_BUCKETS) if f"progress_pos_{k}" in first]
    assert positions == list(range(min(PROGRESS_BUCKETS, completion_mask.shape[1])))
    edges = np.linspace(0, completion_mask.shape[1], len(positions) + 1).round().astype(int)
    span_tokens = [completion_mask[:, lo:hi].sum() for lo, hi in zip(edges[:-1], edges[1:])]
    assert min(span_tokens) > 0  # every span holds completion tokens: no NaN below
    assert all(float(first[f"progress_pos_{k}"]) == 0.0 for k in positions)
    assert all(float(first[f"acpo_eps_{k}"]) == pytest.approx(0.1) for k in range(4))
    _, _, second = update(moved, state, batch, jnp.asarray(False))
    assert abs(float(second["progress_mean"])) > 1e-6
    # the per-position means recombine, weighted by their tokens, into the token mean (one microbatch)
    recombined = sum(float(second[f"progress_pos_{k}"]) * n for k, n in zip(positions, span_tokens)) / sum(span_tokens)
    assert recombined == pytest.approx(float(second["progress_mean"]), rel=1e-5)
    eps = [float(second[f"acpo_eps_{k}"]) for k in range(4)]
    assert all(0.1 - 1e-6 <= e <= 0.4 + 1e-6 for e in eps) and max(eps) > 0.1 + 1e-3  # random π_old: ratios spread


@pytest.mark.e2e
@pytest.mark.parametrize("tiny", ["untied"], indirect=True)
def test_acpo_switch_in_updates(tiny):
    """ACPO through its config switch (`grpo.acpo`) in the real update (β > 0): off, the acpo_* knobs are ignored (the
    update of the defaults, bit for bit, on- and off-policy); on, on-policy (every ρ = 1) it is the plain update bit
    for bit; off-policy (π_old a little off the policy, ratios within plain GRPO's ε = 0.2 but beyond ACPO's ≤ 0.05)
    its bounds clip and the update changes."""
    cfg, params = tiny
    prompt, prompt_mask, completion, completion_mask = scored_rows(cfg.vocab_size, rows=6)
    logp = jax.jit(lambda p: sequence_logprobs(cfg, p, prompt, prompt_mask, completion, completion_mask))(params)
    rng = np.random.default_rng(6)
    logp_old = np.where(completion_mask, np.asarray(logp) + rng.normal(0, 0.1, completion_mask.shape), 0.0)
    advantage = rng.normal(size=6).astype(np.float32)
    weight = np.asarray(token_weights(completion_mask, "seq_mean_token_mean"))
    fields = (prompt, prompt_mask, completion, completion_mask, logp_old.astype(np.float32), advantage, weight)
    batch = Rollouts(*(x.reshape(1, 6, *x.shape[1:]) for x in fields))
    optim = OptimConfig(name="sgd", lr=0.1)
    base = dict(group_size=2, beta=0.1, remat="none", logprob_chunk=0)
    state = GRPOState(make_optimizer(optim).init(params), jax.tree.map(lambda x: x * 1.05, params))
    knobs = dict(variant_options=Options(acpo=AcpoOptions(edges=(0.3,), scale=9.0, min=0.01, max=0.05)))

    def run(on_policy: bool, **grpo):
        update = make_update(cfg, GRPOConfig(**base, **grpo), optim, parallel.make_mesh(1))
        new, _, metrics = jax.device_get(update(params, state, batch, jnp.asarray(on_policy)))
        return new, {k: float(v) for k, v in metrics.items()}

    for on_policy in (True, False):
        plain, plain_m = run(on_policy)
        ignored, ignored_m = run(on_policy, **knobs)  # "acpo" not in variants: its options do nothing
        chex.assert_trees_all_equal(ignored, plain)
        assert ignored_m == plain_m and not any(k.startswith("acpo_eps_") for k in plain_m)
        acpo, acpo_m = run(on_policy, variants=("acpo",), **knobs)
        assert set(acpo_m) == set(plain_m) | {"acpo_eps_0", "acpo_eps_1"}
        if on_policy:
            chex.assert_trees_all_equal(acpo, plain)
            assert {k: acpo_m[k] for k in plain_m} == plain_m
            assert acpo_m["acpo_eps_0"] == acpo_m["acpo_eps_1"] == pytest.approx(0.01)
        else:
            assert plain_m["clip_fraction"] < 0.05 < acpo_m["clip_fraction"]
            assert abs(acpo_m["loss"] - plain_m["loss"]) > 1e-4
            assert not all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(acpo), jax.tree.leaves(plain)))
