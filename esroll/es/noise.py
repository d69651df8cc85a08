"""EGGROLL noise as a pure function of (key, step, leaf, layer, direction).

Parameters are a nested dict of arrays; a leaf is named by its path ("layers/q", "embed"). Leaves under the top-level
key "layers" are layer-stacked ([L, in, out] or [L, D]) and every layer gets its own draw; other leaves are single
([in, out] or [D]). Each leaf is one of
    lowrank  a matrix (per layer): direction k gets A_k [in, r], B_k [out, r] i.i.d. N(0, 1), E_k = A_k B_kᵀ / √r;
    dense    a vector (per layer): direction k gets ε_k [D] i.i.d. N(0, 1);
    frozen   not perturbed, not updated.
The kind comes from regexes on the path (`re.fullmatch`): the first of frozen_patterns, then lowrank_patterns
(matrices only), then dense_patterns (vectors only) that matches decides; a leaf matched by none is frozen.
ESConfig's defaults freeze "embed" and "lm_head" (as the EGGROLL reference does: they are the largest matrices and
a low-rank perturbation of a vocabulary table moves every token's embedding), perturb every other matrix low-rank and
freeze vectors (norm scales, biases: few parameters, and they rescale whole activations); opt vectors in with e.g.
dense_patterns=(".*norm", ".*bias").

Keys: key → fold_in(step) → fold_in(crc32(path)) → fold_in(layer) → fold_in(direction) → one N(0, 1) draw of
[in + out, r] whose first `in` rows are A and the rest B. No draw
depends on the device count, the batch layout, chunking or sharding, and adding a leaf does not change the others.
"""

from __future__ import annotations

import re
import zlib
from typing import Any

import jax
import jax.numpy as jnp

from esroll.models import LowRank

Array = jax.Array
LOWRANK, DENSE = "lowrank", "dense"


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"layers": {"q": x}} -> {"layers/q": x}; LowRank factors count as leaves."""
    flat = {}
    for name, value in tree.items():
        path = f"{prefix}{name}"
        if isinstance(value, dict):
            flat.update(flatten(value, path + "/"))
        else:
            flat[path] = value
    return flat


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
    return path.startswith("layers/")


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


def _direction_keys(key: Array, step, path: str, layers: int, directions_K: Array) -> Array:
    """Keys [layers, K]: key → step → leaf → layer → direction."""
    leaf_key = jax.random.fold_in(jax.random.fold_in(key, step), zlib.crc32(path.encode()) & 0x7FFFFFFF)
    layer_keys = jax.vmap(lambda l: jax.random.fold_in(leaf_key, l))(jnp.arange(layers))
    return jax.vmap(lambda k: jax.vmap(lambda d: jax.random.fold_in(k, d))(directions_K))(layer_keys)


def _normal(keys_LxK: Array, shape: tuple[int, ...]) -> Array:
    L, K = keys_LxK.shape  # one flat vmap: nested vmaps of the generator compile twice as slowly on CPU
    draws = jax.vmap(lambda k: jax.random.normal(k, shape, jnp.float32))(keys_LxK.reshape(L * K))
    return draws.reshape((L, K) + shape)


def factors(key: Array, step, params: dict, kinds: dict[str, str], rank: int, directions_K: Array) -> dict:
    """Unscaled N(0, 1) noise of directions `directions_K` (int array), generated once per step, float32.

    Mirrors `params` for perturbed leaves: LowRank(a [L, K, in, r], b [L, K, out, r]) or ε [L, K, D] for stacked
    leaves, without the L axis for single leaves.
    """
    flat = flatten(params)
    out = {}
    for path, kind in kinds.items():
        shape = flat[path].shape
        stacked = is_stacked(path)
        keys_LxK = _direction_keys(key, step, path, shape[0] if stacked else 1, directions_K)
        per_layer = shape[1:] if stacked else shape
        if kind == LOWRANK:
            m, n = per_layer
            ab = _normal(keys_LxK, (m + n, rank))  # one draw per (layer, direction): A its first m rows, B the rest
            noise = LowRank(ab[:, :, :m], ab[:, :, m:])
        else:
            noise = _normal(keys_LxK, per_layer)
        out[path] = noise if stacked else jax.tree.map(lambda x: x[0], noise)
    return unflatten(out)


def member_deltas(
    factors_tree: dict, params: dict, direction_N: Array, scale_N: Array, rank: int
) -> dict:
    """Member-level deltas for `Perturbation`: member i is θ + scale_i·E_{direction_i}.

    Low-rank: a_i = scale_i/√r · A, b_i = B; dense: scale_i · ε. Cast to each leaf's dtype.
    """
    flat_params = flatten(params)
    out = {}
    for path, noise in flatten(factors_tree).items():
        axis = 1 if is_stacked(path) else 0  # the direction axis
        dtype = flat_params[path].dtype

        def scaled(x, s_N):
            s = s_N.reshape((1,) * axis + (-1,) + (1,) * (x.ndim - axis - 1))
            return (jnp.take(x, direction_N, axis=axis) * s).astype(dtype)

        if isinstance(noise, LowRank):
            out[path] = LowRank(scaled(noise.a, scale_N / jnp.sqrt(rank)), scaled(noise.b, jnp.ones_like(scale_N)))
        else:
            out[path] = scaled(noise, scale_N)
    return unflatten(out)
