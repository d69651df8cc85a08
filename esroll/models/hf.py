"""Hugging Face safetensors checkpoints <-> esroll parameter dicts (layer-stacked, weights stored [in, out])."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from esroll.models.config import ModelConfig
from esroll.models.transformer import STACKED

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
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (D, cfg.vocab_size)
    return shapes


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
    if not cfg.tie_word_embeddings:
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


def load_hf(path: str | Path, dtype=None) -> tuple[ModelConfig, dict]:
    """Read config.json and safetensors weights (single file or sharded index) into (cfg, params).

    Every tensor is checked: a missing, unexpected or wrongly shaped tensor is an error naming it and its file.
    Weights keep the checkpoint's dtype unless `dtype` is given.
    """
    folder = resolve(path)
    cfg = ModelConfig.from_json_file(folder / "config.json")
    expected = _hf_names(cfg)
    # A tied checkpoint may still carry a copy of the embedding as lm_head.weight: accept and ignore it.
    redundant = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    flat: dict[str, np.ndarray] = {}
    for file in _weight_files(folder):
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():
                if name in redundant or name.endswith("rotary_emb.inv_freq"):
                    continue
                if name not in expected:
                    raise ValueError(f"{file}: unexpected tensor {name!r} for a {cfg.architecture} checkpoint")
                target, shape, transpose = expected[name]
                t = f.get_tensor(name)
                if tuple(t.shape) != tuple(shape):
                    raise ValueError(f"{file}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
                flat[target] = t.T if transpose else t
    missing = [n for n, (target, _, _) in expected.items() if target not in flat]
    if missing:
        raise ValueError(
            f"{folder}: missing tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )

    def cast(a: np.ndarray):
        return jnp.asarray(a if dtype is None else a.astype(jnp.dtype(dtype)))

    params = {
        "embed": cast(flat["embed"]),
        "final_norm": cast(flat["final_norm"]),
        STACKED: {
            leaf: cast(np.stack([flat[f"{STACKED}/{leaf}/{i}"] for i in range(cfg.num_layers)]))
            for leaf in param_shapes(cfg)[STACKED]
        },
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = cast(flat["lm_head"])
    return cfg, params


def save_hf(path: str | Path, cfg: ModelConfig, params: dict, tokenizer=None, dtype=None) -> Path:
    """Write config.json and model.safetensors that transformers' AutoModelForCausalLM loads with the same logits.

    Writes into a temporary name first and renames, so an interrupted save never leaves a half-written model.
    """
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
