"""ModelConfig: the typed, hashable description of a decoder, built from a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from esroll.models.attention import XLA, Attention

SUPPORTED = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}
# A value model (a critic): the same decoder with one scalar per token in place of the vocabulary head, as
# transformers' token-classification models with one label write it.
VALUE_MODELS = {
    "Qwen3ForTokenClassification": "qwen3",
    "Qwen2ForTokenClassification": "qwen2",
    "LlamaForTokenClassification": "llama",
}
HEADS = ("lm", "value")
_MODEL_TYPE = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything `forward` needs to know; frozen and hashable so it can be a static jit argument."""

    family: str  # "qwen3" | "qwen2" | "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Hashable RoPE scaling: ("default",) or ("linear", factor) or
    # ("llama3", factor, low_freq_factor, high_freq_factor, original_max_position_embeddings).
    rope_scaling: tuple = ("default",)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (always), Llama with attention_bias
    o_bias: bool = False  # Llama with attention_bias
    qk_norm: bool = False  # Qwen3 per-head RMSNorm on q and k
    # "lm": the vocabulary head (a policy); "value": one scalar per token (a critic, `esroll.critic`)
    head: str = "lm"
    # The kernel of the attention among new tokens (`esroll.models.attention`): not the model's, the platform's;
    # set by `dataclasses.replace(cfg, attention=attention.choose(...))` where the program's mesh is known.
    attention: Attention = XLA
    # The original config.json (as sorted JSON) so save_hf can write back every field it did not interpret.
    hf_json: str = dataclasses.field(default="{}", compare=False, repr=False)

    @property
    def architecture(self) -> str:
        return {v: k for k, v in (VALUE_MODELS if self.head == "value" else SUPPORTED).items()}[self.family]

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies [head_dim/2], with the configured scaling applied (float64 numpy, static)."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        kind = self.rope_scaling[0]
        if kind == "default":
            return inv
        if kind == "linear":
            return inv / self.rope_scaling[1]
        # llama3: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
        _, factor, low, high, old_ctx = self.rope_scaling
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = d.get("architectures") or []
        arch = archs[0] if archs else None
        head = "value" if arch in VALUE_MODELS else "lm"
        family = {**SUPPORTED, **VALUE_MODELS}.get(arch) if arch else _MODEL_TYPE.get(d.get("model_type", ""))
        if family is None:
            name = arch or d.get("model_type") or "<none>"
            supported = ", ".join([*SUPPORTED, *VALUE_MODELS])
            raise ValueError(f"{source}: unsupported architecture {name!r}; esroll supports {supported}")
        if head == "value" and len(d.get("id2label") or {0: ""}) != 1:
            raise ValueError(f"{source}: field 'id2label': a value model has one label, not {len(d['id2label'])}")

        def need(key: str) -> Any:
            if key not in d:
                raise ValueError(f"{source}: missing required field {key!r}")
            return d[key]

        if d.get("use_sliding_window"):
            raise ValueError(f"{source}: field 'use_sliding_window' = true is not supported")
        if d.get("mlp_bias"):
            raise ValueError(f"{source}: field 'mlp_bias' = true is not supported")
        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        head_dim = d.get("head_dim") or hidden // heads
        theta, scaling = _rope(d, source)
        attention_bias = bool(d.get("attention_bias", False))
        return cls(
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or (family == "llama" and attention_bias),
            o_bias=family == "llama" and attention_bias,
            qk_norm=family == "qwen3",
            head=head,
            hf_json=json.dumps(d, sort_keys=True),
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: config.json not found")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(d, source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dict that transformers loads as the same model (fields we do not model are kept)."""
        d = json.loads(self.hf_json)
        d.update(
            architectures=[self.architecture],
            model_type=self.family,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            hidden_act="silu",
        )
        if self.head == "value":
            d.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
        if self.family == "llama":
            d["attention_bias"] = self.o_bias
            d["mlp_bias"] = False
        rope = {"rope_type": self.rope_scaling[0], "rope_theta": self.rope_theta}
        if self.rope_scaling[0] == "linear":
            rope["factor"] = self.rope_scaling[1]
        elif self.rope_scaling[0] == "llama3":
            _, f, lo, hi, ctx = self.rope_scaling
            rope.update(factor=f, low_freq_factor=lo, high_freq_factor=hi, original_max_position_embeddings=ctx)
        # Write both spellings: transformers 5 reads rope_parameters, 4.x reads rope_theta / rope_scaling.
        d["rope_parameters"] = rope
        d["rope_theta"] = self.rope_theta
        d["rope_scaling"] = (
            None if self.rope_scaling[0] == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
        )
        return d


def _rope(d: dict[str, Any], source: str) -> tuple[float, tuple]:
    """Read RoPE from either spelling: rope_theta / rope_scaling (published checkpoints) or rope_parameters
    (transformers 5)."""
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    if params and "rope_type" not in params and "type" not in params and "rope_theta" not in params:
        # rope_parameters may be keyed per layer type in some models; we support only the flat form.
        raise ValueError(f"{source}: field 'rope_parameters' has an unsupported layout")
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", d.get("rope_theta", 10000.0)))
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind == "default":
        return theta, ("default",)
    if kind == "linear":
        return theta, ("linear", float(merged["factor"]))
    if kind == "llama3":
        try:
            return theta, (
                "llama3",
                float(merged["factor"]),
                float(merged["low_freq_factor"]),
                float(merged["high_freq_factor"]),
                int(merged["original_max_position_embeddings"]),
            )
        except KeyError as e:
            raise ValueError(f"{source}: llama3 rope scaling is missing field {e.args[0]!r}") from None
    raise ValueError(f"{source}: unsupported rope_type {kind!r} (supported: default, linear, llama3)")
