"""Pure-functional Qwen3 / Qwen2.5 / Llama decoders and their Hugging Face checkpoint loaders."""

from esroll.models.config import ModelConfig
from esroll.models.hf import abstract_params, count_params, load_hf, param_shapes, save_hf
from esroll.models.layers import LowRank, Perturbation, linear, member_slots, most_members
from esroll.models.presets import PRESETS, model_config, num_params, preset_config
from esroll.models.transformer import STACKED, KVCache, forward, init_cache

__all__ = [
    "STACKED",
    "abstract_params",
    "KVCache",
    "LowRank",
    "ModelConfig",
    "PRESETS",
    "Perturbation",
    "forward",
    "init_cache",
    "linear",
    "load_hf",
    "member_slots",
    "most_members",
    "model_config",
    "num_params",
    "count_params",
    "param_shapes",
    "preset_config",
    "save_hf",
]
