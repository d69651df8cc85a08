"""Hugging Face safetensors checkpoints <-> esroll parameter dicts (layer-stacked, weights stored [in, out])."""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from etils import epath
from safetensors import safe_open
from safetensors.numpy import save_file

from esroll.models.config import ModelConfig
from esroll.models.transformer import STACKED

# the leaves outside the layer stack: the embedding and final norm, then a policy's or a critic's head
HEADS_AND_EMBEDDINGS = ("embed", "final_norm", "lm_head", "value_head", "value_bias")

# esroll layer leaf -> (Hugging Face name inside model.layers.{i}., is a Linear weight to transpose)
_LAYER_KEYS = {
    "attn_norm": ("input_layernorm.weight", False),
    "q": ("self_attn.q_proj.weight", True),
    "k": ("self_attn.k_proj.weight", True),
    "v": ("self_attn.v_proj.weight", True),
    "o": ("self_attn.o_proj.weight", True),
    "q_bias": ("self_attn.q_proj.bias", False),
    "k_bias": ("self_attn.k_proj.bias", False),
    "v_bias": ("self_attn.v_proj.bias", False),
    "o_bias": ("self_attn.o_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "gate": ("mlp.gate_proj.weight", True),
    "up": ("mlp.up_proj.weight", True),
    "down": ("mlp.down_proj.weight", True),
}


def param_shapes(cfg: ModelConfig) -> dict:
    """The expected shape of every esroll leaf (what load_hf checks against and init_params draws)."""
    D, F, L, H = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.head_dim
    q, kv = cfg.num_heads * H, cfg.num_kv_heads * H
    layers = {
        "attn_norm": (L, D),
        "q": (L, D, q),
        "k": (L, D, kv),
        "v": (L, D, kv),
        "o": (L, q, D),
        "mlp_norm": (L, D),
        "gate": (L, D, F),
        "up": (L, D, F),
        "down": (L, F, D),
    }
    if cfg.qkv_bias:
        layers.update(q_bias=(L, q), k_bias=(L, kv), v_bias=(L, kv))
    if cfg.o_bias:
        layers["o_bias"] = (L, D)
    if cfg.qk_norm:
        layers.update(q_norm=(L, H), k_norm=(L, H))
    shapes = {"embed": (cfg.vocab_size, D), STACKED: layers, "final_norm": (D,)}
    if cfg.head == "value":  # a critic: one scalar per token, w·h + b (`esroll.critic`)
        shapes.update(value_head=(D, 1), value_bias=(1,))
    elif not cfg.tie_word_embeddings:
        shapes["lm_head"] = (D, cfg.vocab_size)
    return shapes


def abstract_params(cfg: ModelConfig, dtype=jnp.float32) -> dict:
    """`param_shapes` as ShapeDtypeStructs of `dtype` (what sharding rules, memory plans and ahead-of-time lowering
    read without any weight)."""
    return jax.tree.map(
        lambda shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)),
        param_shapes(cfg),
        is_leaf=lambda x: isinstance(x, tuple),
    )


def count_params(cfg: ModelConfig) -> int:
    """Parameters of a model with `cfg` (a tied embedding / LM head counted once), from `param_shapes`."""
    return sum(math.prod(shape) for shape in jax.tree.leaves(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)))


def _hf_names(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    """Every Hugging Face tensor name -> (esroll path f'{STACKED}/q/3' or 'embed', HF shape, transpose?)."""
    shapes = param_shapes(cfg)
    names = {
        "model.embed_tokens.weight": ("embed", shapes["embed"], False),
        "model.norm.weight": ("final_norm", shapes["final_norm"], False),
    }
    if cfg.head == "value":  # transformers' token-classification head with one label
        names["score.weight"] = ("value_head", shapes["value_head"][::-1], True)
        names["score.bias"] = ("value_bias", shapes["value_bias"], False)
    elif not cfg.tie_word_embeddings:
        names["lm_head.weight"] = ("lm_head", shapes["lm_head"][::-1], True)
    for leaf, shape in shapes[STACKED].items():
        hf, transpose = _LAYER_KEYS[leaf]
        per_layer = shape[1:][::-1] if transpose else shape[1:]
        for i in range(cfg.num_layers):
            names[f"model.layers.{i}.{hf}"] = (f"{STACKED}/{leaf}/{i}", per_layer, transpose)
    return names


def resolve(path: str | Path) -> Path:
    """A local model folder, or a Hub id such as Qwen/Qwen3-0.6B fetched with huggingface_hub (network needed)."""
    p = Path(path)
    if p.exists():
        return p
    if "/" in str(path) and not str(path).startswith((".", "/")) and len(p.parts) == 2:
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
        except Exception as e:  # offline, unknown id, no hub access
            raise FileNotFoundError(
                f"{path}: not a local folder and could not be fetched from the Hub ({type(e).__name__})"
            ) from None
    raise FileNotFoundError(f"{path}: model folder not found")


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: malformed safetensors index ({e})") from None
        files = [folder / f for f in sorted(set(weight_map.values()))]
    else:
        files = [folder / "model.safetensors"]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f}: weight file not found")
    return files


# safetensors header dtype -> numpy dtype (the numpy framework returns bfloat16 and float8 as ml_dtypes types)
_ST_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class _Tensor(NamedTuple):
    """Where one Hugging Face tensor of the checkpoint lives, read from the safetensors headers only."""

    file: Path
    name: str
    transpose: bool  # a Linear weight: HF stores [out, in], esroll [in, out]
    dtype: np.dtype


def _index_checkpoint(folder: Path, cfg: ModelConfig, handles: dict[Path, Any]) -> dict[str, _Tensor]:
    """esroll path ('embed', f'{STACKED}/q/3', ...) -> where its tensor is, from the headers of the weight files
    (`handles`: file -> open safe_open handle) only: a missing, unexpected or wrongly shaped tensor is an error naming
    it and its file, raised before any tensor data is read."""
    expected = _hf_names(cfg)
    # A tied checkpoint may still carry a copy of the embedding as lm_head.weight: accept and ignore it.
    redundant = {"lm_head.weight"} if cfg.tie_word_embeddings and cfg.head == "lm" else set()
    found: dict[str, _Tensor] = {}
    for file, f in handles.items():
        for name in f.keys():
            if name in redundant or name.endswith("rotary_emb.inv_freq"):
                continue
            if name not in expected:
                raise ValueError(f"{file}: unexpected tensor {name!r} for a {cfg.architecture} checkpoint")
            target, shape, transpose = expected[name]
            header = f.get_slice(name)
            got = tuple(header.get_shape())
            if got != tuple(shape):
                raise ValueError(f"{file}: tensor {name!r} has shape {got}, expected {tuple(shape)}")
            kind = header.get_dtype()
            if kind not in _ST_DTYPES:
                raise ValueError(f"{file}: tensor {name!r} has unsupported dtype {kind}")
            found[target] = _Tensor(file, name, transpose, np.dtype(_ST_DTYPES[kind]))
    missing = [n for n, (target, _, _) in expected.items() if target not in found]
    if missing:
        raise ValueError(
            f"{folder}: missing tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    return found


def _leaf_sources(cfg: ModelConfig, found: dict[str, _Tensor]) -> dict:
    """The params tree (as `param_shapes`) with, at each leaf, its tensors: one, or one per layer for stacked ones."""
    shapes = param_shapes(cfg)
    tree = {k: [found[k]] for k in shapes if k != STACKED}
    tree[STACKED] = {leaf: [found[f"{STACKED}/{leaf}/{i}"] for i in range(cfg.num_layers)] for leaf in shapes[STACKED]}
    return tree


def _read(handles: dict[Path, Any], t: _Tensor, index: tuple[slice, ...], dtype) -> np.ndarray:
    """The esroll-layout slice `index` of one tensor in `dtype`, reading only that slice from the file (a Linear
    weight's [in, out] index is read as the transposed [out, in] slice of HF's layout)."""
    hf_index = index[::-1] if t.transpose else index
    a = handles[t.file].get_slice(t.name)[hf_index]
    a = a.T if t.transpose else a
    return a.astype(dtype, copy=False)


def _shard_reader(handles: dict[Path, Any], tensors: list[_Tensor], shape: tuple[int, ...], stacked: bool, dtype):
    """The make_array_from_callback callback of one leaf: for the index it is asked, the slice of the leaf, read
    from the file(s) slice by slice (per layer for stacked leaves). A slice asked for by several devices (a leaf
    replicated over some mesh axes) is read once."""
    cache: dict[tuple, np.ndarray] = {}

    def callback(index) -> np.ndarray:
        bounds = []
        for s, n in zip(index, shape, strict=True):
            start, stop, step = s.indices(n)
            if step != 1:
                raise ValueError(f"strided shard index {index} is not supported")
            bounds.append((start, stop))
        key = tuple(bounds)
        if key not in cache:
            slices = tuple(slice(a, b) for a, b in bounds)
            if any(a >= b for a, b in bounds):
                out = np.zeros([b - a for a, b in bounds], dtype)
            elif stacked:
                (first, last), rest = bounds[0], slices[1:]
                out = np.stack([_read(handles, tensors[i], rest, dtype) for i in range(first, last)])
            else:
                out = _read(handles, tensors[0], slices, dtype)
            cache[key] = np.ascontiguousarray(out)
        return cache[key]

    return callback


def _sharding_tree(shardings, shapes: dict) -> dict:
    """`shardings` (one Sharding for every leaf, or a tree as `shapes`) checked against `shapes`, as a tree."""
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda _: shardings, shapes, is_leaf=lambda x: isinstance(x, tuple))
    if not isinstance(shardings, dict) or not isinstance(shardings.get(STACKED), dict):
        raise TypeError(
            f"shardings must be a Sharding or a dict shaped like the params, got {type(shardings).__name__}"
        )
    for want, got, where in ((shapes, shardings, ""), (shapes[STACKED], shardings[STACKED], f"{STACKED}/")):
        if set(got) != set(want):
            extra, lacking = sorted(set(got) - set(want)), sorted(set(want) - set(got))
            raise ValueError(
                "shardings do not match the params: "
                + "; ".join(
                    [f"no sharding for {where}{k}" for k in lacking] + [f"{where}{k} is not a parameter" for k in extra]
                )
            )
    for path, s in jax.tree_util.tree_leaves_with_path(shardings, is_leaf=lambda x: x is None):
        if not isinstance(s, jax.sharding.Sharding):
            raise TypeError(f"shardings{jax.tree_util.keystr(path)} is {s!r}, not a jax.sharding.Sharding")
    return shardings


def load_hf(path: str | Path, dtype=None, *, shardings=None) -> tuple[ModelConfig, dict]:
    """Read config.json and safetensors weights (single file or sharded index) into (cfg, params).

    Every tensor is checked from the safetensors headers before any data is read: a missing, unexpected or wrongly
    shaped tensor is an error naming it and its file. Weights keep the checkpoint's dtype unless `dtype` is given
    (bfloat16 checkpoints included).

    Without `shardings`, every leaf is one array on the default device. With `shardings` (a tree of
    `jax.sharding.Sharding`s shaped as `param_shapes(cfg)`, one Sharding for every leaf, or a callable
    `cfg -> either`), each leaf is built with `jax.make_array_from_callback`: each shard is read from the file as
    just that slice (layer by layer for stacked leaves), so a process reads and holds only its devices' shards of a
    sharded leaf (a replicated leaf is read whole, once).
    """
    folder = resolve(path)
    cfg = ModelConfig.from_json_file(folder / "config.json")
    shapes = param_shapes(cfg)
    if shardings is not None:
        shardings = _sharding_tree(shardings(cfg) if callable(shardings) else shardings, shapes)

    def build(shape: tuple[int, ...], tensors: list[_Tensor], stacked: bool, sharding):
        dt = jax.dtypes.canonicalize_dtype(np.result_type(*(t.dtype for t in tensors)) if dtype is None else dtype)
        read = _shard_reader(handles, tensors, shape, stacked, dt)
        if sharding is None:
            return jnp.asarray(read(tuple(slice(None) for _ in shape)))
        return jax.make_array_from_callback(shape, sharding, read, dtype=dt)

    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(str(f), framework="numpy")) for f in _weight_files(folder)}
        sources = _leaf_sources(cfg, _index_checkpoint(folder, cfg, handles))
        params = {
            k: build(shapes[k], sources[k], False, None if shardings is None else shardings[k])
            for k in HEADS_AND_EMBEDDINGS
            if k in shapes
        }
        params[STACKED] = {
            leaf: build(shape, sources[STACKED][leaf], True, None if shardings is None else shardings[STACKED][leaf])
            for leaf, shape in shapes[STACKED].items()
        }
    return cfg, {k: params[k] for k in ("embed", "final_norm", STACKED, *HEADS_AND_EMBEDDINGS[2:]) if k in params}


def save_hf(path: str | os.PathLike, cfg: ModelConfig, params: dict, tokenizer=None, dtype=None) -> Path | epath.Path:
    """Write config.json and model.safetensors that transformers' AutoModelForCausalLM loads with the same logits (a
    critic: AutoModelForTokenClassification, with the same values).

    Writes into a temporary name first and renames, so an interrupted save never leaves a half-written model. `path`
    may be a URL (gs://bucket/run/final): the model is written to a local temporary folder, then uploaded file by
    file through `etils.epath`, config.json last.
    """
    if "://" in os.fspath(path):
        remote = epath.Path(os.fspath(path))
        with tempfile.TemporaryDirectory() as tmp:
            save_hf(tmp, cfg, params, tokenizer=tokenizer, dtype=dtype)
            files = sorted(
                (os.path.relpath(os.path.join(d, f), tmp) for d, _, names in os.walk(tmp) for f in names),
                key=lambda rel: (rel == "config.json", rel),
            )
            for rel in files:
                (remote / rel).parent.mkdir(parents=True, exist_ok=True)
                (remote / rel).write_bytes(Path(tmp, rel).read_bytes())
        return remote
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, (target, _, transpose) in _hf_names(cfg).items():
        parts = target.split("/")
        leaf = params[STACKED][parts[1]][int(parts[2])] if parts[0] == STACKED else params[parts[0]]
        a = np.asarray(leaf if dtype is None else leaf.astype(dtype))
        tensors[name] = np.ascontiguousarray(a.T if transpose else a)
    hf = cfg.to_hf_dict()
    hf["torch_dtype"] = hf["dtype"] = _dtype_name(next(iter(tensors.values())).dtype)
    tmp = folder / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / "model.safetensors")
    (folder / "config.json.tmp").write_text(json.dumps(hf, indent=2, sort_keys=True))
    (folder / "config.json.tmp").replace(folder / "config.json")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    return folder


def _dtype_name(dt) -> str:
    if dt == ml_dtypes.bfloat16:
        return "bfloat16"
    return np.dtype(dt).name
