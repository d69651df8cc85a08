"""Generation: greedy parity with transformers, log-probabilities, sampling properties, per-member perturbations.

Most calls share one shape (4 prompts in a 16-wide bucket, N_NEW new tokens) so that they share compilations.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from esroll.models import LowRank, Perturbation, forward, load_hf
from esroll.sampling import generate, lower_generate, pad_prompts
from esroll.scoring import sequence_logprobs

from conftest import FAMILIES, build_tiny_hf

N_NEW = 12
NUCLEUS = dict(temperature=1.3, top_p=0.6, eos_ids=(5, 6, 7, 8, 9))
seq_logprobs = jax.jit(sequence_logprobs, static_argnums=0)
full_logits = jax.jit(
    lambda cfg, params, tokens, mask: forward(cfg, params, tokens, mask_BxT=mask)[0], static_argnums=0
)


@pytest.fixture(scope="module", params=FAMILIES)
def sharp_model(request, tmp_path_factory):
    """(cfg, params, torch_model) with init std 0.5, so greedy argmax margins dwarf float32 differences."""
    folder = tmp_path_factory.mktemp(f"sharp_{request.param}")
    model = build_tiny_hf(request.param, folder, initializer_range=0.5)
    cfg, params = load_hf(folder)
    return cfg, params, model


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sharp_qwen3_props")
    build_tiny_hf("qwen3", folder, initializer_range=0.5)
    return load_hf(folder)


def prompts(vocab: int, seed: int = 0, rows: int = 4):
    """Left-padded prompts of lengths 7, 3, 5, 1 (the first `rows` of them) in a 4 x 16 batch."""
    rng = np.random.default_rng(seed)
    return pad_prompts([list(rng.integers(1, vocab, size=n)) for n in (7, 3, 5, 1)[:rows]], rows=4)


def greedy(cfg, params, tokens, mask, **kw):
    return generate(
        cfg, params, tokens, jax.random.key(0), max_new_tokens=N_NEW, temperature=0.0, prompt_mask=mask, **kw
    )


def hf_greedy(model, tokens, mask, eos_ids):
    model.generation_config.eos_token_id = list(eos_ids) or None
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            do_sample=False,
            max_new_tokens=N_NEW,
            pad_token_id=0,
            eos_token_id=list(eos_ids) or None,
        )
    new = out[:, tokens.shape[1] :].numpy()
    return np.pad(new, ((0, 0), (0, N_NEW - new.shape[1])))  # transformers stops early when every row is done


def test_pad_prompts_buckets():
    tokens, mask = pad_prompts([[5, 6, 7], [8]], multiple=4, rows=3, pad_id=0)
    np.testing.assert_array_equal(tokens, [[0, 5, 6, 7], [0, 0, 0, 8], [0, 0, 0, 0]])
    np.testing.assert_array_equal(mask, tokens != 0)
    assert pad_prompts([[1] * 5], multiple=4)[0].shape == (1, 8)


def generated_mask(out):
    return np.arange(N_NEW)[None] < np.asarray(out.lengths)[:, None]


def test_greedy_matches_transformers(sharp_model):
    cfg, params, model = sharp_model
    tokens, mask = prompts(cfg.vocab_size)
    # An EOS that row 0 emits at step 2 (the others may emit it later or never): rows stop at different steps.
    eos = (int(hf_greedy(model, tokens, mask, ())[0, 2]),)
    ours = greedy(cfg, params, tokens, mask, eos_ids=eos)
    np.testing.assert_array_equal(np.asarray(ours.tokens), hf_greedy(model, tokens, mask, eos))
    lengths = np.asarray(ours.lengths)
    assert lengths[0] == 3 and lengths.max() == int(ours.steps) == N_NEW
    ref = seq_logprobs(cfg, params, tokens, mask, ours.tokens, generated_mask(ours))
    np.testing.assert_allclose(np.asarray(ours.logprobs), np.asarray(ref), atol=1e-4)


@pytest.fixture(scope="module")
def nucleus_sample(qwen3):
    """A temperature-1.3, top-p 0.6 sample with EOS ids, and the per-step logits of a full forward over it."""
    cfg, params = qwen3
    tokens, mask = prompts(cfg.vocab_size, seed=1)
    out = generate(cfg, params, tokens, jax.random.key(3), max_new_tokens=N_NEW, prompt_mask=mask, **NUCLEUS)
    generated_BxN = generated_mask(out)
    full_mask = np.concatenate([mask, generated_BxN], 1)
    logits = full_logits(cfg, params, jnp.concatenate([tokens, out.tokens], 1), full_mask)
    return cfg, params, tokens, mask, out, generated_BxN, np.asarray(logits[:, tokens.shape[1] - 1 : -1])


def test_logprobs_equal_full_forward(nucleus_sample):
    """Returned log-probabilities are the raw (untempered, unfiltered) policy's, as a full forward gives them."""
    cfg, params, tokens, mask, out, generated_BxN, logits_BxNxV = nucleus_sample
    assert (~generated_BxN).any()  # some row stopped at an EOS, so the padding branch is exercised
    ref = seq_logprobs(cfg, params, tokens, mask, out.tokens, generated_BxN)
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref), atol=1e-4)
    raw = np.take_along_axis(jax.nn.log_softmax(logits_BxNxV), np.asarray(out.tokens)[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.logprobs)[generated_BxN], raw[generated_BxN], atol=1e-4)
    assert (np.asarray(out.logprobs)[~generated_BxN] == 0).all()


def test_top_p_keeps_only_the_nucleus(nucleus_sample):
    """Every sampled token is inside its step's top-p set of the tempered distribution."""
    *_, out, generated_BxN, logits_BxNxV = nucleus_sample
    probs_BxNxV = np.asarray(jax.nn.softmax(logits_BxNxV / 1.3))
    chosen_BxN = np.take_along_axis(probs_BxNxV, np.asarray(out.tokens)[..., None], -1)
    # In the nucleus iff the mass of clearly more probable tokens is below top_p.
    above_BxN = np.where(probs_BxNxV > chosen_BxN * (1 + 1e-4), probs_BxNxV, 0).sum(-1)
    assert (above_BxN < 0.6)[generated_BxN].all()
    assert (above_BxN > 0)[generated_BxN].any()  # not all greedy: the sampler did draw


def test_sampling_reproducible_and_keyed(qwen3):
    cfg, params = qwen3
    tokens, mask = prompts(cfg.vocab_size)
    run = functools.partial(generate, cfg, params, tokens, max_new_tokens=N_NEW, prompt_mask=mask)
    a, b, c = (run(jax.random.key(k), **NUCLEUS).tokens for k in (0, 0, 1))
    np.testing.assert_array_equal(a, b)
    assert (np.asarray(a) != np.asarray(c)).any()
    np.testing.assert_array_equal(run(jax.random.key(5), top_k=1).tokens, greedy(cfg, params, tokens, mask).tokens)


def test_eos_padding_and_early_stop(qwen3):
    cfg, params = qwen3
    tokens, mask = prompts(cfg.vocab_size)
    first = np.asarray(greedy(cfg, params, tokens, mask).tokens)
    # Row r's own greedy token at step r + 1 is an EOS: every row finishes by step r + 2, so the loop stops early.
    eos = tuple(int(first[r, r + 1]) for r in range(4))
    out = greedy(cfg, params, tokens, mask, eos_ids=eos, pad_id=-1)
    toks, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    assert (lengths <= np.arange(4) + 2).all() and int(out.steps) == lengths.max() < N_NEW
    for row, n in enumerate(lengths):
        np.testing.assert_array_equal(toks[row, :n], first[row, :n])
        assert toks[row, n - 1] in eos and not set(toks[row, : n - 1]) & set(eos)
        assert (toks[row, n:] == -1).all()


def test_empty_rows_are_finished(qwen3):
    cfg, params = qwen3
    full = greedy(cfg, params, *prompts(cfg.vocab_size))
    out = greedy(cfg, params, *prompts(cfg.vocab_size, rows=3))  # the same first three prompts, and one empty row
    np.testing.assert_array_equal(out.lengths, [N_NEW] * 3 + [0])
    np.testing.assert_array_equal(np.asarray(out.tokens)[:3], np.asarray(full.tokens)[:3])


@pytest.mark.parametrize("slots", [None, 0], ids=["tables", "per_row"])
def test_perturbed_rows_equal_explicit_weights(qwen3, slots):
    """Rows of three members generate exactly what each member's explicitly built weights W + a bᵀ generate, with
    the factors in member tables of the three members (by default) and gathered per row (member_slots 0)."""
    cfg, params = qwen3
    tokens, mask = prompts(cfg.vocab_size, seed=4)
    member = jnp.array([2, 0, 1, 2])
    rng = np.random.default_rng(11)

    def rank1(lead, d_in, d_out):  # scaled so that members differ visibly from the base model
        return LowRank(
            0.1 * rng.standard_normal((*lead, d_in, 1), np.float32), rng.standard_normal((*lead, d_out, 1), np.float32)
        )

    # Rank 1 on every matrix: layer-stacked factors [L, 3, in, 1], and the head's [3, in, 1].
    matrices = {n: w.shape for n, w in params["layers"].items() if w.ndim == 3}
    deltas = {"layers": {n: rank1((L, 3), d_in, d_out) for n, (L, d_in, d_out) in matrices.items()}}
    deltas["lm_head"] = rank1((3,), cfg.hidden_size, cfg.vocab_size)
    ours = greedy(cfg, params, tokens, mask, perturb=Perturbation(deltas, member), member_slots=slots)
    assert (np.asarray(ours.tokens) != np.asarray(greedy(cfg, params, tokens, mask).tokens)).any()
    if slots is None:
        text = lower_generate(cfg, params, tokens, jax.random.key(0), max_new_tokens=N_NEW, temperature=0.0,
                              prompt_mask=mask, perturb=Perturbation(deltas, member), member_slots=3).as_text()  # fmt: skip
        L, D = cfg.num_layers, cfg.hidden_size
        assert f"tensor<{L}x1x3x{D}x1xf32>" in text and f"tensor<{L}x4x{D}x1xf32>" not in text  # a table, no rows'
        with pytest.raises(ValueError, match="member_slots = 2 is fewer than the 3 distinct members"):
            greedy(cfg, params, tokens, mask, perturb=Perturbation(deltas, member), member_slots=2)
    for m in range(3):
        explicit = {**params, "layers": dict(params["layers"])}
        for name, d in deltas["layers"].items():
            explicit["layers"][name] = params["layers"][name] + jnp.einsum("lir,lor->lio", d.a[:, m], d.b[:, m])
        explicit["lm_head"] = params["lm_head"] + deltas["lm_head"].a[m] @ deltas["lm_head"].b[m].T
        ref = greedy(cfg, explicit, tokens, mask)
        rows = np.asarray(member) == m
        np.testing.assert_array_equal(np.asarray(ours.tokens)[rows], np.asarray(ref.tokens)[rows])
        np.testing.assert_allclose(np.asarray(ours.logprobs)[rows], np.asarray(ref.logprobs)[rows], atol=1e-4)


def test_sharded_generation_equals_unsharded(qwen3):
    """Rows split over 8 devices (each decoding its own in shard_map) give the single-device result, sampled and
    perturbed; and a row's draw depends only on its own prompt, key and index, not on the other rows."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    cfg, params = qwen3
    tokens, mask = (np.tile(x, (2, 1)) for x in prompts(cfg.vocab_size, seed=5))  # 8 rows
    member = jnp.arange(8) % 4
    deltas = rank1_deltas(params, 4, seed=3)  # the shapes of test_row_offset_chunks_equal_whole's whole batch
    kw = dict(max_new_tokens=N_NEW, **NUCLEUS)
    one = generate(cfg, params, tokens, jax.random.key(9), prompt_mask=mask, perturb=Perturbation(deltas, member), **kw)

    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    rows = NamedSharding(mesh, PartitionSpec("data"))
    put = functools.partial(jax.device_put, device=rows)
    many = generate(
        cfg,
        params,
        put(tokens),
        jax.random.key(9),
        prompt_mask=put(mask),
        perturb=Perturbation(deltas, put(member)),
        **kw,
    )
    assert many.tokens.sharding.spec[0] == "data"
    for field in ("tokens", "lengths", "steps"):
        np.testing.assert_array_equal(np.asarray(getattr(one, field)), np.asarray(getattr(many, field)))
    # Float32 rounding differs between the GEMM shapes of 8 rows and of 1 row per device (by ~1e-5).
    np.testing.assert_allclose(np.asarray(one.logprobs), np.asarray(many.logprobs), atol=1e-4)

    # Row 0 alone, its batch mates replaced by other prompts: the same tokens.
    other = tokens.copy()
    other[1:] = np.roll(tokens[1:], 1, axis=1)
    alone = generate(
        cfg, params, other, jax.random.key(9), prompt_mask=mask, perturb=Perturbation(deltas, member), **kw
    )
    np.testing.assert_array_equal(np.asarray(alone.tokens)[0], np.asarray(one.tokens)[0])


_ONE_CACHE = """
import jax, jax.numpy as jnp
from esroll import parallel, sharding
from esroll.models import abstract_params, model_config
from esroll.plan import topology_mesh
from esroll.sampling import lower_generate

mesh, _ = topology_mesh("v5e:2x2", 2)
cfg = model_config("qwen3-0.6b", 2)
params = sharding.decoding_copy(mesh, abstract_params(cfg), "bfloat16")
rows, P, N = 64, 256, 512
prompt = jax.ShapeDtypeStruct((rows, P), jnp.int32, sharding=parallel.rows(mesh))
mask = jax.ShapeDtypeStruct((rows, P), bool, sharding=parallel.rows(mesh))
key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=parallel.replicated(mesh))
lowered = lower_generate(cfg, params, prompt, key, max_new_tokens=N, prompt_mask=mask, temperature=1.0, phases=4)
cache = 2 * cfg.num_layers * (rows // 2) * (cfg.num_kv_heads // 2) * (P - 1 + N) * cfg.head_dim * 2  # per chip, bf16
print(cache, lowered.compile().memory_analysis().temp_size_in_bytes)
"""


@pytest.mark.e2e
def test_decode_phases_share_one_cache_of_every_slot():
    """`generate` allocates its KV cache once, with every slot the call can fill, and each decode phase reads the
    slots it can have filled, in place: compiled for a TPU v5e 2x2 slice that is not there (libtpu, deviceless; in a
    process of its own, without the test session's XLA flags), with the model split over 2 chips (GSPMD),
    Qwen3-0.6B's shapes at 2 layers, 32 rows per chip, 4 phases of 512 new tokens, its temporaries per chip hold
    less than 1.5 caches. A cache grown between phases held 2.3 (the last phase's and the one before it alive at
    once, and copies)."""
    pytest.importorskip("libtpu")
    import os
    import subprocess
    import sys

    from conftest import REPO

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    run = subprocess.run([sys.executable, "-c", _ONE_CACHE], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    cache, temp = (int(x) for x in run.stdout.split()[-2:])
    assert cache <= temp < 1.5 * cache, (temp, cache)


def test_long_generation_across_decode_phases(qwen3):
    """40 steps decode in two phases (each reading the slots it can have filled): sampled tokens and their
    log-probabilities still equal a full forward's over the whole sequence, on both sides of the phase boundary."""
    from esroll.sampling import _phase_ends

    cfg, params = qwen3
    assert _phase_ends(40) == [20, 40] and _phase_ends(64) == [16, 32, 48, 64] and _phase_ends(12) == [12]
    tokens, mask = prompts(cfg.vocab_size, seed=6)
    out = generate(cfg, params, tokens, jax.random.key(4), max_new_tokens=40, prompt_mask=mask, temperature=1.0)
    assert int(out.steps) == 40 and (np.asarray(out.lengths) == 40).all()
    ref = seq_logprobs(cfg, params, tokens, mask, out.tokens, np.ones((4, 40), bool))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref), atol=1e-4)


def rank1_deltas(params, members: int, seed: int, head: bool = False) -> dict:
    """Rank-1 `LowRank` factors of `members` members on every layer matrix (and the head's, with `head`), scaled so
    that members differ visibly from the base model."""
    rng = np.random.default_rng(seed)

    def rank1(lead, d_in, d_out):
        return LowRank(
            0.1 * rng.standard_normal((*lead, members, d_in, 1), np.float32),
            rng.standard_normal((*lead, members, d_out, 1), np.float32),
        )

    matrices = {n: w.shape for n, w in params["layers"].items() if w.ndim == 3}
    deltas = {"layers": {n: rank1((L,), d_in, d_out) for n, (L, d_in, d_out) in matrices.items()}}
    if head:
        deltas["lm_head"] = rank1((), *params["lm_head"].shape)
    return deltas


def test_cached_forward_equals_cache_free(qwen3):
    """A prefill into the layer-stacked cache and two decode steps give the logits of one cache-free forward over
    the whole sequence, and the cache holds every layer's keys at their slots; perturbed rows included."""
    from esroll.models import init_cache

    cfg, params = qwen3
    tokens, mask = prompts(cfg.vocab_size, seed=7)
    perturb = Perturbation(rank1_deltas(params, 3, seed=2), jnp.array([2, 0, 1, 2]))
    step = jax.jit(
        lambda params, tokens, mask, cache: forward(cfg, params, tokens, mask_BxT=mask, cache=cache, perturb=perturb)
    )
    cache = init_cache(cfg, batch=4, max_len=tokens.shape[1] + 2)
    assert cache.k.shape == (cfg.num_layers, 4, cfg.num_kv_heads, tokens.shape[1] + 2, cfg.head_dim)
    logits, cache = step(params, tokens, mask, cache)
    steps, seq, seq_mask = [logits[:, -1]], tokens, mask
    for _ in range(2):
        new = jnp.argmax(logits[:, -1:], -1).astype(jnp.int32)
        seq, seq_mask = jnp.concatenate([seq, new], 1), np.concatenate([seq_mask, np.ones((4, 1), bool)], 1)
        logits, cache = step(params, new, np.ones((4, 1), bool), cache)
        steps.append(logits[:, -1])
    full, _ = forward(cfg, params, seq, mask_BxT=seq_mask, perturb=perturb)
    np.testing.assert_allclose(np.stack(steps, 1), np.asarray(full)[:, -3:], atol=1e-5, rtol=1e-5)
    assert int(cache.index) == seq.shape[1]
    np.testing.assert_array_equal(cache.valid_BxS, seq_mask)


def test_scan_unroll_changes_nothing(qwen3):
    """The layer scan's `unroll` is a speed knob: all layers unrolled into one iteration give the one-layer scan's
    greedy tokens exactly, and its log-probabilities, across a decode-phase boundary. Perturbed
    rows (factors of every matrix, the head's included, scanned with the layers): an unperturbed run scans the same
    layers with no factors, a subset of this case."""
    from esroll.sampling import _phase_ends

    assert _phase_ends(32, phases=2) == [16, 32]
    cfg, params = qwen3
    tokens, mask = prompts(cfg.vocab_size, seed=8)
    perturb = Perturbation(rank1_deltas(params, 3, seed=5, head=True), jnp.array([1, 2, 0, 1]))
    run = functools.partial(
        generate, cfg, params, tokens, jax.random.key(0), max_new_tokens=32, temperature=0.0, prompt_mask=mask
    )
    ref = run(perturb=perturb, phases=2)
    ours = run(perturb=perturb, phases=2, unroll=cfg.num_layers)
    np.testing.assert_array_equal(np.asarray(ours.tokens), np.asarray(ref.tokens))
    np.testing.assert_allclose(np.asarray(ours.logprobs), np.asarray(ref.logprobs), atol=1e-5)


def test_greedy_token_of_a_nan_row_is_in_the_vocabulary():
    """Greedy decoding picks `jnp.argmax`'s index: a row whose logits hold a NaN gets the NaN's index (a real token
    id), never an id outside the vocabulary."""
    from esroll.sampling import _sample

    logits = jnp.array([[0.0, 3.0, 1.0, 2.0], [0.0, jnp.nan, 5.0, 1.0]])
    keys = jax.random.split(jax.random.key(0), 2)
    np.testing.assert_array_equal(np.asarray(_sample(logits, logits.max(-1), keys, 0.0, 0, 1.0)), [1, 1])


def test_row_offset_chunks_equal_whole(qwen3):
    """Rows 0-3 and 4-7 of a sampled batch of perturbed members, decoded as two calls with row_offset 0 and 4, are
    exactly the rows of the batch decoded at once; the two chunks share one compilation (row_offset is traced). (An
    unperturbed batch keys its rows' noise by the same global row index, a subset of this case.) The shapes are
    test_sharded_generation_equals_unsharded's (the whole batch) and test_low_precision's (the chunks): shared
    compilations."""
    from esroll.sampling import _generate

    cfg, params = qwen3
    tokens, mask = (np.concatenate(x) for x in zip(prompts(cfg.vocab_size, seed=9), prompts(cfg.vocab_size, seed=10)))
    member = np.array([0, 1, 2, 0, 3, 1, 2, 3])  # 3 members in each chunk: member tables there too
    deltas = rank1_deltas(params, 4, seed=6)
    run = functools.partial(generate, cfg, params, key=jax.random.key(7), max_new_tokens=N_NEW)

    def chunk(rows, **extra):
        perturb = Perturbation(deltas, jnp.asarray(member[rows]))
        return run(prompt_BxP=tokens[rows], prompt_mask=mask[rows], perturb=perturb, **NUCLEUS, **extra)

    whole = chunk(slice(0, 8))
    first = chunk(slice(0, 4), row_offset=0)
    compiled = _generate._cache_size()
    second = chunk(slice(4, 8), row_offset=jnp.int32(4))
    assert _generate._cache_size() == compiled
    joined = {
        f: np.concatenate([np.asarray(getattr(first, f)), np.asarray(getattr(second, f))])
        for f in ("tokens", "logprobs", "lengths")
    }
    np.testing.assert_array_equal(joined["tokens"], np.asarray(whole.tokens))
    np.testing.assert_array_equal(joined["lengths"], np.asarray(whole.lengths))
    # Float32 rounding differs between the GEMM shapes of 8 rows and of 4.
    np.testing.assert_allclose(joined["logprobs"], np.asarray(whole.logprobs), atol=1e-5)
    assert (np.asarray(first.tokens) != np.asarray(second.tokens)).any()


@pytest.fixture(scope="module")
def model_axis_case(qwen3):
    """8 prompts, 4 members' rank-1 factors, and their greedy generation on one device."""
    cfg, params = qwen3
    tokens, mask = (np.tile(x, (2, 1)) for x in prompts(cfg.vocab_size, seed=11))
    member, deltas = np.arange(8) % 4, rank1_deltas(params, 4, seed=12)
    one = generate(
        cfg,
        params,
        tokens,
        jax.random.key(0),
        max_new_tokens=N_NEW,
        temperature=0.0,
        prompt_mask=mask,
        perturb=Perturbation(deltas, member),
    )
    return tokens, mask, member, deltas, one


@pytest.mark.parametrize("layout", ["interleaved", "member_major"])
@pytest.mark.parametrize("model", [2, 1], ids=["tp", "model1"])
def test_model_axis_generation_equals_one_device(qwen3, model_axis_case, model, layout):
    """On an (8 / model) x model ("data", "model") mesh, with heads, MLP columns and their low-rank factors split over
    "model", greedy perturbed generation gives the one-device result: one GSPMD program when the model axis has 2
    devices, and the per-device shard_map loop when it has 1. Rows of members interleaved (0 1 2 3 0 1 2 3: each
    device's rows need as many members as they are rows, so each row's factors are gathered) or member-major (0 0 1
    1 2 2 3 3: member tables, one block per device along "data")."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    cfg, params = qwen3
    tokens, mask, member, deltas, one = model_axis_case
    if layout == "member_major":  # the same rows in member order: row (m, j) is the interleaved row 4j + m
        order = np.argsort(member, kind="stable")
        tokens, mask, member = tokens[order], mask[order], member[order]
        one = jax.tree.map(lambda x: np.asarray(x)[order] if np.ndim(x) else x, one)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(8 // model, model), ("data", "model"))
    at = lambda *spec: NamedSharding(mesh, PartitionSpec(*spec))
    # (in, out) splits of each layer matrix [L, I, O]: columns of q/k/v/gate/up, rows of o/down over "model".
    splits = {n: (None, "model") for n in ("q", "k", "v", "gate", "up")} | {
        "o": ("model", None),
        "down": ("model", None),
    }
    layer_params = {
        n: jax.device_put(w, at(None, *splits[n]) if n in splits else at()) for n, w in params["layers"].items()
    }
    sharded = {n: jax.device_put(w, at()) for n, w in params.items() if n != "layers"} | {"layers": layer_params}
    # A factor follows its weight: a [L, M, I, R] splits I as the weight's rows, b [L, M, O, R] O as its columns.
    sharded_deltas = {
        "layers": {
            n: LowRank(
                jax.device_put(d.a, at(None, None, splits[n][0])), jax.device_put(d.b, at(None, None, splits[n][1]))
            )
            for n, d in deltas["layers"].items()
        }
    }
    rows = functools.partial(jax.device_put, device=at("data"))
    args = (cfg, sharded, rows(tokens), jax.random.key(0))
    perturb = Perturbation(sharded_deltas, rows(member))
    kw = {"max_new_tokens": N_NEW, "temperature": 0.0, "prompt_mask": rows(mask), "perturb": perturb}
    many = generate(*args, **kw)
    # shard_map (a manual computation) only without a model axis: with one, a single GSPMD-partitioned program.
    text = lower_generate(*args, **kw).as_text()
    assert ("manual_computation" in text) == (model == 1)
    # member-major over "data" 4: each device's two rows are one member's, a table of 1 entry per device
    table = f"tensor<{cfg.num_layers}x4x1x{cfg.hidden_size}x1xf32>"
    assert (table in text) == (layout == "member_major" and model == 2)
    assert many.tokens.sharding.spec[0] == "data"
    np.testing.assert_array_equal(np.asarray(many.tokens), np.asarray(one.tokens))
    np.testing.assert_array_equal(np.asarray(many.lengths), np.asarray(one.lengths))
    np.testing.assert_allclose(np.asarray(many.logprobs), np.asarray(one.logprobs), atol=1e-4)


def test_low_precision_weights_decode_in_their_dtype(qwen3):
    """bfloat16 weights decode in bfloat16 on every platform (no float32 copy): the cache is bfloat16, and the tokens
    are bfloat16 compute's, not those of the float32 cast of the same weights."""
    cfg, params = qwen3
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    widened = jax.tree.map(lambda x: x.astype(jnp.float32), bf16)
    tokens, mask = prompts(cfg.vocab_size, seed=3)
    perturb = Perturbation(rank1_deltas(params, 4, seed=4), jnp.array([2, 0, 1, 2]))  # the row-offset chunks' shapes
    kw = dict(max_new_tokens=N_NEW, prompt_mask=mask, perturb=perturb, **NUCLEUS)
    ours = generate(cfg, bf16, tokens, jax.random.key(1), **kw)
    ref = generate(cfg, widened, tokens, jax.random.key(1), **kw)
    assert not np.array_equal(np.asarray(ours.logprobs), np.asarray(ref.logprobs))
    text = lower_generate(cfg, bf16, tokens, jax.random.key(1), **kw).as_text()
    cache = re.findall(
        rf"tensor<{cfg.num_layers}x4x{cfg.num_kv_heads}x\d+x{cfg.head_dim}x(\w+)>", text
    )  # [L, B, K, S, H]
    assert cache and set(cache) == {"bf16"}
