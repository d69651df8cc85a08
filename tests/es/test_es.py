"""ES mechanics: shaping, noise layout and determinism, perturbed forward, update = Σ w_i E_i, chunks, devices, NaNs."""

from __future__ import annotations

import dataclasses
import functools
import zlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from esroll import es
from esroll.errors import ConfigError
from esroll.es import estimators, noise
from esroll.models import LowRank, Perturbation, forward, load_hf

from conftest import build_tiny_hf

# Jitted once per (config, tree structure) and shared by the tests: compiling the generator dominates their runtime.
member_deltas = jax.jit(es.member_deltas, static_argnums=0)
estimate = jax.jit(es.estimate, static_argnums=0)
TOY = es.ESConfig(method="eggroll", population=8, rank=2, sigma=0.1, shaping="raw", dense_patterns=("bias", ".*norm"))


def toy_params(seed=0):
    """Single matrices, a layer-stacked matrix and vectors (stacked and single)."""
    rng = np.random.default_rng(seed)
    shapes = {"w1": (5, 7), "bias": (7,), "embed": (11, 5), "layers": {"w": (3, 7, 6), "norm": (3, 7)}}
    return jax.tree.map(
        lambda s: jnp.asarray(rng.normal(size=s), jnp.float32), shapes, is_leaf=lambda x: isinstance(x, tuple)
    )


def with_factors(cfg, fn):
    """jit(fn) that also returns the step's regenerated factors (one compile: XLA draws them once for both)."""

    def both(state, params, *args):
        directions = jnp.arange(estimators.num_directions(cfg.method, cfg.population))
        return fn(state, params, *args), es.step_factors(cfg, state.key, state.step, params, directions)

    return jax.jit(both)


def explicit_E(cfg, factors):
    """{path: E [K, (L,) *shape]} in numpy from factors: A Bᵀ/√r, or ε."""
    out = {}
    for path, f in noise.flatten(factors).items():
        if isinstance(f, LowRank):
            a, b = np.asarray(f.a, np.float64), np.asarray(f.b, np.float64)
            spec = "lkir,lkor->klio" if noise.is_stacked(path) else "kir,kor->kio"
            out[path] = np.einsum(spec, a, b) / np.sqrt(cfg.rank)
        else:
            out[path] = np.moveaxis(np.asarray(f, np.float64), 1, 0) if noise.is_stacked(path) else np.asarray(f)
    return out


# ---------------------------------------------------------------- config and leaf selection


def test_config_errors_name_the_field():
    for kwargs, field in [
        ({"sigma": 0.0}, "sigma"),
        ({"rank": 0}, "rank"),
        ({"chunk_size": -1}, "chunk_size"),
        ({"frozen_patterns": ("(",)}, "frozen_patterns"),
        ({"min_valid_fraction": 1.5}, "min_valid_fraction"),
    ]:
        with pytest.raises(ConfigError, match=rf"^ESConfig: invalid value for '{field}'"):
            es.ESConfig(**kwargs)
    # Names are looked up in the registries by the factory: a config built by hand is refused before anything runs.
    for kwargs, field in [
        ({"method": "cma"}, "method"),
        ({"method": "eggroll", "population": 5}, "population"),
        ({"shaping": "softmax"}, "shaping"),
        ({"prompt_shaping": "softmax"}, "prompt_shaping"),
    ]:
        with pytest.raises(ConfigError, match=rf"^ESConfig: invalid value for '{field}'") as e:
            es.make_strategy(es.ESConfig(**kwargs), optax.sgd(1.0))
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="perturb at least one parameter leaf"):
        es.make_strategy(es.ESConfig(frozen_patterns=(".*",)), optax.sgd(1.0)).init(toy_params(), jax.random.key(0))
    with pytest.raises(ConfigError, match="frozen_patterns.*freeze 'embed'"):
        es.make_strategy(es.ESConfig(frozen_patterns=("lm_head",)), optax.sgd(1.0)).init(
            toy_params(), jax.random.key(0)
        )


def test_strategy_functions_are_plain_jittable_functions():
    """make_strategy closes over config and optimizer: init / ask / tell jit with no static arguments and give the
    same result as the module-level functions they are built from."""
    params = toy_params()
    strategy = es.make_strategy(TOY, optax.sgd(0.1))
    state = jax.jit(strategy.init)(params, jax.random.key(5))
    chex.assert_trees_all_equal(jax.jit(strategy.ask)(state, params), member_deltas(TOY, state.key, 0, params))
    f = jnp.arange(8.0)
    new, state1, _ = jax.jit(strategy.tell)(params, state, f)
    grad, _ = estimate(TOY, state.key, 0, params, f)
    chex.assert_trees_all_close(new, jax.tree.map(lambda p, g: p + 0.1 * g, params, grad), atol=1e-6)
    assert int(state1.step) == 1


def test_leaf_kinds_defaults_and_patterns():
    params = toy_params()
    assert es.strategy.leaf_kinds(es.ESConfig(), params) == {"w1": "lowrank", "layers/w": "lowrank"}
    cfg = es.ESConfig(dense_patterns=(".*norm", "bias"), frozen_patterns=("embed", "w1"))
    assert es.strategy.leaf_kinds(cfg, params) == {"bias": "dense", "layers/w": "lowrank", "layers/norm": "dense"}


# ---------------------------------------------------------------- noise


def test_antithetic_pairs_and_determinism():
    params = toy_params()
    d = member_deltas(TOY, jax.random.key(3), 5, params)
    for x, member_axis in [(d["w1"].a, 0), (d["layers"]["w"].a, 1), (d["bias"], 0), (d["layers"]["norm"], 1)]:
        x = np.moveaxis(np.asarray(x), member_axis, 0)
        np.testing.assert_array_equal(x[0::2], -x[1::2])
        assert np.all(x[0::2] != np.roll(x[0::2], 1, axis=0))  # directions differ
    np.testing.assert_array_equal(d["w1"].b[0::2], d["w1"].b[1::2])

    other_step = member_deltas(TOY, jax.random.key(3), 6, params)
    assert not np.any(np.asarray(other_step["w1"].a) == np.asarray(d["w1"].a))
    # A leaf's noise does not depend on which other leaves exist.
    alone = member_deltas(TOY, jax.random.key(3), 5, {"w1": params["w1"]})
    np.testing.assert_array_equal(alone["w1"].a, d["w1"].a)
    # LOO-ROLL: member i uses direction i with sign +, bit for bit antithetic direction i, though drawn with
    # fewer directions (a direction's draw does not depend on how many are drawn, hence chunking is exact).
    loo = member_deltas(dataclasses.replace(TOY, method="looroll", population=2), jax.random.key(3), 5, params)
    np.testing.assert_array_equal(loo["w1"].a, d["w1"].a[0:4:2])
    np.testing.assert_array_equal(loo["layers"]["w"].b, d["layers"]["w"].b[:, 0:4:2])


def test_noise_is_jax_random_normal_per_draw():
    """The stream the module docstring of `noise` defines, re-derived from `jax.random` one draw at a time: each
    (leaf, layer, direction) is `jax.random.normal(k, (in + out, r))` (A then B) or `(dim,)` under key →
    fold_in(step) → crc32(path) → layer → direction, bit for bit, single leaves (layer 0) included."""
    params = {"w1": jnp.zeros((5, 7)), "layers": {"w": jnp.zeros((2, 10, 6)), "norm": jnp.zeros((2, 13))}}
    kinds = {"w1": noise.LOWRANK, "layers/w": noise.LOWRANK, "layers/norm": noise.DENSE}
    key, step, rank, directions = jax.random.key(11), 4, 3, [0, 5, 2]
    got = noise.flatten(jax.jit(lambda k: noise.factors(k, step, params, kinds, rank, jnp.array(directions)))(key))

    def draw(path, layer, direction, shape):
        k = jax.random.fold_in(jax.random.fold_in(key, step), zlib.crc32(path.encode()) & 0x7FFFFFFF)
        return np.asarray(jax.random.normal(jax.random.fold_in(jax.random.fold_in(k, layer), direction), shape))

    for path, (layers, m, o) in {"w1": (None, 5, 7), "layers/w": (2, 10, 6)}.items():
        for layer in range(layers or 1):
            for e, d in enumerate(directions):
                want = draw(path, layer, d, (m + o, rank))
                a, b = (np.asarray(x[layer, e] if layers else x[e]) for x in got[path])
                np.testing.assert_array_equal(a, want[:m])
                np.testing.assert_array_equal(b, want[m:])
                # The check tells draws apart: the next direction's (or layer's) numbers are different ones.
                assert not np.any(a == draw(path, layer, d + 1, (m + o, rank))[:m])
                assert not np.any(b == draw(path, layer + 1, d, (m + o, rank))[m:])
    for layer in range(2):
        for e, d in enumerate(directions):
            eps = np.asarray(got["layers/norm"][layer, e])
            np.testing.assert_array_equal(eps, draw("layers/norm", layer, d, (13,)))
            assert not np.any(eps == draw("layers/norm", layer, d + 1, (13,)))
    with pytest.raises(ValueError, match="threefry2x32"):
        noise.factors(jax.random.key(0, impl="rbg"), step, params, kinds, rank, jnp.array(directions))


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("es_qwen3")
    build_tiny_hf("qwen3", folder)
    return load_hf(folder)


def test_perturbed_forward_equals_explicit(tiny_qwen3):
    """ask -> Perturbation -> forward equals forward with W ± σ·A Bᵀ/√r built from the regenerated factors: rank 4
    (so that a wrong 1/√r shows) with the norms perturbed densely, hence both kinds of perturbation in one forward.
    (The default patterns leave the norms, embedding and head unperturbed: checked on the leaf kinds.)"""
    model_cfg, params = tiny_qwen3
    rank, dense = 4, ("layers/.*norm",)
    default_kinds = es.strategy.leaf_kinds(es.ESConfig(method="eggroll", population=4, rank=rank), params)
    assert not any("norm" in path or path in ("embed", "lm_head") for path in default_kinds)
    assert set(default_kinds.values()) == {"lowrank"} and "layers/q" in default_kinds
    cfg = es.ESConfig(method="eggroll", population=4, rank=rank, sigma=0.05, dense_patterns=dense)
    strategy = es.make_strategy(cfg, optax.sgd(1.0))
    state = strategy.init(params, jax.random.key(1))
    deltas, factors = with_factors(cfg, strategy.ask)(state, params)
    assert "embed" not in deltas and "lm_head" not in deltas
    assert "q_norm" in deltas["layers"] and isinstance(deltas["layers"]["q"], LowRank)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, model_cfg.vocab_size, (4 * 2, 6)))
    member_B = jnp.repeat(jnp.arange(4), 2)
    fwd = jax.jit(lambda p, perturb=None: forward(model_cfg, p, tokens, perturb=perturb)[0])
    ours = fwd(params, Perturbation(deltas, member_B))
    E = explicit_E(cfg, factors)
    for i in range(4):
        sign = 1 if i % 2 == 0 else -1
        flat = noise.flatten(params)
        for path, e in E.items():
            flat[path] = flat[path] + sign * cfg.sigma * jnp.asarray(e[i // 2], jnp.float32)
        rows = slice(2 * i, 2 * i + 2)
        np.testing.assert_allclose(ours[rows], fwd(noise.unflatten(flat))[rows], atol=2e-4, rtol=1e-4)
    assert np.abs(np.asarray(ours - fwd(params))).max() > 0.1  # the perturbation moves logits far beyond atol


# ---------------------------------------------------------------- the update


@pytest.mark.parametrize("method", ["eggroll", "looroll"])
def test_update_equals_explicit_sum(method):
    """ĝ equals the formula of docs/theory.md with E_i built densely, on the members left after dropping non-finite ones."""
    params = toy_params()
    cfg = dataclasses.replace(TOY, method=method)
    state = es.ESState(jnp.asarray(2), jax.random.key(7), None)
    f = np.random.default_rng(0).normal(size=8)
    f[3] = np.nan  # drops member 3 (and, for eggroll, its partner 2)
    estimate_fn = lambda s, p, f: es.estimate(cfg, s.key, s.step, p, f)
    (grad, w), factors = with_factors(cfg, estimate_fn)(state, params, jnp.asarray(f))
    E = explicit_E(cfg, factors)
    if method == "eggroll":
        pairs = [k for k in range(4) if k != 1]
        coef = {k: (f[2 * k] - f[2 * k + 1]) / (2 * len(pairs) * cfg.sigma) for k in pairs}
        assert int(w.num_dropped) == 2
    else:
        kept = [i for i in range(8) if i != 3]
        mean = f[kept].mean()
        coef = {i: (f[i] - mean) / ((len(kept) - 1) * cfg.sigma) for i in kept}
        assert int(w.num_dropped) == 1
    assert int(w.num_nonfinite) == 1 and not bool(w.skipped)
    flat = noise.flatten(grad)
    assert set(E) == {"w1", "bias", "layers/w", "layers/norm"}
    for path, e in E.items():
        expected = sum(c * e[k] for k, c in coef.items())
        np.testing.assert_allclose(flat[path], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(flat["embed"], 0)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_sigma_schedule_is_the_constant_sigma_of_each_step(schedule):
    """With a σ schedule, step t's members and estimate are exactly those of a constant σ = σ_t: the same σ_t
    perturbs the members and divides the estimator (σ_t from its formula, held at sigma_final past the horizon)."""
    cfg = dataclasses.replace(TOY, sigma_schedule=schedule, sigma_final=0.02, sigma_horizon=4)
    params, f = toy_params(), jnp.asarray(np.random.default_rng(1).normal(size=8), jnp.float32)
    key = jax.random.key(3)
    for step in (2, 6):  # inside the horizon, and past it
        t = min(step, 4) / 4
        sigma = 0.1 + (0.02 - 0.1) * (t if schedule == "linear" else (1 - np.cos(np.pi * t)) / 2)
        fixed = dataclasses.replace(TOY, sigma=float(sigma))
        (scheduled_deltas, scheduled_grad), (fixed_deltas, fixed_grad) = (
            deltas_and_estimate(c, key, step, params, f) for c in (cfg, fixed)
        )
        chex.assert_trees_all_close(scheduled_deltas, fixed_deltas, rtol=1e-6)
        # Up to rounding: σ_t is computed in float32 on one side; an entry (of entries up to ~20) that cancels to
        # near 0 keeps the rounding of its terms, hence the atol.
        chex.assert_trees_all_close(scheduled_grad, fixed_grad, rtol=1e-5, atol=1e-5)


@functools.partial(jax.jit, static_argnums=0)
def deltas_and_estimate(cfg, key, step, params, f):
    """`es.member_deltas` and `es.estimate`'s ĝ at `step`, in one compiled program per config (compiling dominates)."""
    return es.member_deltas(cfg, key, step, params), es.estimate(cfg, key, step, params, f)[0]


def test_weights_use_the_shaped_fitness():
    """Shaping happens before the estimator: antithetic weights are differences of centered ranks."""
    f = jnp.array([3.0, 1.0, 0.0, 2.0])  # centered ranks [1/2, -1/6, -1/2, 1/6]
    w = estimators.direction_weights("eggroll", f, 0.5, "centered_ranks").w_E
    np.testing.assert_allclose(w, np.array([2 / 3, -2 / 3]) / (2 * 2 * 0.5), rtol=1e-6)
    w = estimators.direction_weights("looroll", f, 0.5, "zscore").w_E
    z = (np.asarray(f) - 1.5) / np.sqrt(1.25)
    np.testing.assert_allclose(w, z / (3 * 0.5), rtol=1e-5)


def test_chunked_update_equals_one_batch():
    """Chunks that do not divide the directions (the last one padded) give the one-batch update."""
    params = toy_params()
    cfg = dataclasses.replace(TOY, population=14)
    f = jnp.asarray(np.random.default_rng(1).normal(size=14))
    whole, _ = estimate(cfg, jax.random.key(0), 3, params, f)
    part, _ = estimate(dataclasses.replace(cfg, chunk_size=3), jax.random.key(0), 3, params, f)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), whole, part)


def _member_sharded(tree, mesh):
    """Constrain every member-level array to be split over the mesh's 'pop' axis."""
    flat = noise.flatten(tree)
    for path, x in flat.items():
        sharding = NamedSharding(mesh, P(None, "pop") if noise.is_stacked(path) else P("pop"))
        flat[path] = jax.tree.map(functools.partial(jax.lax.with_sharding_constraint, shardings=sharding), x)
    return noise.unflatten(flat)


def test_same_result_on_1_and_8_devices():
    """Factors bit-identical and the applied update equal whether the population is split over 8 devices or not."""
    assert len(jax.devices()) >= 8
    params = toy_params()
    cfg = dataclasses.replace(TOY, population=16)
    opt = optax.adam(1e-2)
    strategy = es.make_strategy(cfg, opt)
    state = strategy.init(params, jax.random.key(4))
    f = jnp.asarray(np.random.default_rng(2).normal(size=16), jnp.float32)
    results = []
    for n in (1, 8):
        mesh = Mesh(np.array(jax.devices()[:n]), ("pop",))

        @functools.partial(jax.jit, static_argnums=0)
        def ask_and_tell(mesh, state, params, f):
            deltas = _member_sharded(strategy.ask(state, params), mesh)  # the factors, scaled per member
            return deltas, strategy.tell(params, state, f)[0]

        deltas, new_params = ask_and_tell(mesh, state, params, jax.device_put(f, NamedSharding(mesh, P("pop"))))
        assert len(deltas["layers"]["w"].a.sharding.device_set) == n
        results.append((deltas, new_params))
    (d1, p1), (d8, p8) = results
    jax.tree.map(np.testing.assert_array_equal, d1, d8)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), p1, p8)
    assert np.abs(np.asarray(p1["w1"] - params["w1"])).max() > 1e-3  # the step did move the parameters


def stacked_params(seed=0):
    """Layer-stacked matrices of three shapes (input dimensions 8, 8, 20), a frozen embedding and a frozen vector."""
    rng = np.random.default_rng(seed)
    shapes = {"embed": (11, 8), "layers": {"q": (3, 8, 12), "up": (3, 8, 20), "down": (3, 20, 8), "norm": (3, 8)}}
    return jax.tree.map(
        lambda s: jnp.asarray(rng.normal(size=s), jnp.float32), shapes, is_leaf=lambda x: isinstance(x, tuple)
    )


def test_nonfinite_step_is_skipped():
    params = toy_params()
    cfg = dataclasses.replace(TOY, method="looroll", min_valid_fraction=0.5)
    opt = optax.adam(1e-2)
    strategy = es.make_strategy(cfg, opt)
    tell = jax.jit(strategy.tell)
    state = strategy.init(params, jax.random.key(0))
    f = jnp.array([1.0, np.nan, np.inf, -np.inf, np.nan, 2.0, 0.0, 3.0])  # 4 finite members: exactly the minimum
    new, state1, m = tell(params, state, f)
    assert not bool(m["skipped"]) and int(m["num_nonfinite"]) == 4 and float(m["update_norm"]) > 0
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(new))
    f = f.at[0].set(np.nan)  # 3 finite: skip
    new, state2, m = tell(params, state1, f)
    assert bool(m["skipped"]) and int(m["num_dropped"]) == 5 and float(m["update_norm"]) == 0
    jax.tree.map(np.testing.assert_array_equal, new, params)
    jax.tree.map(np.testing.assert_array_equal, state2.opt_state, state1.opt_state)
    assert int(state2.step) == 2
    np.testing.assert_allclose(m["fitness_mean"], 5 / 3, rtol=1e-6)


# ---------------------------------------------------------------- end to end


def mlp_problem(seed=0, d=4, h=16, T=64):
    """Regression onto a random two-layer tanh teacher; the student starts at a different random point."""
    rng = np.random.default_rng(seed)
    x_TxD = rng.normal(size=(T, d)).astype(np.float32)
    y_T = np.tanh(x_TxD @ rng.normal(size=(d, h)) / np.sqrt(d)) @ rng.normal(size=h)
    params = {"w1": rng.normal(size=(d, h)) / np.sqrt(d), "w2": rng.normal(size=(h, 1)) / np.sqrt(h)}
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)

    def loss(params, deltas=None, N=1):
        """MSE per member; members see the same data (common random numbers)."""
        from esroll.models import linear

        member_B = jnp.arange(N)
        d = deltas or {}
        x_NxTxD = jnp.broadcast_to(x_TxD, (N,) + x_TxD.shape)
        hid = jnp.tanh(linear(x_NxTxD, params["w1"], d.get("w1"), member_B))
        pred_NxT = linear(hid, params["w2"], d.get("w2"), member_B)[..., 0]
        return jnp.mean((pred_NxT - y_T) ** 2, axis=-1)

    return params, loss


# Each method, each optimizer (with its shaping) once: Adam with z-scores on EGGROLL, SGD with momentum on raw
# fitness on LOO-ROLL (the other two pairings exercise the same code; all four reached 0.05 or less).
@pytest.mark.parametrize("method,opt_name", [("eggroll", "adam"), ("looroll", "sgd")])
def test_es_trains_mlp(method, opt_name):
    """Rank-one ES fits a two-layer MLP: MSE from 0.88 to below 0.1 in 200 steps."""
    params, loss = mlp_problem()
    cfg = es.ESConfig(
        method=method, population=32, rank=1, sigma=0.05, shaping="zscore" if opt_name == "adam" else "raw"
    )
    opt = optax.adam(0.03) if opt_name == "adam" else optax.sgd(0.005, momentum=0.9)
    strategy = es.make_strategy(cfg, opt)
    state = strategy.init(params, jax.random.key(0))

    def step(carry, _):
        params, state = carry
        fitness = -loss(params, strategy.ask(state, params), cfg.population)
        params, state, metrics = strategy.tell(params, state, fitness)
        return (params, state), metrics["fitness_mean"]

    (final, state), fit = jax.jit(lambda p, s: jax.lax.scan(step, (p, s), length=200))(params, state)
    start, end = float(loss(params)[0]), float(loss(final)[0])
    assert int(state.step) == 200 and np.isfinite(np.asarray(fit)).all()
    assert start > 0.85 and end < 0.1, f"{method}/{opt_name}: loss {start:.3f} -> {end:.3f}"
