"""EGGROLL noise as a pure function of (key, step, leaf, layer, direction).

Parameters are a nested dict of arrays; a leaf is named by its path, its dict keys joined by "/" ("layers/q",
"embed"). Leaves under the top-level key `esroll.models.STACKED` ("layers") are layer-stacked ([L, in, out] or
[L, dim]) and every layer gets its own draw; other leaves are single ([in, out] or [dim]). Each leaf is one of
    lowrank  a matrix (per layer): direction k gets A_k [in, r], B_k [out, r] i.i.d. N(0, 1), E_k = A_k B_kᵀ / √r;
    dense    a vector (per layer): direction k gets ε_k [dim] i.i.d. N(0, 1);
    frozen   not perturbed, not updated.
The kind comes from regexes on the path (`re.fullmatch`): the first of frozen_patterns, then lowrank_patterns
(matrices only), then dense_patterns (vectors only) that matches decides; a leaf matched by none is frozen.
ESConfig's defaults freeze "embed" and "lm_head" (as the EGGROLL reference does: they are the largest matrices and
a low-rank perturbation of a vocabulary table moves every token's embedding), perturb every other matrix low-rank and
freeze vectors (norm scales, biases: few parameters, and they rescale whole activations); opt vectors in with e.g.
dense_patterns=(".*norm", ".*bias").

Keys: key → fold_in(step) → fold_in(crc32(path)) → fold_in(layer) → fold_in(direction) → fold_in(block b); the draw
of one (leaf, layer, direction) is its blocks of BLOCK numbers, block b being `jax.random.normal(k_b, (BLOCK,))`
as JAX draws it with `jax_threefry_partitionable` on (its default; the noise does not read that flag), concatenated
and cut to [in + out, r] (row-major: the first `in` rows are A, the rest B) or to [dim]. No draw depends on the
device count, the batch layout, chunking or sharding, or the order of the leaves, and adding a leaf does not change
the others.

Shape letters (see `esroll`): L layers, E directions, M population members, R rank.
"""

from __future__ import annotations

import functools
import math
import re
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from esroll.models import STACKED, LowRank

Array = jax.Array
LOWRANK, DENSE = "lowrank", "dense"
BLOCK = 128  # noise is drawn in blocks of this many numbers (part of the definition of the stream)


def _is_leaf(x) -> bool:
    """Only dicts are inner nodes: `LowRank` factors (a NamedTuple), arrays, and shape tuples are leaves."""
    return not isinstance(x, dict)


def path_name(key_path: tuple) -> str:
    """A `jax.tree_util` key path as a leaf name: ("layers", "q") -> "layers/q"."""
    return jax.tree_util.keystr(key_path, simple=True, separator="/")


def flatten(tree: dict) -> dict[str, Any]:
    """{"layers": {"q": x}} -> {"layers/q": x}; LowRank factors count as leaves."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)
    return {path_name(key_path): leaf for key_path, leaf in leaves}


def map_with_path(fn, tree: dict) -> dict:
    """tree with every leaf x replaced by fn(path, x) (LowRank factors count as leaves)."""
    return jax.tree_util.tree_map_with_path(lambda key_path, x: fn(path_name(key_path), x), tree, is_leaf=_is_leaf)


def unflatten(flat: dict[str, Any]) -> dict:
    """The inverse of `flatten`."""
    tree: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def is_stacked(path: str) -> bool:
    """Whether the leaf at `path` is layer-stacked: it lies under the top-level key `esroll.models.STACKED`."""
    return path.startswith(STACKED + "/")


def plan(params: dict, lowrank_patterns=(".*",), dense_patterns=(), frozen_patterns=()) -> dict[str, str]:
    """The perturbed leaves: path -> LOWRANK | DENSE (frozen leaves are absent). Static: uses shapes only."""

    def matches(patterns, path):
        return any(re.fullmatch(p, path) for p in patterns)

    kinds = {}
    for path, leaf in flatten(params).items():
        ndim = leaf.ndim - is_stacked(path)
        if matches(frozen_patterns, path):
            continue
        if ndim == 2 and matches(lowrank_patterns, path):
            kinds[path] = LOWRANK
        elif ndim == 1 and matches(dense_patterns, path):
            kinds[path] = DENSE
    return kinds


def factors(key: Array, step, params: dict, kinds: dict[str, str], rank: int, directions_E: Array) -> dict:
    """Unscaled N(0, 1) noise of directions `directions_E` (int array), generated once per step, float32.

    Mirrors `params` for perturbed leaves: LowRank(a [L, E, in, R], b [L, E, out, R]) or ε [L, E, dim] for stacked
    leaves, without the L axis for single leaves. Block b of a draw holds `jax.random.normal(k_b, (BLOCK,))` for its
    key k_b (the module docstring), bit for bit. The blocks' keys come from one vmapped chain of `jax.random.fold_in`
    over all blocks of all leaves; the numbers are drawn straight into each factor's layout by `_draws` (the hash
    unrolled into XLA's fused loops, no block buffer written and cut afterwards).
    """
    flat = flatten(params)
    leaves = []  # (path, layers, draw shape, blocks per draw)
    for path, kind in kinds.items():
        shape = flat[path].shape
        layers, per_layer = (shape[0], shape[1:]) if is_stacked(path) else (1, shape)
        draw = (per_layer[0] + per_layer[1], rank) if kind == LOWRANK else tuple(per_layer)  # A: first `in` rows
        leaves.append((path, layers, draw, -(-math.prod(draw) // BLOCK)))
    # One row per (leaf, layer, direction, block), leaf-major; one flat vmap (nested vmaps compile slowly on CPU).
    E = directions_E.shape[0]
    ids = []
    for path, layers, _, nb in leaves:
        shape = (layers, E, nb)
        leaf = jnp.full(shape, zlib.crc32(path.encode()) & 0x7FFFFFFF, jnp.int32)
        layer = jnp.broadcast_to(jnp.arange(layers)[:, None, None], shape)
        direction = jnp.broadcast_to(directions_E[None, :, None], shape)
        block = jnp.broadcast_to(jnp.arange(nb)[None, None, :], shape)
        ids.append(jnp.stack([leaf, layer, direction, block], -1).reshape(-1, 4))
    step_key = jax.random.fold_in(key, step)

    def block_key(ids_4: Array) -> Array:
        k = step_key
        for i in range(4):
            k = jax.random.fold_in(k, ids_4[i])
        return jax.random.key_data(k)

    if jax.random.key_data(step_key).shape != (2,):
        raise ValueError(f"ES noise is drawn with threefry2x32 keys (JAX's default), got {jax.random.key_impl(key)}")
    keys = jax.vmap(block_key)(jnp.concatenate(ids))  # [rows of ids, 2] uint32

    out, x = {}, 0
    for path, layers, draw, nb in leaves:
        k = keys[x : x + layers * E * nb].reshape(layers, E, nb, 2)
        x += layers * E * nb
        if kinds[path] == LOWRANK:
            (m, o), r = flat[path].shape[-2:], draw[1]  # A is the draw's first m·r numbers, B the rest
            v = LowRank(_draws(k, 0, (m, r)), _draws(k, m * r, (o, r)))
        else:
            v = _draws(k, 0, draw)
        out[path] = v if is_stacked(path) else jax.tree.map(lambda a: a[0], v)
    return unflatten(out)


@functools.partial(jax.jit, static_argnums=(1, 2))  # one program, not op-by-op dispatch, when called eagerly
def _draws(keys: Array, start: int, shape: tuple) -> Array:
    """Numbers start … start + prod(shape) − 1 of each draw whose blocks have keys `keys` [..., blocks, 2], as
    [..., *shape]: number j is entry j mod BLOCK of `jax.random.normal(key of block j // BLOCK, (BLOCK,))`.

    That is the threefry-2x32 hash of counter (0, j mod BLOCK) under the block's key, its two words xor-ed
    (`jax.random.bits` with `jax_threefry_partitionable`, the default), turned into a normal as `jax.random.normal`
    does (a uniform on (−1, 1) from the top 23 bits, then √2·erfinv); the tests check it against `jax.random.normal`
    bit for bit. Written out here because XLA's CPU backend gets JAX's threefry as a loop of five passes over the
    whole array (its CPU lowering rolls the rounds up): at Qwen3-0.6B shapes (20.2M numbers, 2 cores, README) the
    factors took a median of 303 ms that way and 96 ms as one fusion per factor (alternating calls, one process).
    """
    count = math.prod(shape)
    blocks = keys.shape[-2]
    # Each block's key repeated over its BLOCK numbers, then cut to this factor's numbers (all fused: no copies).
    k1, k2 = (
        jnp.broadcast_to(keys[..., i, None], keys.shape[:-1] + (BLOCK,)).reshape(keys.shape[:-2] + (blocks * BLOCK,))[
            ..., start : start + count
        ]
        for i in (0, 1)
    )
    counter = jnp.arange(start, start + count, dtype=jnp.uint32) % BLOCK
    hi, lo = _threefry2x32(k1, k2, jnp.zeros_like(counter), counter)
    bits = hi ^ lo
    one = jnp.float32(1.0)
    unit = jax.lax.bitcast_convert_type((bits >> 9) | jnp.uint32(0x3F800000), jnp.float32) - one  # [0, 1)
    low = jnp.float32(np.nextafter(np.float32(-1.0), np.float32(0.0)))
    uniform = jnp.maximum(low, unit * (one - low) + low)
    return (jnp.float32(np.sqrt(2)) * jax.lax.erf_inv(uniform)).reshape(keys.shape[:-2] + tuple(shape))


def _threefry2x32(k1: Array, k2: Array, x1: Array, x2: Array) -> tuple[Array, Array]:
    """The threefry-2x32 block cipher (20 rounds) of counters (x1, x2) under keys (k1, k2), uint32, unrolled."""
    rotations = ((13, 15, 26, 6), (17, 29, 16, 24))
    ks = (k1, k2, k1 ^ k2 ^ jnp.uint32(0x1BD11BDA))
    x1, x2 = x1 + ks[0], x2 + ks[1]
    for i in range(5):
        for r in rotations[i % 2]:
            x1 = x1 + x2
            x2 = x1 ^ ((x2 << r) | (x2 >> (32 - r)))
        x1, x2 = x1 + ks[(i + 1) % 3], x2 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
    return x1, x2


def member_deltas(factors_tree: dict, params: dict, direction_M: Array, scale_M: Array, rank: int) -> dict:
    """Member-level deltas for `Perturbation`: member i is θ + scale_i·E_{direction_i}.

    Low-rank: a_i = scale_i/√r · A, b_i = B; dense: scale_i · ε. The member axis M replaces the direction axis E
    (after L for stacked leaves). Cast to each leaf's dtype.
    """
    flat_params = flatten(params)

    def scaled(x, s_M, axis, dtype):  # gather each member's direction along `axis`, times its scale
        s = s_M.reshape((1,) * axis + (-1,) + (1,) * (x.ndim - axis - 1))
        return (jnp.take(x, direction_M, axis=axis) * s).astype(dtype)

    def deltas(path, f):
        axis, dtype = (1 if is_stacked(path) else 0), flat_params[path].dtype  # the direction axis
        if isinstance(f, LowRank):
            a = scaled(f.a, scale_M / math.sqrt(rank), axis, dtype)
            return LowRank(a, scaled(f.b, jnp.ones_like(scale_M), axis, dtype))
        return scaled(f, scale_M, axis, dtype)

    return map_with_path(deltas, factors_tree)
