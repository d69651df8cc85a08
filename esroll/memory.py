"""Device memory: what a device has, what a sharded tree takes on it, and how many rows a rollout may decode at once.

The row count is a first guess from the model's shapes (`decode_bytes_per_row`); `esroll.plan` compiles the real
programs with it and reads their memory from the compiler, which is the figure that decides whether a step fits
(and halves the guess until it does).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from esroll import parallel
from esroll.models import ModelConfig

GiB = 1024**3
# HBM per chip of TPU generations, by `device_kind`, for devices that cannot report it (deviceless AOT topologies).
TPU_MEMORY = {
    "TPU v4": 32 * GiB,
    "TPU v5 lite": 16 * GiB,  # v5e
    "TPU v5": 95 * GiB,  # v5p
    "TPU v5p": 95 * GiB,
    "TPU v6 lite": 32 * GiB,  # v6e (Trillium)
}


def device_memory_bytes(device) -> int | None:
    """The memory one device can allocate: its allocator's limit when it reports one (GPU, TPU), the chip's HBM
    for a TPU that cannot (an ahead-of-time topology), None for a CPU (no limit JAX knows of)."""
    try:
        stats = device.memory_stats()
    except Exception:  # deviceless topologies raise; CPUs return None
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return TPU_MEMORY.get(getattr(device, "device_kind", ""))


def tree_bytes_per_device(tree, shardings) -> int:
    """Bytes of the largest shard of each leaf of `tree` (arrays or ShapeDtypeStructs) under `shardings`, summed:
    what one device holds."""
    total = 0
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
        shape = s.shard_shape(tuple(x.shape)) if s is not None else tuple(x.shape)
        total += math.prod(shape) * _itemsize(x.dtype)
    return total


def _itemsize(dtype) -> int:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return 8  # a threefry key: two uint32
    return jnp.dtype(dtype).itemsize


def live_bytes_per_device(tree) -> int:
    """What one device holds of a tree of placed jax.Arrays."""
    return tree_bytes_per_device(tree, jax.tree.map(lambda x: x.sharding, tree))


def decode_bytes_per_row(cfg: ModelConfig, prompt_len: int, new_tokens: int, dtype, model_axis: int = 1) -> int:
    """An estimate of the memory one decoded row needs on one device: its KV cache (all layers, prompt + new
    tokens, in `dtype`), the float32 logits of a decode step and the sampler's work on them (about six [V] float32
    buffers: logits, softmax, sorted copy for top-p, Gumbel noise), and the prefill's largest activations (the MLP's
    hidden [P, F] and one layer's float32 attention scores [heads, P, P]). Heads, MLP columns and vocabulary are
    divided by the model axis when it divides them, as `esroll.sharding` splits them."""
    item = jnp.dtype(dtype).itemsize

    def split(n):
        return n // model_axis if n % model_axis == 0 else n

    kv = 2 * cfg.num_layers * split(cfg.num_kv_heads) * cfg.head_dim * (prompt_len + new_tokens) * item
    logits = 6 * split(cfg.vocab_size) * 4
    prefill = prompt_len * (3 * split(cfg.intermediate_size) * item + split(cfg.num_heads) * prompt_len * 4)
    return kv + logits + prefill + new_tokens * 8


def auto_rows_per_device(
    cfg: ModelConfig,
    prompt_len: int,
    new_tokens: int,
    dtype,
    *,
    free_bytes: int | None,
    rows: int,
    data_axis: int,
    model_axis: int = 1,
) -> int:
    """Rows per device for a rollout of `rows` rows: all of them (a ceil share per device) when memory is unknown
    or they fit, else the most `free_bytes` holds by `decode_bytes_per_row`, at least 1, rounded down to a multiple
    of 8 above 8 (friendlier shapes)."""
    share = -(-rows // data_axis)
    if free_bytes is None:
        return share
    fit = max(1, int(free_bytes // decode_bytes_per_row(cfg, prompt_len, new_tokens, dtype, model_axis)))
    if fit >= share:
        return share
    return fit - fit % 8 if fit > 8 else fit


def resident_bytes(params, state, compute) -> dict[str, int]:
    """Bytes per device of the buffers that live through a training step: the masters, the optimizer state and the
    decoding copy. Each tree's leaves (jax.Arrays or ShapeDtypeStructs) carry their shardings."""
    trees = {"masters": params, "optimizer state": state, "decoding copy": compute}
    return {name: tree_bytes_per_device(t, jax.tree.map(lambda x: x.sharding, t)) for name, t in trees.items()}


def rows_per_device(cfg, model_cfg: ModelConfig, prompt_len: int, mesh, resident: dict[str, int], rows: int) -> int:
    """The rows each device decodes at once in a rollout of `rows` rows: the config's `parallel.rows_per_device`, or
    when that is 0 `auto_rows_per_device`'s first guess for what fits beside the `resident` buffers in
    `parallel.memory_fraction` of a device's memory (all of its share where the memory is unknown: CPUs). What the
    trainer, its evaluation and `esroll.plan` all start from."""
    if cfg.parallel.rows_per_device:
        return cfg.parallel.rows_per_device
    limit = device_memory_bytes(mesh.devices.flat[0])
    return auto_rows_per_device(
        model_cfg,
        prompt_len,
        cfg.train.max_new_tokens,
        cfg.model.dtype,
        free_bytes=None if limit is None else limit * cfg.parallel.memory_fraction - sum(resident.values()),
        rows=rows,
        data_axis=parallel.data_size(mesh),
        model_axis=parallel.model_size(mesh),
    )
