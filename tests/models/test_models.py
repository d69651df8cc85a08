"""Parity of the JAX decoders with transformers' PyTorch models, checkpoint round trips, KV cache, errors."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from esroll.models import LowRank, ModelConfig, Perturbation, forward, init_cache, linear, load_hf, save_hf
from esroll.models.layers import row_vector

from conftest import build_tiny_hf, padded_batch, torch_logits


# One compilation per (config, shapes, perturbation form), shared by the tests: an eager `forward` would trace and
# compile its layer scan anew at every call.
jit_forward = jax.jit(forward, static_argnums=0)


def test_parity_padded_batch(tiny_model):
    family, folder, model = tiny_model
    cfg, params = load_hf(folder)
    assert cfg.family == family
    tokens, mask = padded_batch(cfg.vocab_size)
    ours, _ = jit_forward(cfg, params, jnp.asarray(tokens), mask_BxT=jnp.asarray(mask))
    ref = torch_logits(model, tokens, mask)
    err = np.abs(np.asarray(ours) - ref)[mask].max()
    assert err < 1e-4, f"{family}: max abs logit error {err}"


def test_config_fields(tiny_model):
    family, folder, _ = tiny_model
    cfg, _ = load_hf(folder)
    if family == "qwen3":
        assert cfg.head_dim == 24 != cfg.hidden_size // cfg.num_heads and cfg.qk_norm
    if family == "qwen2":
        assert cfg.qkv_bias and cfg.tie_word_embeddings
    if family == "llama":
        assert cfg.rope_scaling[0] == "llama3"
    assert cfg.num_kv_heads < cfg.num_heads


def test_rope_read_both_spellings():
    legacy = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_theta": 5e5,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    new = {k: v for k, v in legacy.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {**legacy["rope_scaling"], "rope_theta": 5e5}
    a, b = ModelConfig.from_hf_dict(legacy), ModelConfig.from_hf_dict(new)
    assert a == b and a.rope_theta == 5e5 and a.rope_scaling == ("llama3", 8.0, 1.0, 4.0, 8192)


def test_save_hf_round_trip(tiny_model, tmp_path):
    family, folder, model = tiny_model
    cfg, params = load_hf(folder)
    out = save_hf(tmp_path / "export", cfg, params)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tokens, mask = padded_batch(cfg.vocab_size, seed=1)
    a, b = torch_logits(model, tokens, mask), torch_logits(reloaded, tokens, mask)
    assert np.abs(a - b)[mask].max() < 1e-5
    cfg2, params2 = load_hf(out)
    assert cfg2 == cfg
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), params, params2)


def test_kv_cache_incremental_matches_full(tiny_model):
    _, folder, _ = tiny_model
    cfg, params = load_hf(folder)
    tokens, mask = padded_batch(cfg.vocab_size, seed=2)
    full, _ = jit_forward(cfg, params, jnp.asarray(tokens), mask_BxT=jnp.asarray(mask))
    cache = init_cache(cfg, batch=3, max_len=12)
    prefill = 5
    logits, cache = jit_forward(
        cfg, params, jnp.asarray(tokens[:, :prefill]), mask_BxT=jnp.asarray(mask[:, :prefill]), cache=cache
    )
    steps = [logits]
    for t in range(prefill, tokens.shape[1]):
        logits, cache = jit_forward(
            cfg, params, jnp.asarray(tokens[:, t : t + 1]), mask_BxT=jnp.asarray(mask[:, t : t + 1]), cache=cache
        )
        steps.append(logits)
    inc = np.concatenate([np.asarray(s) for s in steps], axis=1)
    assert np.abs(inc - np.asarray(full))[mask].max() < 1e-4


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attend_equals_jax_attention_with_repeated_kv_heads(dtype):
    """`attend` (grouped queries against [B, K, S, H] keys and values, in one block or two) against
    `jax.nn.dot_product_attention` on [B, S, Q, H] keys and values whose kv heads are repeated Q / K times (head j
    reads kv head j // (Q / K), as Hugging Face's `repeat_kv`), with a row that sees no key at all: a uniform average
    of the values, not NaN."""
    from esroll.models.transformer import attend

    B, T, S, Q, K, H = 3, 2, 5, 6, 2, 8
    kq, kk, kv, km = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (B, T, Q, H), dtype)
    k = jax.random.normal(kk, (B, K, S, H), dtype)
    v = jax.random.normal(kv, (B, K, S, H), dtype)
    visible = jax.random.bernoulli(km, 0.6, (B, T, S)).at[0, 1].set(False).at[1, 0].set(True)
    repeat = lambda x: jnp.repeat(x.transpose(0, 2, 1, 3), Q // K, axis=2)  # [B, S, Q, H]
    # Each side compiled as one program (eagerly, every operation would be compiled on its own).
    ref = jax.jit(lambda q, k, v, visible: jax.nn.dot_product_attention(
        q, repeat(k), repeat(v), mask=visible[:, None], scale=1 / np.sqrt(H)
    ))(q, k, v, visible)  # fmt: skip
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    uniform = np.repeat(np.asarray(v, np.float64).mean(2)[0], Q // K, 0)  # [Q, H]: row 0's query 1 sees nothing
    one, two = jax.jit(lambda q, k, v, visible: (
        attend(q, (k, v, visible)),
        attend(q, (k[:, :, :3], v[:, :, :3], visible[..., :3]), (k[:, :, 3:], v[:, :, 3:], visible[..., 3:])),
    ))(q, k, v, visible)  # fmt: skip
    for ours in (one, two):  # the keys in one block, and split in two blocks under one softmax
        assert ours.shape == (B, T, Q, H) and ours.dtype == dtype
        ours = np.asarray(ours, np.float32)
        np.testing.assert_allclose(ours, np.asarray(ref, np.float32), atol=tol, rtol=tol)
        np.testing.assert_allclose(ours[0, 1], uniform, atol=tol, rtol=tol)


def test_bfloat16_close_to_float32(tiny_model):
    _, folder, _ = tiny_model
    cfg, p32 = load_hf(folder)
    _, p16 = load_hf(folder, dtype=jnp.bfloat16)
    assert p16["layers"]["q"].dtype == jnp.bfloat16
    tokens, mask = padded_batch(cfg.vocab_size)
    a, _ = jit_forward(cfg, p32, jnp.asarray(tokens), mask_BxT=jnp.asarray(mask))
    b, _ = jit_forward(cfg, p16, jnp.asarray(tokens), mask_BxT=jnp.asarray(mask))
    assert np.isfinite(np.asarray(b)).all()
    scale = np.abs(np.asarray(a))[mask].max()
    assert np.abs(np.asarray(a) - np.asarray(b))[mask].max() < 0.1 * scale


def test_linear_helper_equals_explicit_weight():
    rng = np.random.default_rng(0)
    x, w, a, b = (rng.standard_normal(shape, np.float32) for shape in ((4, 3, 16), (16, 8), (2, 16, 3), (2, 8, 3)))
    member = np.array([0, 1, 1, 0])
    y = np.asarray(jax.jit(linear)(x, w, LowRank(a, b), member))  # one program, not one per operation
    x, w, a, b = (np.asarray(t, np.float64) for t in (x, w, a, b))  # the explicit weights in NumPy
    for row in range(4):
        m = int(member[row])
        explicit = x[row] @ (w + a[m] @ b[m].T)
        np.testing.assert_allclose(y[row], explicit, rtol=1e-5, atol=1e-5)


def test_linear_helper_with_member_tables_equals_explicit_weight():
    """Member tables (`Perturbation.tables`): 6 rows of members [2, 2, 0, 0, 0, 1] in 2 blocks of 3 rows, tables of 2
    entries each ([2, 0] and [0, 1]); each row gets x·(W + a bᵀ) with its own member's factors, one token per row (the
    rows against every entry of their table) and two (each row's entry gathered), and a vector leaf its member's
    delta."""
    rng = np.random.default_rng(1)
    shapes = ((6, 2, 16), (16, 8), (3, 16, 2), (3, 8, 2), (3, 8))
    x, w, a, b, v = (rng.standard_normal(shape, np.float32) for shape in shapes)
    member = np.array([2, 2, 0, 0, 0, 1])

    @jax.jit  # one program, not one per operation
    def run(x, w, a, b, v, member):
        tables = Perturbation({"w": LowRank(a, b), "v": v}, member).tables(2, blocks=2)
        vector = row_vector(jnp.zeros(8), tables.deltas["v"], tables.slot_B)
        return tables, vector, {T: linear(x[:, :T], w, tables.deltas["w"], tables.slot_B) for T in (1, 2)}

    tables, vector, ys = run(x, w, a, b, v, member)
    assert tables.deltas["w"].a.shape == (2, 2, 16, 2) and tables.member_B is None
    x, w, a, b, v = (np.asarray(t, np.float64) for t in (x, w, a, b, v))  # the explicit weights in NumPy
    vector, ys = np.asarray(vector), {T: np.asarray(y) for T, y in ys.items()}
    for T, y in ys.items():
        for row in range(6):
            m = int(member[row])
            np.testing.assert_allclose(y[row], x[row, :T] @ (w + a[m] @ b[m].T), rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(vector[row, 0], v[m])


def test_forward_perturbed_equals_explicit(tiny_model):
    """A per-row perturbation of every matrix and vector leaf equals the forward with each member's weights built,
    given per member, and as member tables: one table of both members for the three rows, and three one-row blocks
    of one entry each."""
    _, folder, _ = tiny_model
    cfg, params = load_hf(folder)
    tokens, mask = padded_batch(cfg.vocab_size)
    member = jnp.array([1, 0, 1])
    keys = iter(jax.random.split(jax.random.key(1), 64))
    deltas = {"layers": {}}
    for name, w in params["layers"].items():
        if w.ndim == 3:
            L, i, o = w.shape
            deltas["layers"][name] = LowRank(
                0.05 * jax.random.normal(next(keys), (L, 2, i, 2)), 0.05 * jax.random.normal(next(keys), (L, 2, o, 2))
            )
        else:
            deltas["layers"][name] = 0.05 * jax.random.normal(next(keys), (w.shape[0], 2, w.shape[1]))
    deltas["final_norm"] = 0.05 * jax.random.normal(next(keys), (2, cfg.hidden_size))
    perturb = Perturbation(deltas, member)
    run = lambda p: jit_forward(cfg, params, jnp.asarray(tokens), mask_BxT=jnp.asarray(mask), perturb=p)[0]
    forms = [run(perturb), run(perturb.tables(2)), run(perturb.tables(1, blocks=3))]
    for m in (0, 1):
        explicit = jax.tree.map(lambda x: x, params)
        for name, d in deltas["layers"].items():
            if isinstance(d, LowRank):
                explicit["layers"][name] = params["layers"][name] + jnp.einsum("lir,lor->lio", d.a[:, m], d.b[:, m])
            else:
                explicit["layers"][name] = params["layers"][name] + d[:, m]
        explicit["final_norm"] = params["final_norm"] + deltas["final_norm"][m]
        ref, _ = jit_forward(cfg, explicit, jnp.asarray(tokens), mask_BxT=jnp.asarray(mask))
        rows = np.asarray(member) == m
        for ours in forms:
            assert np.abs(np.asarray(ours)[rows] - np.asarray(ref)[rows])[mask[rows]].max() < 1e-4


def test_bad_checkpoints(tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "m"
    build_tiny_hf("qwen3", folder)
    tensors = load_file(str(folder / "model.safetensors"))

    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "config.json").write_text((folder / "config.json").read_text())
    save_file(
        {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"},
        str(missing / "model.safetensors"),
    )
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf(missing)

    shape = tmp_path / "shape"
    shape.mkdir()
    (shape / "config.json").write_text((folder / "config.json").read_text())
    bad = dict(tensors)
    bad["model.layers.0.self_attn.k_proj.weight"] = np.zeros((3, 3), np.float32)
    save_file(bad, str(shape / "model.safetensors"))
    with pytest.raises(ValueError, match=r"shape.*model\.safetensors.*k_proj.*\(3, 3\)"):
        load_hf(shape)

    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "config.json").write_text((folder / "config.json").read_text())
    save_file({**tensors, "model.layers.0.mystery.weight": np.zeros(2, np.float32)}, str(extra / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.mystery\.weight'"):
        load_hf(extra)

    noconfig = tmp_path / "noconfig"
    noconfig.mkdir()
    save_file(tensors, str(noconfig / "model.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"noconfig/config\.json"):
        load_hf(noconfig)

    arch = tmp_path / "arch"
    arch.mkdir()
    d = json.loads((folder / "config.json").read_text())
    d["architectures"] = ["GPT2LMHeadModel"]
    (arch / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_hf(arch)

    with pytest.raises(FileNotFoundError, match="model folder not found"):
        load_hf(tmp_path / "nowhere")


def test_sharded_checkpoint(tmp_path):
    folder = tmp_path / "m"
    model = build_tiny_hf("llama", folder)
    sharded = tmp_path / "sharded"
    model.save_pretrained(str(sharded), max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    cfg, params = load_hf(sharded)
    _, ref = load_hf(folder)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), params, ref)


def test_perturbed_cached_forward_equals_explicit(tiny_model):
    """A cached forward with member-level factors, or with every row's factors gathered once up front (as `generate`
    does before its decode loop), gives each row its member's explicitly built weights (a perturbed norm scale
    included)."""
    _, folder, _ = tiny_model
    cfg, params = load_hf(folder)
    tokens, mask = padded_batch(cfg.vocab_size)
    member = jnp.array([2, 0, 1])
    keys = iter(jax.random.split(jax.random.key(2), 64))
    lowrank = lambda lead, i, o: LowRank(
        0.1 * jax.random.normal(next(keys), (*lead, 3, i, 2)), 0.1 * jax.random.normal(next(keys), (*lead, 3, o, 2))
    )
    deltas = {"layers": {n: lowrank((w.shape[0],), *w.shape[1:]) for n, w in params["layers"].items() if w.ndim == 3}}
    if "lm_head" in params:
        deltas["lm_head"] = lowrank((), *params["lm_head"].shape)
    norm = params["layers"]["attn_norm"]  # a perturbed vector leaf too: [L, M, D]
    deltas["layers"]["attn_norm"] = 0.1 * jax.random.normal(next(keys), (norm.shape[0], 3, norm.shape[1]))
    cache = init_cache(cfg, batch=3, max_len=tokens.shape[1])
    ours, _ = jit_forward(
        cfg,
        params,
        jnp.asarray(tokens),
        mask_BxT=jnp.asarray(mask),
        cache=cache,
        perturb=Perturbation(deltas, member),
    )
    # the same with every row's factors gathered once up front, as `generate` does before its decode loop
    per_row, _ = jit_forward(
        cfg,
        params,
        jnp.asarray(tokens),
        mask_BxT=jnp.asarray(mask),
        cache=init_cache(cfg, batch=3, max_len=tokens.shape[1]),
        perturb=Perturbation(deltas, member).per_row(),
    )
    np.testing.assert_allclose(np.asarray(per_row), np.asarray(ours), rtol=1e-6, atol=1e-6)
    for m in range(3):
        explicit = {**params, "layers": dict(params["layers"])}
        for name, d in deltas["layers"].items():
            if name == "attn_norm":
                explicit["layers"][name] = params["layers"][name] + d[:, m]
                continue
            explicit["layers"][name] = params["layers"][name] + jnp.einsum("lir,lor->lio", d.a[:, m], d.b[:, m])
        if "lm_head" in deltas:
            explicit["lm_head"] = params["lm_head"] + deltas["lm_head"].a[m] @ deltas["lm_head"].b[m].T
        ref, _ = jit_forward(cfg, explicit, jnp.asarray(tokens), mask_BxT=jnp.asarray(mask))
        rows = np.asarray(member) == m
        assert np.abs(np.asarray(ours)[rows] - np.asarray(ref)[rows])[mask[rows]].max() < 1e-4


# ---- loading straight into shardings


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory):
    """A 4-layer tiny Qwen3 (untied LM head, vocabulary 96) whose every split dimension a (4, 2) mesh divides."""
    folder = tmp_path_factory.mktemp("tp_qwen3")
    build_tiny_hf("qwen3", folder, num_hidden_layers=4, vocab_size=96)
    return folder


def mesh_4x2():
    from jax.sharding import Mesh

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (conftest sets --xla_force_host_platform_device_count=8)")
    return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))


def tp_shardings(mesh, cfg) -> dict:
    """Tensor-parallel columns and rows over "model", the embedding's vocabulary, the LM head's both dimensions and
    gate's layers over "data"; everything else replicated."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from esroll.models import STACKED, param_shapes

    ns = lambda *spec: NamedSharding(mesh, P(*spec))
    shapes = param_shapes(cfg)
    layers = {leaf: ns() for leaf in shapes[STACKED]}
    layers.update(
        q=ns(None, None, "model"),
        k=ns(None, None, "model"),
        v=ns(None, None, "model"),
        up=ns(None, None, "model"),
        gate=ns("data", None, "model"),
        o=ns(None, "model", None),
        down=ns(None, "model", None),
        attn_norm=ns("data"),
    )
    return {"embed": ns("data", None), "final_norm": ns(), STACKED: layers, "lm_head": ns("data", "model")}


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16], ids=["checkpoint-dtype", "bfloat16"])
def test_load_hf_into_shardings_equals_the_unsharded_load(tp_model, dtype):
    mesh = mesh_4x2()
    cfg, ref = load_hf(tp_model, dtype=dtype)
    requested = tp_shardings(mesh, cfg)
    for shardings in (requested, lambda c: tp_shardings(mesh, c)):  # a tree, or a callable of the config
        _, params = load_hf(tp_model, dtype=dtype, shardings=shardings)
        assert jax.tree.structure(params) == jax.tree.structure(ref)

        def check(path, x, want, sharding):
            where = jax.tree_util.keystr(path)
            assert x.sharding == sharding, where
            assert x.dtype == want.dtype == (jnp.float32 if dtype is None else dtype), where
            want = np.asarray(want)
            np.testing.assert_array_equal(np.asarray(x), want, err_msg=where)
            for shard in x.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index], err_msg=where)

        jax.tree_util.tree_map_with_path(check, params, ref, requested)
    assert params["layers"]["q"].addressable_shards[0].data.shape == (4, 64, 48)
    assert params["lm_head"].addressable_shards[0].data.shape == (16, 48)


def test_load_hf_shardings_of_a_bfloat16_checkpoint(tp_model, tmp_path):
    """A bfloat16 safetensors file (read by safetensors' numpy framework as ml_dtypes.bfloat16) loads sharded as it
    does unsharded, in its own dtype or cast."""
    mesh = mesh_4x2()
    cfg, params = load_hf(tp_model)
    save_hf(tmp_path / "bf16", cfg, params, dtype=jnp.bfloat16)
    for dtype, want in ((None, jnp.bfloat16), (jnp.float32, jnp.float32)):
        _, ref = load_hf(tmp_path / "bf16", dtype=dtype)
        _, sharded = load_hf(tmp_path / "bf16", dtype=dtype, shardings=lambda c: tp_shardings(mesh, c))
        for x, y in zip(jax.tree.leaves(sharded), jax.tree.leaves(ref), strict=True):
            assert x.dtype == y.dtype == want
            np.testing.assert_array_equal(np.asarray(x).astype(np.float32), np.asarray(y).astype(np.float32))
    np.testing.assert_allclose(np.asarray(ref["layers"]["q"]), np.asarray(params["layers"]["q"]), rtol=1e-2, atol=1e-2)


class _CountingFile:
    """A safe_open handle that logs (tensor name, shape read) for every data read."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def __enter__(self):
        self.f = self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_tensor(self, name):
        t = self.f.get_tensor(name)
        self.log.append((name, "get_tensor", t.shape))
        return t

    def get_slice(self, name):
        inner, log = self.f.get_slice(name), self.log

        class Slice:
            get_shape, get_dtype = inner.get_shape, inner.get_dtype

            def __getitem__(self, index):
                a = inner[index]
                log.append((name, "slice", a.shape))
                return a

        return Slice()


def test_load_hf_shardings_reads_only_each_shard(tp_model, tmp_path, monkeypatch):
    """Every read of a sharded tensor is one shard's slice (never the whole tensor), each element is read once (a
    shard that several devices hold is read once), and a checkpoint that fails validation reads no data at all."""
    import math

    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    from esroll.models import hf

    log = []
    monkeypatch.setattr(hf, "safe_open", lambda *a, **k: _CountingFile(safe_open(*a, **k), log))
    mesh = mesh_4x2()
    cfg, params = load_hf(tp_model, shardings=lambda c: tp_shardings(mesh, c))
    shardings = tp_shardings(mesh, cfg)
    assert log and all(kind == "slice" for _, kind, _ in log)

    per_tensor: dict[str, list[tuple]] = {}
    for name, _, shape in log:
        per_tensor.setdefault(name, []).append(shape)
    for hf_name, (target, hf_shape, _) in hf._hf_names(cfg).items():
        parts = target.split("/")
        leaf = params["layers"][parts[1]] if parts[0] == "layers" else params[parts[0]]
        sharding = shardings["layers"][parts[1]] if parts[0] == "layers" else shardings[parts[0]]
        shard = sharding.shard_shape(leaf.shape)[1:] if parts[0] == "layers" else sharding.shard_shape(leaf.shape)
        reads = per_tensor[hf_name]
        assert all(math.prod(r) == math.prod(shard) for r in reads), (hf_name, reads, shard)
        assert sum(math.prod(r) for r in reads) == math.prod(hf_shape), (hf_name, reads)
    q_reads = per_tensor["model.layers.0.self_attn.q_proj.weight"]
    assert q_reads == [(48, 64), (48, 64)]  # HF [out, in]: the "model" split of esroll's columns is HF's rows
    assert sorted(per_tensor["lm_head.weight"]) == [(48, 16)] * 8

    tensors = load_file(str(tp_model / "model.safetensors"))
    tensors["model.layers.3.mlp.down_proj.weight"] = np.zeros((3, 3), np.float32)
    (tmp_path / "config.json").write_text((tp_model / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    log.clear()
    with pytest.raises(ValueError, match=r"model\.safetensors.*'model\.layers\.3\.mlp\.down_proj\.weight'.*\(3, 3\)"):
        load_hf(tmp_path, shardings=lambda c: tp_shardings(mesh, c))
    with pytest.raises(ValueError, match=r"down_proj"):
        load_hf(tmp_path)
    assert log == []


def test_load_hf_shardings_must_match_the_params(tp_model):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = mesh_4x2()
    cfg, ref = load_hf(tp_model)
    shardings = tp_shardings(mesh, cfg)
    del shardings["layers"]["up"]
    with pytest.raises(ValueError, match="no sharding for layers/up"):
        load_hf(tp_model, shardings=shardings)
    with pytest.raises(ValueError, match="q_bias is not a parameter"):
        load_hf(
            tp_model,
            shardings=lambda c: {
                **tp_shardings(mesh, c),
                "layers": {**tp_shardings(mesh, c)["layers"], "q_bias": None},
            },
        )
    with pytest.raises(TypeError, match=r"\['embed'\] is None"):
        load_hf(tp_model, shardings=lambda c: {**tp_shardings(mesh, c), "embed": None})
    # One Sharding for every leaf.
    _, params = load_hf(tp_model, shardings=NamedSharding(mesh, P()))
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(ref), strict=True):
        assert x.sharding.is_fully_replicated and len(x.sharding.device_set) == 8
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
