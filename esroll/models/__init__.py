"""Pure-functional Qwen3 / Qwen2.5 / Llama decoders and their Hugging Face checkpoint loaders."""

from esroll.models.config import ModelConfig
from esroll.models.hf import load_hf, param_shapes, save_hf
from esroll.models.layers import LowRank, Perturbation, linear
from esroll.models.transformer import KVCache, forward, init_cache, unstack_layers

__all__ = [
    "KVCache", "LowRank", "ModelConfig", "Perturbation", "forward", "init_cache", "linear", "load_hf",
    "param_shapes", "save_hf", "unstack_layers",
]
