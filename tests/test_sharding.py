"""The ("data", "model") mesh on conftest's 8 CPU devices: the sharding rules, tensor-parallel forwards of perturbed
members and the sharded ES update equal one device; float32 masters under a bf16 model keep small updates."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from esroll import es, parallel, sharding
from esroll.es.method import compiled_strategy, state_shardings
from esroll.models import ModelConfig, Perturbation, forward, model_config
from esroll.models import abstract_params as param_shapes_tree

from conftest import quick_config

# hidden 64, 8 heads / 4 kv heads of 16, MLP 128, vocab 128: every split of the 2x4 mesh divides.
CFG = ModelConfig(
    family="qwen3",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=8,
    num_kv_heads=4,
    head_dim=16,
    rope_theta=1e6,
    qk_norm=True,
)
ES = es.ESConfig(population=8, rank=2, sigma=0.05)
MESHES = [(2, 4)]  # model axis 4; 8 × 1 and 4 × 2 in test_rollout, test_es and test_train


def random_params(cfg: ModelConfig, seed: int = 0) -> dict:
    shapes = es.noise.flatten(param_shapes_tree(cfg))
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return es.noise.unflatten(
        {
            path: 1.0 + 0.1 * jax.random.normal(k, x.shape)
            if path.endswith("norm")
            else 0.1 * jax.random.normal(k, x.shape)
            for k, (path, x) in zip(keys, shapes.items())
        }
    )


def test_rules_split_heads_mlp_and_vocab_over_model_and_masters_over_data_too():
    mesh = parallel.make_mesh(8, model=2)
    shapes = param_shapes_tree(model_config("qwen3-8b", layers=2))
    compute, master = sharding.compute_shardings(mesh, shapes), sharding.master_shardings(mesh, shapes)
    assert compute["layers"]["q"].spec == P(None, None, "model")
    assert compute["layers"]["o"].spec == P(None, "model")
    assert compute["layers"]["down"].spec == P(None, "model")
    assert compute["embed"].spec == P("model") and compute["lm_head"].spec == P(None, "model")
    assert compute["layers"]["attn_norm"].spec == P()
    assert master["layers"]["gate"].spec == P(None, "data", "model")
    assert master["layers"]["down"].spec == P(None, "model", "data")
    # an axis that does not divide a dimension leaves it whole: 8 kv heads' 1024 columns over 3 devices
    odd = jax.sharding.Mesh(np.array(jax.devices()[:6]).reshape(2, 3), ("data", "model"))
    assert sharding.compute_shardings(odd, shapes)["layers"]["k"].spec == P()
    # a model axis of 1 leaves the decoding copy replicated
    assert sharding.compute_shardings(parallel.make_mesh(8), shapes)["layers"]["q"].spec == P()


def _perturbed_logits(mesh, params, deltas, tokens, member):
    compute = sharding.place(params, sharding.compute_shardings(mesh, params))
    deltas = sharding.place(deltas, sharding.delta_shardings(mesh, deltas, params))
    fn = jax.jit(lambda p, d, t, m: forward(CFG, p, t, perturb=Perturbation(d, m))[0])
    return np.asarray(fn(compute, deltas, parallel.put_rows(mesh, tokens), parallel.put_rows(mesh, member)))


def test_tensor_parallel_perturbed_logits_and_es_update_equal_one_device():
    params = random_params(CFG)
    strategy = es.make_strategy(ES, optax.adam(1e-2))
    state = strategy.init(params, jax.random.key(1))
    deltas = strategy.ask(state, params)
    tokens = np.asarray(jax.random.randint(jax.random.key(2), (8, 12), 0, CFG.vocab_size), np.int32)
    member = np.arange(8, dtype=np.int32)
    fitness = jnp.asarray(np.linspace(0.0, 1.0, ES.population), jnp.float32)
    one = parallel.make_mesh(1)
    ref_logits = _perturbed_logits(one, params, deltas, tokens, member)
    ref_params = jax.device_get(strategy.tell(params, state, fitness)[0])
    for data, model in MESHES:
        mesh = parallel.make_mesh(8, model=model)
        np.testing.assert_allclose(_perturbed_logits(mesh, params, deltas, tokens, member), ref_logits, atol=2e-5)
        optim = dataclasses.replace(quick_config().optimizer, name="adam", lr=1e-2)
        tell = compiled_strategy(ES, optim, mesh).tell
        masters = sharding.place(jax.tree.map(np.array, params), sharding.master_shardings(mesh, params))  # donated
        sharded_state = jax.jit(
            compiled_strategy(ES, optim, mesh).init, out_shardings=state_shardings(ES, optim, mesh, params)
        )(masters, parallel.put_replicated(mesh, jax.random.key(1)))
        new, new_state, _ = tell(masters, sharded_state, parallel.put_replicated(mesh, fitness))
        chex.assert_trees_all_close(jax.device_get(new), ref_params, atol=1e-6)
        assert new["layers"]["up"].sharding.spec == sharding.master_shardings(mesh, params)["layers"]["up"].spec
        mu = new_state.opt_state[0].mu
        assert set(mu) == {"layers"}, "no optimizer state for frozen leaves (embed, lm_head, norms)"
        assert mu["layers"]["up"].addressable_shards[0].data.size * 8 == mu["layers"]["up"].size
