"""GAE over generated tokens, whitening, explained variance (`esroll.grpo.gae`), the critic's clipped value loss, every
expected value worked out by hand in the docstrings below."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from esroll.critic import value_loss
from esroll.grpo.gae import explained_variance, gae, whiten

V = [0.5, 0.4, 0.6, 0.8]


def test_gae_by_hand_at_two_discounts_without_environment_tokens():
    """One completion of 4 tokens, the outcome 1 on the last. γ 0.9, λ 0.5 (γλ = 0.45):
    δ3 = 1 − 0.8 = 0.2, A3 = 0.2; δ2 = 0.9·0.8 − 0.6 = 0.12, A2 = 0.12 + 0.45·0.2 = 0.21;
    δ1 = 0.9·0.6 − 0.4 = 0.14, A1 = 0.14 + 0.45·0.21 = 0.2345; δ0 = 0.9·0.4 − 0.5 = −0.14,
    A0 = −0.14 + 0.45·0.2345 = −0.034475. γ = λ = 1: A_t = 1 − V_t."""
    reward, mask = np.array([[0, 0, 0, 1.0]]), np.ones((1, 4), bool)
    adv, ret = gae(reward, np.array([V]), mask, 0.9, 0.5)
    np.testing.assert_allclose(adv, [[-0.034475, 0.2345, 0.21, 0.2]], atol=1e-12)
    np.testing.assert_allclose(ret, [[0.465525, 0.6345, 0.81, 1.0]], atol=1e-12)
    adv, ret = gae(reward, np.array([V]), mask, 1.0, 1.0)
    np.testing.assert_allclose(adv, [[0.5, 0.6, 0.4, 0.2]], atol=1e-12)
    np.testing.assert_allclose(ret, [[1.0, 1.0, 1.0, 1.0]], atol=1e-12)


def test_gae_skips_environment_tokens_by_hand():
    """An episode of two turns, each two action tokens, the environment's two tokens between them (values 9 there,
    never read); the first turn's reward 0.1 on its last action token, the outcome 1 on the last. The action tokens
    carry the values of the test above, so with γ 0.9, λ 0.5: A3 = 0.2, A2 = 0.21 (as above); δ1 = 0.1 + 0.9·0.6 −
    0.4 = 0.24 (the first turn's last token bootstraps from the second turn's first), A1 = 0.24 + 0.45·0.21 = 0.3345;
    δ0 = 0.9·0.4 − 0.5 = −0.14, A0 = −0.14 + 0.45·0.3345 = 0.010525. γ = λ = 1: the reward to go, 1.1, 1.1, 1, 1,
    minus the value."""
    reward = np.array([[0, 0.1, 0, 0, 0, 1.0]])
    value = np.array([[0.5, 0.4, 9, 9, 0.6, 0.8]])
    mask = np.array([[1, 1, 0, 0, 1, 1]], bool)
    adv, ret = gae(reward, value, mask, 0.9, 0.5)
    np.testing.assert_allclose(adv, [[0.010525, 0.3345, 0, 0, 0.21, 0.2]], atol=1e-12)
    np.testing.assert_allclose(ret, [[0.510525, 0.7345, 0, 0, 0.81, 1.0]], atol=1e-12)
    adv, _ = gae(reward, value, mask, 1.0, 1.0)
    np.testing.assert_allclose(adv, [[0.6, 0.7, 0, 0, 0.4, 0.2]], atol=1e-12)


def test_gae_at_one_is_the_return_to_go_minus_the_value_on_random_rows():
    rng = np.random.default_rng(0)
    reward, value = rng.normal(size=(5, 9)), rng.normal(size=(5, 9))
    mask = rng.random((5, 9)) < 0.6
    adv, ret = gae(reward, value, mask, 1.0, 1.0)
    for b in range(5):
        pos = np.flatnonzero(mask[b])
        to_go = np.cumsum(reward[b, pos][::-1])[::-1]
        np.testing.assert_allclose(adv[b, pos], to_go - value[b, pos], atol=1e-12)
        np.testing.assert_allclose(ret[b, pos], to_go, atol=1e-12)
        assert not adv[b, ~mask[b]].any() and not ret[b, ~mask[b]].any()


def test_whitening_uses_the_masked_tokens_only():
    """x = 1, 2, 3 on the mask (and 100, 7 off it): mean 2, sample variance 1, so −1, 0, 1 (÷ √(1 + 1e-8)); off the
    mask 0. One masked entry: nothing to whiten, 0."""
    x = np.array([[1.0, 2.0, 100.0], [3.0, 7.0, 0.0]])
    mask = np.array([[1, 1, 0], [1, 0, 0]], bool)
    np.testing.assert_allclose(whiten(x, mask), [[-1, 0, 0], [1, 0, 0]], atol=1e-7)
    assert not whiten(x, np.eye(2, 3, dtype=bool) & (np.arange(3) == 0)).any()


def test_clipped_value_loss_by_hand():
    """V = 1, 0 from V_old = 0.5, 0.5, returns 2, 0, ε 0.2. Token 0: (1 − 2)² = 1; clipped to 0.7, (0.7 − 2)² = 1.69;
    the larger, 1.69. Token 1: (0 − 0)² = 0; clipped to 0.3, 0.09. ½ · (1.69 + 0.09) / 2 = 0.445; a third token off
    the mask changes nothing."""
    v, old, ret = jnp.array([[1.0, 0.0, 5.0]]), jnp.array([[0.5, 0.5, 0.0]]), jnp.array([[2.0, 0.0, -5.0]])
    mask = jnp.array([[True, True, False]])
    assert float(value_loss(v, old, ret, mask, 0.2)) == pytest.approx(0.445, abs=1e-6)


def test_explained_variance():
    ret = np.array([[1.0, 0.0, 3.0, 99.0]])
    mask = np.array([[1, 1, 1, 0]], bool)
    assert explained_variance(ret, ret, mask) == pytest.approx(1.0)
    assert explained_variance(np.full_like(ret, 4 / 3), ret, mask) == pytest.approx(0.0)
    assert np.isnan(explained_variance(ret, np.ones_like(ret), mask))


def test_the_gae_estimator_places_rewards_and_returns_by_hand():
    """Through the registered estimator (`grpo.advantage = "gae"`, γ = λ = 1, no whitening): prompt 0's two
    completions, rewards 1 and 0, of 3 and 2 tokens, values 0.5, 0.4, 0.6 and 0.2, 0.3: A = 1 − V and 0 − V, returns
    1 and 0 on every token. An episode (prompt 1, one row) of two turns with the hand example's values and turn
    rewards 0.1 and 1 at γ 0.9, λ 0.5: the advantages of `test_gae_skips_environment_tokens_by_hand`."""
    from esroll.agents.multiturn import Turns
    from esroll.grpo.advantages import Group, estimate
    from esroll.grpo.estimators.gae import GaeOptions

    mask = np.array([[[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]]], bool)
    values = np.array([[[0.5, 0.4, 0.6, 0, 0, 0], [0.2, 0.3, 0, 0, 0, 0]]])
    g = Group(np.array([[1.0, 0.0]]), token_mask=mask, values=values)
    est = estimate("gae", g, GaeOptions(gamma=1.0, lam=1.0, whiten=False))
    np.testing.assert_allclose(est.advantage[0, 0, :3], [0.5, 0.6, 0.4], atol=1e-6)
    np.testing.assert_allclose(est.advantage[0, 1, :2], [-0.2, -0.3], atol=1e-6)
    np.testing.assert_allclose(est.returns[0], [[1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]], atol=1e-12)
    whitened = estimate("gae", g, GaeOptions(gamma=1.0, lam=1.0)).advantage[mask]
    assert abs(whitened.mean()) < 1e-6 and abs(whitened.std(ddof=1) - 1) < 1e-6
    turns = Turns(np.array([[0, 4]]), np.array([[2, 6]]), np.array([[0.1, 1.0]]), np.array([2]), [["s0", "s1"]])
    episode = Group(
        np.array([[1.1]]),
        token_mask=np.array([[[1, 1, 0, 0, 1, 1]]], bool),
        values=np.array([[[0.5, 0.4, 9, 9, 0.6, 0.8]]]),
        turns=turns,
    )
    est = estimate("gae", episode, GaeOptions(gamma=0.9, lam=0.5, whiten=False))
    np.testing.assert_allclose(est.advantage[0, 0], [0.010525, 0.3345, 0, 0, 0.21, 0.2], atol=1e-6)
    assert est.metrics["value_prompt"] == 0.5


def test_ppo_policy_gradient_against_a_cache_free_reference(tmp_path):
    """One PPO minibatch gradient through the trainer's path (the critic's rollout values, the registered "gae"
    estimator, token advantages, batches, the compiled GRPO gradient; on-policy, so every ratio is 1 and the clip is
    inactive; β 0) against the gradient written here from cache-free forwards: V_t = w·h_t + b over the policy's own
    final hidden states (a critic from the policy, its head drawn here), GAE by the backward recursion over each
    completion (γ 0.9, λ 0.8, the reward on its last token), whitened over the valid tokens (Bessel's variance),
    and −∇ Σ_t A_t log π(y_t) / (len · B)."""
    from conftest import build_tiny_hf
    from esroll import parallel
    from esroll.config import from_config_dict
    from esroll.critic import critic_params
    from esroll.grpo import advantages, ppo
    from esroll.grpo.gae import WHITEN_EPS
    from esroll.grpo.method import estimator_group, make_batches, token_advantages
    from esroll.grpo.update import make_gradient
    from esroll.models import forward, load_hf
    from test_grpo import full_softmax_logprobs, scored_rows

    build_tiny_hf("qwen3", tmp_path, initializer_range=0.2)
    cfg, params = load_hf(tmp_path)
    rng = np.random.default_rng(3)
    w = rng.normal(0, 0.3, (cfg.hidden_size, 1)).astype(np.float32)
    critic = {**critic_params(params), "value_head": jnp.asarray(w), "value_bias": jnp.asarray([0.1], jnp.float32)}
    X, M = 2, 2
    prompt, prompt_mask, completion, completion_mask = scored_rows(cfg.vocab_size, rows=X * M)
    B, P, N = X * M, prompt.shape[1], completion.shape[1]
    rewards = np.array([[1.0, 0.0], [0.0, 1.0]])
    length = completion_mask.sum(1)
    out = types.SimpleNamespace(
        prompt_BxP=prompt, prompt_mask_BxP=prompt_mask, tokens_BxN=completion, length_B=length,
        logprobs_BxN=np.zeros((B, N), np.float32), loss_mask_BxN=None, turns=None,
    )  # fmt: skip
    g = from_config_dict({"grpo": {"advantage": "gae", "beta": 0.0, "group_size": M, "adv": {"gae": {
        "gamma": 0.9, "lam": 0.8}}}}).grpo  # fmt: skip
    mesh = parallel.make_mesh(1)
    old = ppo.rollout_values(cfg, critic, out, mesh)
    needs = advantages.ESTIMATORS.lookup("gae").needs
    est = advantages.estimate("gae", estimator_group(out, rewards, completion_mask, None, 0, 0, needs, old),
                              advantages.options_of(g), None)  # fmt: skip
    adv = token_advantages("gae", est.advantage, completion_mask, M)
    (batch,) = make_batches(out, completion_mask, adv, np.ones((B, N), np.float32), g.aggregation, 1, 1, mesh)
    grads, _ = make_gradient(cfg, g, mesh)(params, None, batch, jnp.asarray(True))

    # the reference: values, GAE and whitening by hand in float64, then the score-function loss
    tokens, mask = np.concatenate([prompt, completion], 1), np.concatenate([prompt_mask, completion_mask], 1)
    h = np.asarray(forward(cfg, params, jnp.asarray(tokens), mask_BxT=jnp.asarray(mask), return_hidden=True)[0])
    value = (h.astype(np.float64) @ w[:, 0] + 0.1)[:, P - 1 : P - 1 + N]
    np.testing.assert_allclose(np.where(completion_mask, old, 0), np.where(completion_mask, value, 0), atol=1e-5)
    a = np.zeros((B, N))
    for b in range(B):
        n, carry = int(length[b]), 0.0
        for t in reversed(range(n)):
            r = rewards.flat[b] if t == n - 1 else 0.0
            nxt = value[b, t + 1] if t + 1 < n else 0.0
            carry = r + 0.9 * nxt - value[b, t] + 0.9 * 0.8 * carry
            a[b, t] = carry
    valid = a[completion_mask]
    a = np.where(completion_mask, (a - valid.mean()) / np.sqrt(valid.var(ddof=1) + WHITEN_EPS), 0.0)
    weight = completion_mask / (length[:, None] * B)

    def loss(p):
        logp, _ = full_softmax_logprobs(cfg, p, prompt, prompt_mask, completion, completion_mask)
        return -(jnp.asarray(a * weight, jnp.float32) * logp).sum()

    expected = jax.grad(loss)(params)
    largest = max(float(np.abs(x).max()) for x in jax.tree.leaves(expected))
    for x, y in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-4 * largest)
    assert largest > 0


def test_a_value_head_on_the_policys_trunk_by_hand(tmp_path):
    """`grpo.adv.gae.shared_trunk`: the critic is a value head alone ({value_head, value_bias}); its values are
    w·h_t + b over the policy's own final hidden states (h from a cache-free forward here), and one update of it with
    plain SGD (lr 1) on the clipped value loss, its old values the current ones (so the clip is inactive), moves
    w by −Σ (V − R)·h / n and b by −Σ (V − R) / n over the n positions before the completion tokens, R drawn here.
    The trunk is an argument the update reads and never returns."""
    import optax

    from conftest import build_tiny_hf
    from esroll import parallel
    from esroll.config import from_config_dict
    from esroll.critic import HEAD, TRUNK, make_value_update
    from esroll.experiment import check_names
    from esroll.grpo import ppo
    from esroll.models import forward, load_hf
    from test_grpo import scored_rows

    build_tiny_hf("qwen3", tmp_path, initializer_range=0.2)
    cfg, params = load_hf(tmp_path)
    run = check_names(from_config_dict({"grpo": {"advantage": "gae", "adv": {"gae": {"shared_trunk": True}}}}))
    assert ppo.shares_trunk(run.grpo) and sorted(ppo.init_critic(run.grpo, params)[0]) == sorted(HEAD)
    rng = np.random.default_rng(4)
    w = rng.normal(0, 0.3, (cfg.hidden_size, 1)).astype(np.float32)
    head = {"value_head": jnp.asarray(w), "value_bias": jnp.asarray([0.1], jnp.float32)}
    prompt, prompt_mask, completion, completion_mask = scored_rows(cfg.vocab_size, rows=3)
    B, P, N = 3, prompt.shape[1], completion.shape[1]
    out = types.SimpleNamespace(
        prompt_BxP=prompt, prompt_mask_BxP=prompt_mask, tokens_BxN=completion, length_B=completion_mask.sum(1)
    )
    got = ppo.rollout_values(cfg, head, out, parallel.make_mesh(1), params)
    tokens, mask = np.concatenate([prompt, completion], 1), np.concatenate([prompt_mask, completion_mask], 1)
    h = np.asarray(forward(cfg, params, jnp.asarray(tokens), mask_BxT=jnp.asarray(mask), return_hidden=True)[0])
    value = h.astype(np.float64) @ w[:, 0] + 0.1
    np.testing.assert_allclose(got, np.where(completion_mask, value[:, P - 1 : P - 1 + N], 0), atol=1e-5)

    at = np.zeros((B, P + N), bool)
    at[:, P - 1 : P - 1 + N] = completion_mask
    ret = rng.normal(0, 1, (B, P + N)).astype(np.float32)
    value_cfg = dataclasses.replace(cfg, head="value")
    update = make_value_update(value_cfg, optax.sgd(1.0), clip=0.2)
    trunk = {k: params[k] for k in TRUNK}
    new, _, loss = update(head, optax.sgd(1.0).init(head), tokens, mask, at, value.astype(np.float32), ret, trunk=trunk)
    assert sorted(new) == sorted(HEAD)
    err = np.where(at, value - ret, 0.0)
    n = at.sum()
    np.testing.assert_allclose(
        np.asarray(new["value_head"])[:, 0], w[:, 0] - (err[..., None] * h).sum((0, 1)) / n, atol=1e-5
    )
    np.testing.assert_allclose(np.asarray(new["value_bias"]), [0.1 - err.sum() / n], atol=1e-5)
    assert float(loss) == pytest.approx(0.5 * (err**2).sum() / n, rel=1e-4)


@pytest.mark.e2e
@pytest.mark.parametrize("spec", ["step_level:quick,ppo", "agents:quick,ppo", "step_level:quick,ppo,shared"])
def test_the_shipped_ppo_configs_train_a_critic(spec, tmp_path):
    """configs/step_level.py:quick,ppo and configs/agents.py:quick,ppo: two steps, the critic's values move off their
    zero start and its loss is logged (on episodes, from the turns' rewards). With a value head on the policy's trunk
    (`shared_trunk`), the exported critic is the final policy's trunk with the trained head."""
    import importlib

    from conftest import REPO
    from esroll.config import from_config_dict
    from esroll.experiment import check_names
    from esroll.metrics import read_metrics
    from esroll.train import train_and_evaluate

    module, variant = spec.split(":")
    shared = variant.endswith(",shared")
    cd = importlib.import_module(f"configs.{module}").get_config(variant.removesuffix(",shared"))
    cd.model.path = str(REPO / cd.model.path)
    if shared:
        cd.grpo.adv = {"gae": {"shared_trunk": True}}
    cfg = check_names(from_config_dict(cd.to_dict()))
    assert cfg.method == "grpo" and cfg.grpo.advantage == "gae"
    train_and_evaluate(cfg, tmp_path, progress=False)
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "value_loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and steps[0]["value_prompt"] == 0.0 and steps[1]["value_prompt"] != 0.0
    assert all(np.isfinite(r["value_loss"]) and r["value_loss"] >= 0 for r in steps)
    if cfg.train.export:  # the trained critic beside the policy, as a value model that a later run can start from
        from esroll.models import load_hf

        critic_cfg, critic = load_hf(tmp_path / "final_critic")
        assert critic_cfg.head == "value" and np.asarray(critic["value_head"]).any()
        if shared:
            _, policy = load_hf(tmp_path / "final")
            for a, b in zip(jax.tree.leaves(policy["layers"]), jax.tree.leaves(critic["layers"]), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
