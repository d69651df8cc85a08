"""How `esroll.sampling.generate`'s arguments reach its jitted program, and where that program's rows and KV cache sit
on a mesh.

`_arguments` turns the caller's arguments into the program's: the arrays of parameters and rows positional (parameters,
prompt, mask, key, perturbation, row offset), everything else by keyword: the EOS ids and the pad id as traced arrays,
the rest static (model config, shape and sampling settings, the mesh, the row axis, whether the mesh is tensor
parallel). It takes arrays or, for ahead-of-time lowering, `jax.ShapeDtypeStruct`s. The mesh is read from the prompt's
sharding alone: `_row_split` finds the axis (or axes) that split the rows over more than one device, `_model_split` a
"model" axis of more than one device. With the former only, each device decodes its own rows under `shard_map`; with
the latter, the program is partitioned by GSPMD, and `_constrain_cache` places the KV cache: rows where the prompt's
are, kv heads over "model".

Nothing here computes a value of the generation, only how its program is compiled and where its buffers live.

Shape letters (see `esroll`): B rows, P padded prompt length; the cache is [L, B, K, S, H] (layers, rows, kv heads,
slots, head dim).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from esroll.models import STACKED, KVCache, Perturbation
from esroll.models.layers import table_slots

MODEL_AXIS = "model"  # the mesh axis parameters are split over (tensor parallelism), see `esroll.parallel`


def _arguments(
    cfg,
    params,
    prompt_BxP,
    key,
    *,
    max_new_tokens,
    temperature,
    top_p,
    top_k,
    eos_ids,
    prompt_mask,
    perturb,
    pad_id,
    cache_dtype,
    phases,
    row_offset,
    unroll,
    member_slots,
) -> tuple[tuple, dict]:
    """`_generate`'s arguments (traced ones positional, static ones by keyword) from `generate`'s."""
    B, P = prompt_BxP.shape
    mesh, axis = _row_split(prompt_BxP)
    model_mesh = _model_split(prompt_BxP)
    if model_mesh is not None:  # GSPMD: `axis` is where the rows are (if anywhere), for the cache's constraints
        mesh, axis = model_mesh, prompt_BxP.sharding.spec[0] if prompt_BxP.sharding.spec else None
    if prompt_mask is None:
        prompt_mask = (
            jax.ShapeDtypeStruct((B, P), bool, sharding=prompt_BxP.sharding)
            if isinstance(prompt_BxP, jax.ShapeDtypeStruct)
            else jnp.ones((B, P), bool)
        )
    args = (
        params,
        _traced(prompt_BxP, jnp.int32),
        _traced(prompt_mask, bool),
        key,
        perturb,
        _traced(row_offset, jnp.int32),
    )
    kwargs = {
        "cfg": cfg,
        "eos_ids": jnp.asarray(list(eos_ids) or [-1], jnp.int32),
        "pad_id": jnp.int32(pad_id),
        "max_new_tokens": int(max_new_tokens),
        "temperature": float(temperature),
        "top_p": float(top_p),
        "top_k": int(top_k),
        "cache_dtype": jnp.dtype(cache_dtype or params["embed"].dtype),
        "phases": int(phases),
        "unroll": int(unroll),
        "slots": _slots(perturb, member_slots, _shards(mesh, axis)),
        "mesh": mesh,
        "axis": axis,
        "tensor_parallel": model_mesh is not None,
    }
    return args, kwargs


def _slots(perturb, given: int | None, shards: int) -> int:
    """The member tables' size for `perturb` (see `esroll.sampling.generate`), its rows split over `shards` devices
    (`esroll.models.layers.table_slots`); 0 (per-row factors) without member-level deltas."""
    if perturb is None or perturb.member_B is None:
        return 0
    rows = perturb.member_B.shape[0]
    return table_slots(_host_values(perturb.member_B), rows, shards, given, "generate")


def _host_values(x) -> np.ndarray | None:
    """x as a NumPy array where this process holds all its values; None for a tracer, a ShapeDtypeStruct or an array
    spread over other processes."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_fully_addressable:
        return np.asarray(x)
    return None


def _shards(mesh, axis) -> int:
    """How many blocks `axis` (a mesh axis name, a tuple of them, or None) splits the rows into."""
    if axis is None:
        return 1
    return math.prod(mesh.shape[n] for n in (axis if isinstance(axis, tuple) else (axis,)))


def _traced(x, dtype):
    """x as an array of `dtype`; a ShapeDtypeStruct (ahead-of-time lowering) as it is, if of that dtype."""
    if isinstance(x, jax.ShapeDtypeStruct):
        if x.dtype != jnp.dtype(dtype):
            raise TypeError(f"expected a ShapeDtypeStruct of {jnp.dtype(dtype)}, got {x.dtype}")
        return x
    return jnp.asarray(x, dtype)


def _row_split(x) -> tuple[Mesh | None, str | tuple | None]:
    """The mesh and axis (or axes) that split `x`'s rows over more than one device; (None, None) otherwise."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or not sharding.spec or sharding.spec[0] is None:
        return None, None
    axis = sharding.spec[0]
    names = axis if isinstance(axis, tuple) else (axis,)
    if math.prod(sharding.mesh.shape[n] for n in names) == 1:
        return None, None
    return sharding.mesh, axis


def _model_split(x) -> Mesh | None:
    """The mesh of `x`'s NamedSharding when it has a "model" axis of more than one device; None otherwise."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh.shape.get(MODEL_AXIS, 1) == 1:
        return None
    return sharding.mesh


def _constrain(x, *spec, mesh):
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))


def _constrain_cache(cache: KVCache | Perturbation, *, cfg, mesh, rows) -> KVCache | Perturbation:
    """For GSPMD: the cache with its rows over `rows` (the prompt's row axis, or None) and its kv heads over the model
    axis (replicated when the model axis does not divide the kv heads, or already splits the rows); or member tables
    (`Perturbation.tables`) with their blocks over `rows`, each device holding its own rows' table (the rest of
    each factor's layout left to the compiler, which follows the deltas')."""
    if isinstance(cache, Perturbation):
        return cache._replace(deltas=constrain_tables(cache.deltas, mesh, rows))
    row_names = rows if isinstance(rows, tuple) else (rows,)
    split = cfg.num_kv_heads % mesh.shape[MODEL_AXIS] == 0 and MODEL_AXIS not in row_names
    heads = MODEL_AXIS if split else None
    at = functools.partial(_constrain, mesh=mesh)
    spec = (None, rows, heads, None, None)  # [L, B, K, S, H]
    return KVCache(at(cache.k, *spec), at(cache.v, *spec), valid_BxS=at(cache.valid_BxS, rows, None), index=cache.index)


def constrain_tables(deltas: dict, mesh, rows) -> dict:
    """Member tables' deltas (`Perturbation.tables`) [G, U, ...] (layer-stacked [L, G, U, ...]) with G over `rows`,
    the other axes unconstrained: where `generate` places them under GSPMD."""
    free = PartitionSpec.UNCONSTRAINED

    def at(path, x):
        lead = (None,) if path[0].key == STACKED else ()
        spec = lead + (rows,) + (free,) * (x.ndim - len(lead) - 1)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))

    return jax.tree_util.tree_map_with_path(at, deltas)
