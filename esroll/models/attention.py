"""Attention of a block of tokens among themselves (training, scoring, a prefill into a fresh cache): one contract,
its kernel picked from the platform of the devices the program runs on.

`self_attention(att, q, k, v, mask)` is grouped-query causal attention: query head j reads kv head j // (Q / K), a
token sees the real tokens (mask True) at or before its own index, scores q·k/√H and their softmax in float32. The
outputs at real tokens are the contract; a padding token's output is finite and unspecified (every caller masks
it out), which is what lets each kernel treat padding its own way:

    "xla"     `jax.nn.dot_product_attention`'s XLA implementation on the [B, 1, T, T] visibility mask (the float32
              scores and probabilities are written to memory); every platform, and the reference;
    "splash"  the TPU's Pallas splash-attention kernel (scores never leave the chip's vector memory): causal,
              padding as segment ids (real tokens 1, padding 0), the sequence padded to a multiple of 128
              (`forward` does it once, before its layers: `token_padding`), the queries scaled before the kernel,
              one fused backward kernel for dq, dk and dv (not a dq kernel beside a dkv one); under `shard_map`
              over the mesh (rows over "data", heads over "model": a Mosaic kernel cannot be partitioned by
              GSPMD), one call per row;
    "cudnn"   cuDNN's fused attention (`jax.nn.dot_product_attention(implementation="cudnn")`): causal, the
              visibility mask as its [B, 1, T, T] bias; bfloat16 or float16 with a head width of at most 128 (a
              multiple of 8), else "xla". Not yet run on a GPU.

`choose(setting, mesh)` turns the experiment's `model.attention` ("auto" or "xla") into an `Attention` from the
mesh's devices, not from `jax.default_backend()` (which is the CPU when a TPU program is compiled without a TPU):
"auto" is splash on a TPU, cuDNN on an NVIDIA GPU, XLA elsewhere. Decoding over a cache keeps
`esroll.models.transformer.attend` on every platform (a step's few queries have no scores to fuse).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

DATA, MODEL = "data", "model"  # esroll.parallel's mesh axes
SETTINGS = ("auto", "xla")  # model.attention (`esroll.config`'s ATTENTION: the model imports no config)
KERNELS = ("xla", "splash", "cudnn")
_LANES = 128  # the splash kernel's blocks are multiples of this


@dataclasses.dataclass(frozen=True)
class Attention:
    """Which kernel `self_attention` runs (static: part of `ModelConfig`, so of every compiled program's key).
    `mesh`: where "splash" runs under `shard_map` (None: as it is, on one device or inside a per-device program);
    `interpret`: Pallas interpret mode (the TPU kernel's arithmetic on any platform, for tests)."""

    kernel: str = "xla"
    mesh: Mesh | None = dataclasses.field(default=None, repr=False)
    interpret: bool = False

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"attention kernel {self.kernel!r}; known: {', '.join(KERNELS)}")

    def local(self) -> Attention:
        """The same kernel inside a per-device program (no `shard_map` of its own)."""
        return dataclasses.replace(self, mesh=None)


XLA = Attention()


def platform(mesh: Mesh) -> str:
    """The platform of `mesh`'s devices, deviceless TPU topologies included: "tpu", "cuda", "rocm" or "cpu"."""
    device = mesh.devices.flat[0]
    name = device.platform.lower()
    if name == "gpu":
        version = str(getattr(getattr(device, "client", None), "platform_version", "")).lower()
        return "rocm" if "rocm" in version else "cuda"
    return name


def choose(setting: str, mesh: Mesh | None) -> Attention:
    """The `Attention` for `model.attention` = `setting` on `mesh` (None: XLA's)."""
    if setting not in SETTINGS:
        raise ValueError(f"config: 'model.attention' = {setting!r}: one of {', '.join(SETTINGS)}")
    if setting == "xla" or mesh is None:
        return XLA
    kind = platform(mesh)
    if kind == "tpu":
        return Attention("splash", mesh if mesh.devices.size > 1 else None)
    if kind == "cuda":
        return Attention("cudnn")
    return XLA


def self_attention(att: Attention, q_BxTxQxH, k_BxTxKxH, v_BxTxKxH, mask_BxT) -> jax.Array:
    """Causal grouped-query attention [B, T, Q, H] of T tokens among themselves (see the module docstring)."""
    H = q_BxTxQxH.shape[-1]
    scale = 1.0 / np.sqrt(H)
    if att.kernel == "splash":
        return _splash(att, q_BxTxQxH, k_BxTxKxH, v_BxTxKxH, mask_BxT)
    T = q_BxTxQxH.shape[1]
    visible_BxTxT = mask_BxT[:, None, :] & jnp.tril(jnp.ones((T, T), bool))[None]
    if att.kernel == "cudnn" and _cudnn_fits(q_BxTxQxH):
        # cuDNN takes a mask as a [B, 1, T, T] bias (its sequence dims must be the queries' and keys'); causal lets it
        # skip the blocks above the diagonal.
        return jax.nn.dot_product_attention(
            q_BxTxQxH, k_BxTxKxH, v_BxTxKxH, mask=visible_BxTxT[:, None], is_causal=True, scale=scale,
            implementation="cudnn",
        )  # fmt: skip
    return jax.nn.dot_product_attention(q_BxTxQxH, k_BxTxKxH, v_BxTxKxH, mask=visible_BxTxT[:, None], scale=scale)


def _cudnn_fits(q) -> bool:
    H = q.shape[-1]
    return q.dtype in (jnp.bfloat16, jnp.float16) and H <= 128 and H % 8 == 0


def token_padding(att: Attention, T: int) -> int:
    """How many padding tokens `esroll.models.forward` appends to T new tokens before its layers, so that the kernel
    pads nothing in each layer: up to a multiple of 128 for splash, none for the others."""
    return -T % _LANES if att.kernel == "splash" else 0


def splash_block(T: int) -> int:
    """The splash kernel's query and key block for T tokens: the largest of 512, 256, 128 that divides T rounded up
    to a multiple of 128 (the padded length)."""
    padded = -(-T // _LANES) * _LANES
    return next(b for b in (512, 256, _LANES) if padded % b == 0)


def _splash(att: Attention, q_BxTxQxH, k_BxTxKxH, v_BxTxKxH, mask_BxT):
    B, T, Q, H = q_BxTxQxH.shape
    K = k_BxTxKxH.shape[2]
    mesh = att.mesh
    rows = heads = None
    if mesh is not None:
        data, model = mesh.shape.get(DATA, 1), mesh.shape.get(MODEL, 1)
        rows = DATA if data > 1 and B % data == 0 else None
        heads = MODEL if model > 1 and Q % model == 0 and K % model == 0 else None
    run = functools.partial(_splash_local, T=T, interpret=att.interpret)
    q_BxTxQxH = q_BxTxQxH * jnp.asarray(1.0 / np.sqrt(H), q_BxTxQxH.dtype)
    segments_BxT = mask_BxT.astype(jnp.int32)
    if rows is None and heads is None:
        return run(q_BxTxQxH, k_BxTxKxH, v_BxTxKxH, segments_BxT)
    spec = PartitionSpec(rows, None, heads, None)
    return jax.shard_map(
        run, mesh=mesh, in_specs=(spec, spec, spec, PartitionSpec(rows, None)), out_specs=spec, check_vma=False
    )(q_BxTxQxH, k_BxTxKxH, v_BxTxKxH, segments_BxT)


def _splash_local(q_BxTxQxH, k_BxTxKxH, v_BxTxKxH, segments_BxT, *, T: int, interpret: bool):
    """Splash attention of the rows and heads at hand (scaled queries), one kernel call per row."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    Q = q_BxTxQxH.shape[2]
    block = splash_block(T)
    padded = -(-T // block) * block
    sizes = splash.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block, block_kv_dkv=block,
        block_kv_dkv_compute=block, use_fused_bwd_kernel=True,
    )  # fmt: skip
    kernel = splash.make_splash_mha(
        masks.MultiHeadMask([masks.CausalMask((padded, padded))] * Q),
        block_sizes=sizes,
        head_shards=1,
        q_seq_shards=1,
        interpret=interpret,
    )

    def heads_first(x_BxTxNxH):  # [B, padded, N, H] -> [B, N, padded, H], the kernel's layout
        return jnp.pad(x_BxTxNxH, ((0, 0), (0, padded - T), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

    segments_BxP = jnp.pad(segments_BxT, ((0, 0), (0, padded - T)))
    rows = jax.vmap(lambda q, k, v, s: kernel(q, k, v, splash.SegmentIds(s, s)))
    if q_BxTxQxH.dtype in (jnp.bfloat16, jnp.float16) and jax.config.jax_default_matmul_precision not in _DEFAULT:
        rows = _default_precision(rows)
    out_BxQxPxH = rows(heads_first(q_BxTxQxH), heads_first(k_BxTxKxH), heads_first(v_BxTxKxH), segments_BxP)
    return out_BxQxPxH.transpose(0, 2, 1, 3)[:, :T]


_DEFAULT = (None, "default", "bfloat16", "fastest")


def _default_precision(kernel):
    """`kernel(q, k, v, segments)` with its forward and backward products traced at the platform's default matmul
    precision: Mosaic has no float32 contract precision for low-precision operands (whose products are exact in
    float32 anyway), so a process-wide higher setting (as a test suite's "highest") is not passed on to them."""

    @jax.custom_vjp
    def run(q, k, v, segments):
        with jax.default_matmul_precision("default"):
            return kernel(q, k, v, segments)

    def forward(q, k, v, segments):
        with jax.default_matmul_precision("default"):
            out, pullback = jax.vjp(lambda q, k, v: kernel(q, k, v, segments), q, k, v)
        return out, pullback

    def backward(pullback, g):
        with jax.default_matmul_precision("default"):
            return (*pullback(g), None)

    run.defvjp(forward, backward)
    return run
