"""The critic (`esroll.critic`): a value model of the policy's architecture, against transformers' token-classification
models with one label (the values at every position of a left-padded batch), its checkpoints both ways, and a critic
made from a policy."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers

from conftest import FAMILIES, build_tiny_hf, padded_batch, torch_logits
from esroll.critic import critic_from_policy, values
from esroll.models import forward, load_hf, save_hf

jit_values = jax.jit(values, static_argnums=0)


def torch_values(model, tokens, mask) -> np.ndarray:
    return torch_logits(model, tokens, mask)[..., 0]


@pytest.fixture(scope="module", params=FAMILIES)
def value_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"value_{request.param}")
    model = build_tiny_hf(request.param, folder, value=True)
    with torch.no_grad():  # a score head far from its initialisation, bias included
        model.score.weight.normal_(0.0, 0.5)
        model.score.bias.fill_(0.3)
    model.save_pretrained(str(folder))
    return request.param, folder, model


def test_values_match_transformers_token_classification(value_model):
    family, folder, model = value_model
    cfg, params = load_hf(folder)
    assert (cfg.family, cfg.head) == (family, "value") and set(params) >= {"value_head", "value_bias"}
    assert "lm_head" not in params
    tokens, mask = padded_batch(cfg.vocab_size)
    ours = np.asarray(jit_values(cfg, params, jnp.asarray(tokens), mask_BxT=jnp.asarray(mask)))
    ref = torch_values(model, tokens, mask)
    assert np.abs(ours - ref)[mask].max() < 1e-4, family


def test_a_saved_critic_loads_in_transformers_with_the_same_values(value_model, tmp_path):
    family, folder, _ = value_model
    cfg, params = load_hf(folder)
    save_hf(tmp_path / "critic", cfg, params)
    written = json.loads((tmp_path / "critic" / "config.json").read_text())
    assert written["architectures"][0].endswith("ForTokenClassification") and len(written["id2label"]) == 1
    again = transformers.AutoModelForTokenClassification.from_pretrained(str(tmp_path / "critic")).eval()
    tokens, mask = padded_batch(cfg.vocab_size)
    ours = np.asarray(jit_values(cfg, params, jnp.asarray(tokens), mask_BxT=jnp.asarray(mask)))
    assert np.abs(ours - torch_values(again, tokens, mask))[mask].max() < 1e-4, family


def test_a_critic_from_a_policy_shares_its_trunk_and_starts_at_zero(tiny_model):
    """Its values are w·h + b over the policy's own final hidden states: 0 at the start (a zero head), and, with a
    head set in the test, the product computed here from the policy's hidden states."""
    family, folder, _ = tiny_model
    cfg, params = load_hf(folder)
    critic_cfg, critic = critic_from_policy(cfg, params)
    assert critic_cfg.head == "value" and critic["embed"] is params["embed"]
    tokens, mask = padded_batch(cfg.vocab_size)
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    assert not np.asarray(jit_values(critic_cfg, critic, tokens, mask_BxT=mask)).any()
    w = np.random.default_rng(1).normal(size=(cfg.hidden_size, 1)).astype(np.float32)
    critic = {**critic, "value_head": jnp.asarray(w), "value_bias": jnp.asarray([0.25], jnp.float32)}
    h, _ = jax.jit(forward, static_argnums=0, static_argnames="return_hidden")(
        cfg, params, tokens, mask_BxT=mask, return_hidden=True
    )
    expected = np.asarray(h, np.float64) @ w[:, 0].astype(np.float64) + 0.25
    np.testing.assert_allclose(np.asarray(jit_values(critic_cfg, critic, tokens, mask_BxT=mask)), expected, atol=1e-5)


def test_a_value_model_is_refused_where_logits_are_meant_and_a_wrong_label_count_in_one_line(value_model, tmp_path):
    _, folder, _ = value_model
    cfg, params = load_hf(folder)
    with pytest.raises(ValueError, match="a value model has no vocabulary head"):
        forward(cfg, params, jnp.ones((1, 3), jnp.int32))
    bad = json.loads((folder / "config.json").read_text())
    bad["id2label"] = {"0": "a", "1": "b"}
    (tmp_path / "config.json").write_text(json.dumps(bad))
    from esroll.models import ModelConfig

    with pytest.raises(ValueError, match=r"config\.json: field 'id2label': a value model has one label, not 2$"):
        ModelConfig.from_json_file(tmp_path / "config.json")


def test_a_critic_starts_from_the_checkpoint_the_config_names(value_model, tmp_path):
    """`grpo.adv.gae.critic_path`: a value model is taken as it is; a causal LM gives its trunk and a zero head; a
    checkpoint of another architecture, a missing folder, and the key under an estimator that reads no values are each
    refused in one line naming the key."""
    import dataclasses

    from esroll import parallel
    from esroll.config import from_config_dict
    from esroll.errors import InputError
    from esroll.grpo import ppo

    family, folder, _ = value_model
    cfg, params = load_hf(folder)
    policy_cfg = dataclasses.replace(cfg, head="lm")
    mesh = parallel.make_mesh(1)

    def grpo(path, advantage="gae"):
        return from_config_dict({"grpo": {"advantage": advantage, "adv": {"gae": {"critic_path": str(path)}}}}).grpo

    critic = ppo.load_critic(grpo(folder), policy_cfg, mesh, jnp.float32)
    assert set(critic) == set(params)
    for (path, leaf), (_, got) in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves_with_path(critic)
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(leaf), err_msg=jax.tree_util.keystr(path))
    assert ppo.load_critic(grpo(""), policy_cfg, mesh, jnp.float32) is None  # the policy's trunk stands
    policy_folder = tmp_path / "policy"
    build_tiny_hf(family, policy_folder)
    _, policy = load_hf(policy_folder)
    from_lm = ppo.load_critic(grpo(policy_folder), policy_cfg, mesh, jnp.float32)
    np.testing.assert_array_equal(np.asarray(from_lm["embed"]), np.asarray(policy["embed"]))
    assert not np.asarray(from_lm["value_head"]).any() and not np.asarray(from_lm["value_bias"]).any()
    wider = dataclasses.replace(policy_cfg, num_layers=cfg.num_layers + 1)
    with pytest.raises(
        InputError, match=r"^config: 'grpo.adv.gae.critic_path': .* is not of the policy's architecture"
    ):
        ppo.load_critic(grpo(folder), wider, mesh, jnp.float32)
    with pytest.raises(InputError, match=r"^config: 'grpo.adv.gae.critic_path': "):
        ppo.load_critic(grpo(tmp_path / "absent"), policy_cfg, mesh, jnp.float32)
    from esroll.experiment import unread_keys

    plain = from_config_dict({"grpo": {"adv": {"gae": {"critic_path": str(folder)}}}})  # plain GRPO reads no values
    assert "grpo.adv.gae.critic_path" in unread_keys(plain)
    assert "grpo.adv.gae.critic_path" not in unread_keys(from_config_dict({"grpo": {"advantage": "gae"}}))


@pytest.mark.e2e
def test_the_critic_learns_known_values_and_explains_more_variance(tmp_path):
    """Four prompts whose outcome is a coin of known bias, p = 0.1, 0.4, 0.7, 0.9, whatever the three tokens after
    them (drawn uniformly: a fixed policy whose success depends on the prompt alone). The value before the first
    generated token must approach p (the mean return from there): within 0.1 after 200 updates of 64 rows, the
    learning rate falling from 1e-2 to 1e-3 (each prompt's mean of ~3,200 coins has a standard error near 0.008). Explained variance starts at 0 (every value 0)
    and must pass 0.25 (the most any critic can reach here is Var(p) / Var(R) = 0.092 / 0.249 = 0.37)."""
    from esroll.critic import make_value_update
    from esroll.grpo.gae import explained_variance

    build_tiny_hf("qwen3", tmp_path)
    cfg, policy = load_hf(tmp_path)
    critic_cfg, critic = critic_from_policy(cfg, policy)
    optimizer = optax.adam(optax.linear_schedule(1e-2, 1e-3, 200))
    opt_state = optimizer.init(critic)
    update = make_value_update(critic_cfg, optimizer, clip=0.2)
    p = np.array([0.1, 0.4, 0.7, 0.9])
    prompts = np.array([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16], [17, 18, 19, 20]])
    P, N, B = 4, 3, 64
    at = np.zeros((B, P + N), bool)
    at[:, P - 1 : P + N - 1] = True  # the value before each generated token
    rng = np.random.default_rng(0)
    read = jax.jit(values, static_argnums=0)
    ev = []
    for _ in range(200):
        kind = rng.integers(0, 4, B)
        tokens = np.concatenate([prompts[kind], rng.integers(21, cfg.vocab_size, (B, N))], 1)
        outcome = (rng.random(B) < p[kind]).astype(np.float32)
        returns = np.where(at, outcome[:, None], 0.0).astype(np.float32)  # γ = λ = 1: the outcome
        old = np.asarray(read(critic_cfg, critic, jnp.asarray(tokens)))
        ev.append(explained_variance(old, returns, at))
        critic, opt_state, _ = update(critic, opt_state, tokens, np.ones_like(at), at, old, returns)
    tokens = np.concatenate([prompts, np.full((4, N), 21)], 1)
    at_prompt = np.asarray(read(critic_cfg, critic, jnp.asarray(tokens)))[:, P - 1]
    np.testing.assert_allclose(at_prompt, p, atol=0.1)
    assert ev[0] == 0.0 and np.mean(ev[-20:]) > 0.25, (ev[0], np.mean(ev[-20:]))
