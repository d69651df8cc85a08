"""Named model shapes for benchmarks, with random weights (no download): `--model NAME` picks one.

"mid" (the default) is a mid-size model a 2-core CPU can run (hidden 1024, 2 layers), "quick" (the default under
--quick) a small one for smoke runs, and the Qwen3 names are the real architectures' shapes, for accelerator runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from esroll.es import noise
from esroll.models import ModelConfig, param_shapes

# name -> (hidden, intermediate, layers, heads, kv heads, head_dim, vocab, tied embeddings)
SHAPES = {
    "quick": (256, 768, 2, 4, 2, 64, 1024, False),
    "small": (256, 768, 4, 4, 2, 64, 4096, False),  # generation benchmarks against transformers on a CPU
    "mid": (1024, 3072, 2, 16, 8, 64, 4096, False),
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, 128, 151936, True),
    "qwen3-1.7b": (2048, 6144, 28, 16, 8, 128, 151936, True),
    "qwen3-8b": (4096, 12288, 36, 32, 8, 128, 151936, False),
}


def shape_name(args) -> str:
    """--model if given, else "quick" under --quick and "mid" otherwise."""
    name = args.model or ("quick" if args.quick else "mid")
    if name not in SHAPES:
        raise ValueError(f"unknown --model {name!r}; known: {', '.join(SHAPES)}")
    return name


def hf_config_kwargs(name: str) -> dict:
    """The same shape as keyword arguments of a transformers Qwen3Config."""
    hidden, inter, layers, heads, kv, head_dim, vocab, tied = SHAPES[name]
    return dict(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        vocab_size=vocab,
        tie_word_embeddings=tied,
    )


def model_config(name: str) -> ModelConfig:
    hidden, inter, layers, heads, kv, head_dim, vocab, tied = SHAPES[name]
    return ModelConfig(
        family="qwen3",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        rope_theta=1e6,
        max_position_embeddings=40960,
        tie_word_embeddings=tied,
        qk_norm=True,
    )


def random_params(cfg: ModelConfig, dtype=jnp.float32, seed: int = 0) -> dict:
    """N(0, 0.02²) weights (Hugging Face's initializer_range) and unit norm scales, drawn on the default device."""
    shapes = noise.flatten(param_shapes(cfg))
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return noise.unflatten(
        {
            path: jnp.ones(shape, dtype)
            if path.endswith("norm")
            else (0.02 * jax.random.normal(k, shape)).astype(dtype)
            for k, (path, shape) in zip(keys, shapes.items())
        }
    )
