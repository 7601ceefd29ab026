"""The decoder's configuration, read from a checkpoint's own config.json or GGUF metadata.

One decoder covers the Llama family, Qwen2 and Qwen3. What differs between them is a handful of
flags (biases, q/k norms); every number (rope theta, norm eps, head_dim, tied embeddings) comes
from the checkpoint, never from a default that assumes one family.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model this decoder does not implement."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int  # L
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    # RoPE scaling; "default" means none. The other fields only matter for their rope_type.
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 1.0
    rope_original_max_position: int = 0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise UnsupportedModelError(
                f"model family {self.family!r} is not supported; supported: {', '.join(FAMILIES)}"
            )
        if self.rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_type {self.rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim={self.head_dim} must be even for RoPE")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Inverse of `to_dict` (the form tpuscore writes beside an Orbax checkpoint)."""
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """From a Hugging Face config.json (transformers 4.x and 5.x spellings)."""
        family = hf.get("model_type")
        if family not in FAMILIES:
            raise UnsupportedModelError(
                f"config.json model_type {family!r} is not supported; "
                f"supported: {', '.join(FAMILIES)}"
            )
        if hf.get("use_sliding_window"):
            raise UnsupportedModelError(
                "sliding-window attention (use_sliding_window) is not supported"
            )
        if hf.get("mlp_bias"):
            raise UnsupportedModelError("MLP biases (mlp_bias) are not supported")
        heads = hf["num_attention_heads"]
        # transformers 5 folds rope_theta and rope_scaling into rope_parameters.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.get("rope_theta", hf.get("rope_theta"))
        if theta is None:
            raise UnsupportedModelError("config.json gives no rope_theta")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf["rms_norm_eps"],
            rope_theta=float(theta),
            max_position_embeddings=hf["max_position_embeddings"],
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama and Qwen3 follow attention_bias.
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=family != "qwen2" and attention_bias,
            qk_norm=family == "qwen3",
            rope_type=rope_type,
            rope_factor=float(rope.get("factor", 1.0)),
            rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(rope.get("high_freq_factor", 1.0)),
            rope_original_max_position=int(rope.get("original_max_position_embeddings", 0)),
        )
