"""Where every parameter lives on the ("data", "model") mesh: logical axis names per leaf, and two sets of rules.

Each leaf's dimensions get logical names (`LOGICAL`, keyed by the leaf's name: "q" is (layers, embed, heads)), and a
rule table maps names to mesh axes, with flax's `logical_to_mesh_axes`:

    compute  the copy rollouts decode with, in `model.dtype`: attention heads, MLP columns and the vocabulary split
             over "model" (tensor parallelism: each device holds 1/model of every large matrix and of the KV cache's
             heads), replicated over "data" (every data-parallel group holds the whole model once);
    master   what the optimizer updates and checkpoints save, in `model.master_dtype`, with its optimizer state: the
             compute rules plus the hidden ("embed") dimension split over "data" (FSDP / ZeRO-3: no device holds more
             than 1/devices of the master weights or of the Adam moments).

A dimension whose size the mesh axis does not divide stays unsplit (e.g. a 97-token vocabulary on a model axis of 2;
the test is on the dimension's size, so 8 KV heads of 128 on a model axis of 16 do split, half a head per device),
and an axis of size 1 is dropped, so a (n, 1) mesh gives plain replicated compute parameters. Low-rank factors of a
perturbation follow their weight: a [L, M, I, R] splits I as the weight's input dimension, b [L, M, O, R] O as its
output dimension; the member and rank axes are never split.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from esroll.models import STACKED, LowRank
from esroll.parallel import DATA, MODEL

Array = jax.Array

# Logical axes of every leaf, by its name (the last path component). Stacked leaves start with "layers".
LOGICAL = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm": ("embed",),
    "attn_norm": ("layers", "embed"),
    "mlp_norm": ("layers", "embed"),
    "q": ("layers", "embed", "heads"),
    "k": ("layers", "embed", "kv_heads"),
    "v": ("layers", "embed", "kv_heads"),
    "o": ("layers", "heads", "embed"),
    "q_bias": ("layers", "heads"),
    "k_bias": ("layers", "kv_heads"),
    "v_bias": ("layers", "kv_heads"),
    "o_bias": ("layers", "embed"),
    "q_norm": ("layers", "head_dim"),
    "k_norm": ("layers", "head_dim"),
    "gate": ("layers", "embed", "mlp"),
    "up": ("layers", "embed", "mlp"),
    "down": ("layers", "mlp", "embed"),
    "value_head": ("embed", None),  # a critic's (`esroll.critic`)
    "value_bias": (None,),
}
COMPUTE_RULES = (("heads", MODEL), ("kv_heads", MODEL), ("mlp", MODEL), ("vocab", MODEL))
MASTER_RULES = (*COMPUTE_RULES, ("embed", DATA))


def leaf_spec(mesh: Mesh, name: str, shape: tuple[int, ...], rules, layer: bool = False) -> PartitionSpec:
    """The PartitionSpec of leaf `name` of `shape` under `rules`, keeping only splits the mesh axis divides. With
    `layer`, the leaf is one layer's slice of a stacked leaf (its logical axes without the leading "layers")."""
    logical = LOGICAL.get(name, (None,) * (len(shape) + layer))[layer:]
    if len(logical) != len(shape):
        raise ValueError(f"parameter {name!r} has shape {shape}, expected {len(logical)} dimensions")
    spec = nn.logical_to_mesh_axes(logical, rules)
    kept = [a if a is not None and mesh.shape[a] > 1 and n % mesh.shape[a] == 0 else None for a, n in zip(spec, shape)]
    while kept and kept[-1] is None:
        kept.pop()
    return PartitionSpec(*kept)


def _map_named(fn, tree: dict) -> dict:
    """tree with every array(-like) leaf x replaced by fn(leaf name, x)."""
    return jax.tree_util.tree_map_with_path(lambda path, x: fn(path[-1].key, x), tree)


def _shardings(mesh: Mesh, params: dict, rules, layer: bool) -> dict:
    return _map_named(lambda name, x: NamedSharding(mesh, leaf_spec(mesh, name, tuple(x.shape), rules, layer)), params)


def compute_shardings(mesh: Mesh, params: dict, *, layer: bool = False) -> dict:
    """Shardings of the decoding copy of `params` (arrays or ShapeDtypeStructs): see the module docstring. With
    `layer`, `params` is one layer's weights (a slice of `params[STACKED]`, as inside a scan over layers)."""
    return _shardings(mesh, params, COMPUTE_RULES, layer)


def master_shardings(mesh: Mesh, params: dict, *, layer: bool = False) -> dict:
    """Shardings of the master parameters (and of the optimizer state that mirrors them); `layer` as above."""
    return _shardings(mesh, params, MASTER_RULES, layer)


def delta_shardings(mesh: Mesh, deltas: dict, params: dict) -> dict:
    """Shardings of a perturbation's deltas (`esroll.models.Perturbation.deltas`) that follow the weights' compute
    shardings: LowRank a splits the input dimension as the weight does, b the output dimension; a dense delta
    [(L,) M, n] splits n as the vector does."""

    def follow(path, d):
        names = [p.key for p in path if hasattr(p, "key")]
        name, stacked = names[-1], names[0] == STACKED
        weight = params[STACKED][name] if stacked else params[name]
        spec = tuple(leaf_spec(mesh, name, tuple(weight.shape), COMPUTE_RULES))
        spec = spec + (None,) * (weight.ndim - len(spec))
        lead = (None, None) if stacked else (None,)  # (layers,) members: the member axis is never split
        if isinstance(d, LowRank):
            return LowRank(
                NamedSharding(mesh, PartitionSpec(*lead, spec[-2], None)),
                NamedSharding(mesh, PartitionSpec(*lead, spec[-1], None)),
            )
        return NamedSharding(mesh, PartitionSpec(*lead, spec[-1]))

    return jax.tree_util.tree_map_with_path(follow, deltas, is_leaf=lambda x: isinstance(x, LowRank))


def state_shardings(mesh: Mesh, optimizer, params: dict, state: Any = None) -> Any:
    """Shardings of `optimizer`'s state for `params` (arrays or ShapeDtypeStructs): leaves that mirror a parameter
    take its master sharding, the rest (step counts) are replicated. `state` (the state itself or its abstract
    shapes) spares tracing `optimizer.init` when at hand."""
    state = jax.eval_shape(optimizer.init, params) if state is None else state
    replicated = NamedSharding(mesh, PartitionSpec())
    masters = master_shardings(mesh, params)
    return optax.tree_map_params(optimizer, lambda _, s: s, state, masters, transform_non_params=lambda _: replicated)


def with_shardings(tree, shardings, dtype=None):
    """ShapeDtypeStructs of `tree`'s shapes (and dtypes, or `dtype`) laid out by `shardings`: what ahead-of-time
    lowering and the memory figures read."""

    def abstract(x, s):
        return jax.ShapeDtypeStruct(x.shape, x.dtype if dtype is None else jnp.dtype(dtype), sharding=s)

    return jax.tree.map(abstract, tree, shardings)


def decoding_copy(mesh: Mesh, params: dict, dtype) -> dict:
    """ShapeDtypeStructs of the decoding copy of `params` (`caster`'s output): `dtype`, laid out by the compute
    rules."""
    return with_shardings(params, compute_shardings(mesh, params), dtype)


def master_copy(mesh: Mesh, params: dict, dtype) -> dict:
    """ShapeDtypeStructs of the master parameters of `params`' shapes: `dtype` (`model.master_dtype`), laid out by
    the master rules, as the trainer holds them."""
    return with_shardings(params, master_shardings(mesh, params), dtype)


@functools.cache
def caster(mesh: Mesh, dtype: str):
    """A jitted map from master parameters to the decoding copy: cast to `dtype` and laid out by the compute rules
    (on a mesh with data > 1, this is FSDP's all-gather over "data")."""

    def cast(params):
        out = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), params)
        return jax.lax.with_sharding_constraint(out, compute_shardings(mesh, params))

    return jax.jit(cast)


def place(tree, shardings):
    """`tree` (arrays of one process's full values, every process the same) laid out with `shardings`."""
    return jax.tree.map(
        lambda x, s: x if isinstance(x, jax.Array) and x.sharding == s else jax.device_put(x, s), tree, shardings
    )
