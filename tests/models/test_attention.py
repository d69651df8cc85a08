"""The attention kernels (`esroll.models.attention`): the TPU's splash kernel, run in Pallas interpret mode on the
CPU, equals XLA's attention at every real token, forward and gradient, float32 and bfloat16, padded rows, grouped
heads, one and several kernel blocks; under `shard_map` over a mesh it equals the unsharded kernel; a whole model
with it matches transformers; the kernel is chosen from the mesh's platform; and a GSPMD program with it compiles for
a TPU that is not there."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import padded_batch, torch_logits

from esroll import parallel
from esroll.models import forward, load_hf
from esroll.models.attention import XLA, Attention, choose, self_attention, splash_block

SPLASH = Attention("splash", interpret=True)
TOLERANCE = {"float32": 2e-5, "bfloat16": 3e-2}


def _qkv(T: int, dtype: str, B: int = 4, Q: int = 4, K: int = 2, H: int = 24, seed: int = 0):
    """Random queries, keys and values, and a mask: row 0 all real, row 1 left-padded, row 2 right-padded, row 3
    with its last token the only real one."""
    ks = jax.random.split(jax.random.key(seed), 3)
    q, k, v = (jax.random.normal(key, (B, T, n, H), jnp.float32).astype(dtype) for key, n in zip(ks, (Q, K, K)))
    mask = np.ones((B, T), bool)
    mask[1, : T // 3] = False
    mask[2, T - T // 4 :] = False
    mask[3, :-1] = False
    return q, k, v, jnp.asarray(mask)


def _real(x_BxTxNxH, mask_BxT):
    """The outputs at real tokens (the contract); zero at padding."""
    return np.asarray(jnp.where(mask_BxT[:, :, None, None], x_BxTxNxH, 0).astype(jnp.float32))


def _reference(q, k, v, mask_BxT):
    """Attention written out in float64 numpy, grouped heads repeated as transformers' `repeat_kv` does."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    T, Q, H = q.shape[1:]
    k, v = (np.repeat(x, Q // x.shape[2], axis=2) for x in (k, v))
    scores = np.einsum("btqh,bsqh->bqts", q, k) / np.sqrt(H)
    visible = np.asarray(mask_BxT)[:, None, None, :] & np.tril(np.ones((T, T), bool))
    scores = np.where(visible, scores, -np.inf)
    scores = scores - np.max(np.where(visible, scores, 0), -1, keepdims=True)
    p = np.exp(scores)
    p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)  # a padding token that sees nothing: zeros
    return np.einsum("bqts,bsqh->btqh", p, v)


@pytest.mark.parametrize("T", [20, 300])  # one block of 128 (padded from 20); three of 128 (padded from 300)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_splash_equals_xla_forward_and_gradient_at_real_tokens(T, dtype):
    q, k, v, mask = _qkv(T, dtype)
    assert splash_block(T) == 128
    tol = TOLERANCE[dtype]
    want = _reference(q, k, v, mask) * np.asarray(mask)[:, :, None, None]
    for att in (XLA, SPLASH):
        got = _real(jax.jit(self_attention, static_argnums=0)(att, q, k, v, mask), mask)
        np.testing.assert_allclose(got, want, atol=tol * 4, rtol=0)

    def loss(att):  # a weighted sum over the real tokens' outputs: every real token's gradient path
        w = jax.random.normal(jax.random.key(1), q.shape, jnp.float32)

        def f(q, k, v):
            out = self_attention(att, q, k, v, mask).astype(jnp.float32)
            return jnp.sum(jnp.where(mask[:, :, None, None], out * w, 0))

        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)

    for g_xla, g_splash in zip(loss(XLA), loss(SPLASH)):
        scale = float(jnp.max(jnp.abs(g_xla.astype(jnp.float32))))
        np.testing.assert_allclose(
            np.asarray(g_splash, np.float32), np.asarray(g_xla, np.float32), atol=tol * 4 * max(scale, 1), rtol=0
        )


def test_splash_blocks_divide_the_padded_length():
    assert [splash_block(t) for t in (1, 128, 129, 255, 256, 384, 511, 512, 767, 1024)] == [
        128, 128, 256, 256, 256, 128, 512, 512, 256, 512,
    ]  # fmt: skip


def test_splash_under_shard_map_equals_one_device():
    """Rows over "data" and heads over "model" (2 x 2 CPU devices): each device's kernel call sees its rows and
    heads, and the result is the one-device kernel's."""
    q, k, v, mask = _qkv(20, "float32")
    mesh = parallel.make_mesh(4, model=2)
    sharded = dataclasses.replace(SPLASH, mesh=mesh)
    want = jax.jit(self_attention, static_argnums=0)(SPLASH, q, k, v, mask)
    got = jax.jit(self_attention, static_argnums=0)(sharded, q, k, v, mask)
    np.testing.assert_allclose(_real(got, mask), _real(want, mask), atol=1e-6, rtol=0)
    # Rows that do not split over "data" stay whole on each device (heads still split).
    got3 = jax.jit(self_attention, static_argnums=0)(sharded, q[:3], k[:3], v[:3], mask[:3])
    np.testing.assert_allclose(_real(got3, mask[:3]), _real(want[:3], mask[:3]), atol=1e-6, rtol=0)


def test_model_with_splash_matches_transformers_and_xla_gradient(tiny_model):
    """A whole decoder with the splash kernel against transformers' logits at the real tokens of a padded batch,
    and its parameter gradient against the XLA kernel's."""
    family, folder, torch_model = tiny_model
    cfg, params = load_hf(folder, dtype=jnp.float32)
    tokens, mask = padded_batch(cfg.vocab_size)
    splash_cfg = dataclasses.replace(cfg, attention=SPLASH)
    logits, _ = jax.jit(lambda p: forward(splash_cfg, p, jnp.asarray(tokens), mask_BxT=jnp.asarray(mask)))(params)
    want = torch_logits(torch_model, tokens, mask)
    np.testing.assert_allclose(np.asarray(logits)[mask], want[mask], atol=2e-4, rtol=0)

    def grad(c):
        def loss(p):
            lg, _ = forward(c, p, jnp.asarray(tokens), mask_BxT=jnp.asarray(mask), remat="full")
            lp = jax.nn.log_softmax(lg)[:, :-1]
            picked = jnp.take_along_axis(lp, jnp.asarray(tokens)[:, 1:, None], -1)[..., 0]
            real = jnp.asarray(mask[:, :-1] & mask[:, 1:])  # a real token's prediction of the next real one
            return -jnp.sum(jnp.where(real, picked, 0))

        return jax.jit(jax.grad(loss))(params)

    for g_xla, g_splash in zip(jax.tree.leaves(grad(cfg)), jax.tree.leaves(grad(splash_cfg))):
        np.testing.assert_allclose(np.asarray(g_splash), np.asarray(g_xla), atol=1e-4, rtol=1e-4)


class _Device:
    def __init__(self, platform, version=""):
        self.platform = platform
        self.client = type("Client", (), {"platform_version": version})()


class _Mesh:
    def __init__(self, platform, n=4, version=""):
        self.devices = np.array([_Device(platform, version)] * n)


def test_the_config_accepts_the_settings_the_model_knows():
    from esroll.config.sections import ATTENTION
    from esroll.models.attention import SETTINGS

    assert ATTENTION == SETTINGS


def test_choose_reads_the_platform_of_the_meshs_devices():
    assert choose("auto", None) == XLA
    assert choose("xla", _Mesh("tpu")) == XLA
    tpu = _Mesh("tpu")
    assert choose("auto", tpu) == Attention("splash", tpu)
    assert choose("auto", _Mesh("tpu", n=1)) == Attention("splash")  # one chip: no shard_map
    assert choose("auto", _Mesh("gpu", version="cuda 12.8")) == Attention("cudnn")
    assert choose("auto", _Mesh("gpu", version="rocm 6.2")) == XLA
    assert choose("auto", parallel.make_mesh(2)) == XLA  # this CPU
    with pytest.raises(ValueError, match="'model.attention' = 'flash'"):
        choose("flash", None)


def test_gspmd_program_with_splash_compiles_for_a_deviceless_tpu():
    """The gradient of a 2-layer model (Qwen3's head width) with splash under `shard_map`, its inputs GSPMD-sharded
    on v5e:2x2 (2 data x 2 model), compiles for the TPU, and the compiled program calls the Mosaic kernel."""
    pytest.importorskip("libtpu")
    from esroll import sharding
    from esroll.models import abstract_params, model_config
    from esroll.plan import topology_mesh

    mesh, _ = topology_mesh("v5e:2x2", model=2)
    att = choose("auto", mesh)
    assert att.kernel == "splash" and att.mesh is mesh
    cfg = dataclasses.replace(model_config("qwen3-0.6b", layers=2), vocab_size=1024, attention=att)
    shapes = abstract_params(cfg)
    specs = sharding.compute_shardings(mesh, shapes)
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16, sharding=sh), shapes, specs)
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(parallel.DATA))
    tokens = jax.ShapeDtypeStruct((8, 200), jnp.int32, sharding=rows)
    mask = jax.ShapeDtypeStruct((8, 200), bool, sharding=rows)

    def loss(p, t, m):
        logits, _ = forward(cfg, p, t, mask_BxT=m, remat="full")
        return jnp.sum(jnp.where(m, logits[..., 0], 0))

    compiled = jax.jit(jax.grad(loss)).lower(params, tokens, mask).compile()  # at the suite's "highest" precision
    assert "tpu_custom_call" in compiled.as_text()


def test_a_prefill_with_splash_fills_the_cache_as_xla_does(tiny_model):
    """A prefill into a fresh cache (its tokens padded to the kernel's multiple before the layers, the padding sliced
    off after) writes the same keys and values at the same slots as XLA's, and a decode step after it gives the same
    logits."""
    from esroll.models import init_cache

    family, folder, _ = tiny_model
    cfg, params = load_hf(folder, dtype=jnp.float32)
    tokens, mask = padded_batch(cfg.vocab_size)
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    B, P = tokens.shape

    def prefill_and_step(c):
        cache = init_cache(c, B, P + 3, jnp.float32)
        _, cache = forward(c, params, tokens[:, :-1], mask_BxT=mask[:, :-1], cache=cache, attend_slots=0)
        logits, cache = forward(c, params, tokens[:, -1:], cache=cache, attend_slots=P)
        return logits, cache

    (want, want_cache), (got, got_cache) = (
        jax.jit(prefill_and_step, static_argnums=0)(c) for c in (cfg, dataclasses.replace(cfg, attention=SPLASH))
    )
    assert int(got_cache.index) == int(want_cache.index) == P
    np.testing.assert_array_equal(np.asarray(got_cache.valid_BxS), np.asarray(want_cache.valid_BxS))
    valid = np.asarray(want_cache.valid_BxS)[None, :, None, :, None]
    for g, w in ((got_cache.k, want_cache.k), (got_cache.v, want_cache.v)):
        np.testing.assert_allclose(np.where(valid, g, 0), np.where(valid, w, 0), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-4, rtol=0)
