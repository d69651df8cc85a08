"""Published model configs as built-in data: the Hugging Face `config.json` of each supported model, so that its
shapes, parameter count and `ModelConfig` are known without a download.

    preset_config("qwen3-0.6b")            # the config.json dict (a fresh copy)
    model_config("qwen3-8b", layers=2)     # a ModelConfig at the real widths, 2 layers deep
    num_params("qwen3-0.6b")               # 596_049_920 (the tied embedding counted once)

Pure data and small functions (no weights, no jax arrays): safe to use where no accelerator exists.
"""

from __future__ import annotations

import copy
from typing import Any

from esroll.models.config import ModelConfig
from esroll.models.hf import count_params

_QWEN3_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 40960,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, tie: bool) -> dict[str, Any]:
    return {
        **_QWEN3_COMMON,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "max_window_layers": layers,
        "num_attention_heads": heads,
        "tie_word_embeddings": tie,
    }


# The values of each model's published config.json (Qwen/Qwen3-*, Qwen/Qwen2.5-0.5B-Instruct on the Hub).
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": _qwen3(hidden=1024, intermediate=3072, layers=28, heads=16, tie=True),
    "qwen3-1.7b": _qwen3(hidden=2048, intermediate=6144, layers=28, heads=16, tie=True),
    "qwen3-4b": _qwen3(hidden=2560, intermediate=9728, layers=36, heads=32, tie=True),
    "qwen3-8b": _qwen3(hidden=4096, intermediate=12288, layers=36, heads=32, tie=False),
    # Qwen2 has no `attention_bias` field: its q/k/v projections always carry a bias (ModelConfig.qkv_bias).
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,  # Qwen2.5-0.5B-Instruct's <|im_end|>; the base model's config says 151643
        "hidden_act": "silu",
        "hidden_size": 896,
        "initializer_range": 0.02,
        "intermediate_size": 4864,
        "max_position_embeddings": 32768,
        "max_window_layers": 21,
        "num_attention_heads": 14,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
}


def preset_config(name: str, layers: int | None = None) -> dict[str, Any]:
    """A fresh copy of preset `name`'s config.json dict, optionally truncated to its first `layers` layers."""
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}")
    d = copy.deepcopy(PRESETS[key])
    if layers is not None:
        full = d["num_hidden_layers"]
        if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= full:
            raise ValueError(f"preset {key!r}: layers must be an integer in [1, {full}], got {layers!r}")
        d["num_hidden_layers"] = layers
        d["max_window_layers"] = min(d.get("max_window_layers", layers), layers)
    return d


def model_config(name: str, layers: int | None = None) -> ModelConfig:
    """The ModelConfig of preset `name` (optionally `layers` deep), parsed exactly as a config.json would be."""
    return ModelConfig.from_hf_dict(preset_config(name, layers), source=f"preset {name!r}")


def num_params(name: str, layers: int | None = None) -> int:
    """Exact parameter count of preset `name` from its tensor shapes; a tied embedding / LM head is counted once."""
    return count_params(model_config(name, layers))
