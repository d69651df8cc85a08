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

Keys: the draw of one (leaf, layer, direction) has the key key → fold_in(step) → fold_in(crc32(path) mod 2³¹) →
fold_in(layer) → fold_in(direction) (layer 0 for a single leaf), and is `jax.random.normal(k, (in + out, r),
jnp.float32)` for a lowrank leaf (the first `in` rows are A, the rest B) or `jax.random.normal(k, (dim,),
jnp.float32)` for a dense one: the numbers are whatever `jax.random` draws for that key, so they follow its settings
(`jax_threefry_partitionable`, on by default). Keys must be threefry2x32 (JAX's default), whose draws are the same
under `vmap` as one by one and on any device. No draw depends on the device count, the batch layout, chunking or
sharding, or the order of the leaves, and adding a leaf does not change the others.

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

from esroll.config import nested
from esroll.models import STACKED, LowRank

Array = jax.Array
LOWRANK, DENSE = "lowrank", "dense"


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
    return nested(flat, "/")


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
    leaves, without the L axis for single leaves. Each (layer, direction) is one `jax.random.normal` draw under its
    own key (the module docstring), vmapped over the leaf's (layer, direction) pairs.
    """
    step_key = jax.random.fold_in(key, step)
    if jax.random.key_data(step_key).shape != (2,):
        raise ValueError(f"ES noise is drawn with threefry2x32 keys (JAX's default), got {jax.random.key_impl(key)}")
    flat = flatten(params)
    out = {}
    for path, kind in kinds.items():
        shape = flat[path].shape
        layers, per_layer = (shape[0], shape[1:]) if is_stacked(path) else (1, shape)
        draw = (per_layer[0] + per_layer[1], rank) if kind == LOWRANK else tuple(per_layer)
        leaf_key = jax.random.fold_in(step_key, zlib.crc32(path.encode()) & 0x7FFFFFFF)
        x = _normals(leaf_key, layers, directions_E, draw)  # [layers, E, *draw]
        v = LowRank(x[:, :, : per_layer[0]], x[:, :, per_layer[0] :]) if kind == LOWRANK else x
        out[path] = v if is_stacked(path) else jax.tree.map(lambda a: a[0], v)
    return unflatten(out)


@functools.partial(jax.jit, static_argnums=(1, 3))  # one program, not op-by-op dispatch, when called eagerly
def _normals(leaf_key: Array, layers: int, directions_E: Array, shape: tuple) -> Array:
    """[layers, E, *shape]: entry (l, e) is `jax.random.normal(fold_in(fold_in(leaf_key, l), directions_E[e]), shape)`,
    one flat vmap over the (layer, direction) pairs."""
    E = directions_E.shape[0]
    layer_N = jnp.repeat(jnp.arange(layers), E)
    direction_N = jnp.tile(directions_E, layers)

    def one(layer, direction):
        k = jax.random.fold_in(jax.random.fold_in(leaf_key, layer), direction)
        return jax.random.normal(k, shape, jnp.float32)

    return jax.vmap(one)(layer_N, direction_N).reshape((layers, E) + tuple(shape))


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
