"""The decoder's configuration, read from a checkpoint's own config.json or GGUF metadata.

One decoder covers the Llama family, Qwen2, Qwen3 and Gemma 1, 2 and 3 (text). What differs
between them is a handful of flags and numbers (biases, q/k norms, Gemma's (1 + w) norms,
sandwich norms, soft-capping, sliding windows on local layers); every one of them comes from the
checkpoint, never from a default that assumes one family or a model name.

A checkpoint with a classification head (`*ForSequenceClassification`) has `num_labels > 0`:
it is scored by its class logits at the last token instead of by label tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3")
GEMMA_FAMILIES = ("gemma", "gemma2", "gemma3")
ROPE_TYPES = ("default", "linear", "llama3")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# config.json model_type -> family ("gemma3_text" is Gemma 3's text-only decoder).
MODEL_TYPES = {family: family for family in FAMILIES} | {"gemma3_text": "gemma3"}
# Gemma 3's RoPE bases where config.json gives none (transformers' own defaults).
_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


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
    # Gemma. RMSNorm scales by (norm_offset + w); embeddings are multiplied by embed_scale;
    # attention scores by query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5).
    hidden_act: str = "silu"
    norm_offset: float = 0.0
    embed_scale: float = 1.0
    query_pre_attn_scalar: float | None = None
    # Gemma 2 and 3: norms after attention and around the MLP ("sandwich" norms).
    sandwich_norms: bool = False
    # Gemma 2: tanh soft-capping of attention scores and of the LM head's logits (None: off).
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # Sliding-window attention: a local layer's token sees only the last sliding_window
    # positions (itself included). local_layers has one flag per layer; Gemma 3's local layers
    # rotate with their own RoPE base, rope_local_theta (None: rope_theta), without scaling.
    sliding_window: int | None = None
    local_layers: tuple[bool, ...] = ()
    rope_local_theta: float | None = None
    # Classification head (`score` [D, num_labels]): 0 for a causal LM. id2label names the
    # classes where the checkpoint does; pad_token_id decides the pooled token (transformers
    # pools the last token that is not padding).
    num_labels: int = 0
    id2label: tuple[str, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise UnsupportedModelError(
                f"model family {self.family!r} is not supported; supported: {', '.join(FAMILIES)}"
            )
        if self.rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_type {self.rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"hidden_act {self.hidden_act!r} is not supported; "
                f"supported: {', '.join(ACTIVATIONS)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.local_layers and len(self.local_layers) != self.num_layers:
            raise UnsupportedModelError(
                f"local_layers has {len(self.local_layers)} flags for {self.num_layers} layers"
            )
        if any(self.local_layers) and not (self.sliding_window and self.sliding_window > 0):
            raise UnsupportedModelError(
                f"local layers need a sliding_window >= 1, got {self.sliding_window!r}"
            )
        if self.num_labels < 0 or (self.id2label and len(self.id2label) != self.num_labels):
            raise UnsupportedModelError(
                f"num_labels={self.num_labels} does not match id2label {list(self.id2label)}"
            )

    @property
    def windowed(self) -> bool:
        """Whether any layer attends through a sliding window."""
        return any(self.local_layers)

    @property
    def classifier(self) -> bool:
        """Whether the model is scored by a classification head instead of label tokens."""
        return self.num_labels > 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Inverse of `to_dict` (the form tpuscore writes beside an Orbax checkpoint, as JSON)."""
        d = dict(d)
        for name in ("local_layers", "id2label"):
            d[name] = tuple(d.get(name, ()))
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], head_rows: int | None = None) -> ModelConfig:
        """From a Hugging Face config.json (transformers 4.x and 5.x spellings).

        head_rows: the classification head's row count, where the checkpoint has one; the class
        count comes from num_labels, else id2label, else this.
        """
        family = MODEL_TYPES.get(hf.get("model_type"))
        if family is None:
            raise UnsupportedModelError(
                f"config.json model_type {hf.get('model_type')!r} is not supported; "
                f"supported: {', '.join(MODEL_TYPES)}"
            )
        if hf.get("use_sliding_window"):
            raise UnsupportedModelError(
                "sliding-window attention (use_sliding_window) is not supported"
            )
        if hf.get("mlp_bias"):
            raise UnsupportedModelError("MLP biases (mlp_bias) are not supported")
        if hf.get("use_bidirectional_attention"):
            raise UnsupportedModelError("bidirectional attention is not supported")
        heads = hf["num_attention_heads"]
        layers = hf["num_hidden_layers"]
        rope, local_theta = _rope(family, hf)
        theta = rope.get("rope_theta", hf.get("rope_theta"))
        if theta is None:
            raise UnsupportedModelError("config.json gives no rope_theta")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        attention_bias = bool(hf.get("attention_bias", False))
        gemma = family in GEMMA_FAMILIES
        local = _local_layers(family, hf, layers)
        num_labels, id2label = _classes(hf, head_rows)
        scalar = hf.get("query_pre_attn_scalar")
        return cls(
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf["rms_norm_eps"],
            rope_theta=float(theta),
            max_position_embeddings=hf["max_position_embeddings"],
            # Gemma ties unless told otherwise (its config class defaults to True).
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
            # Qwen2 always has q/k/v biases; the others follow attention_bias.
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=family != "qwen2" and attention_bias,
            qk_norm=family in ("qwen3", "gemma3"),
            rope_type=rope_type,
            rope_factor=float(rope.get("factor", 1.0)),
            rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(rope.get("high_freq_factor", 1.0)),
            rope_original_max_position=int(rope.get("original_max_position_embeddings", 0)),
            hidden_act=_activation(hf),
            norm_offset=1.0 if gemma else 0.0,
            embed_scale=float(hf["hidden_size"]) ** 0.5 if gemma else 1.0,
            query_pre_attn_scalar=None if scalar is None else float(scalar),
            sandwich_norms=family in ("gemma2", "gemma3"),
            attn_logit_softcap=_optional_float(hf.get("attn_logit_softcapping")),
            final_logit_softcap=_optional_float(hf.get("final_logit_softcapping")),
            sliding_window=hf.get("sliding_window") if any(local) else None,
            local_layers=local if any(local) else (),
            rope_local_theta=local_theta,
            num_labels=num_labels,
            id2label=id2label,
            pad_token_id=hf.get("pad_token_id") if num_labels else None,
        )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _activation(hf: Mapping[str, Any]) -> str:
    # Gemma 2/3 name it hidden_activation; Gemma 1's legacy "gelu" means the tanh approximation
    # (transformers rewrites it so).
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    return "gelu_pytorch_tanh" if hf.get("model_type") == "gemma" and act == "gelu" else act


def _rope(family: str, hf: Mapping[str, Any]) -> tuple[dict[str, Any], float | None]:
    """The global layers' RoPE settings, and the local layers' RoPE base (Gemma 3).

    transformers 5 folds rope_theta and rope_scaling into rope_parameters, per layer type where
    the layer types differ (Gemma 3: {"full_attention": {...}, "sliding_attention": {...}});
    transformers 4.x writes rope_theta, rope_scaling and Gemma 3's rope_local_base_freq.
    """
    params = dict(hf.get("rope_parameters") or {})
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"RoPE scaling on local layers is not supported: {local}")
        if family == "gemma3":
            full.setdefault("rope_theta", _GEMMA3_THETA["full_attention"])
            local.setdefault("rope_theta", _GEMMA3_THETA["sliding_attention"])
        local_theta = local.get("rope_theta")
        return full, None if local_theta is None else float(local_theta)
    rope = params or dict(hf.get("rope_scaling") or {})
    local_theta = hf.get("rope_local_base_freq")
    if family == "gemma3":
        rope.setdefault("rope_theta", hf.get("rope_theta", _GEMMA3_THETA["full_attention"]))
        if local_theta is None:
            local_theta = _GEMMA3_THETA["sliding_attention"]
    return rope, None if local_theta is None else float(local_theta)


def _local_layers(family: str, hf: Mapping[str, Any], layers: int) -> tuple[bool, ...]:
    """Which layers attend through the sliding window, from layer_types (transformers 5) or
    sliding_window_pattern (hub checkpoints of transformers 4.x: every pattern-th layer is
    global). Gemma 2 without either alternates, local first, as transformers does."""
    types = hf.get("layer_types")
    if types is not None:
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise UnsupportedModelError(f"layer_types {unknown} are not supported")
        if len(types) != layers:
            raise UnsupportedModelError(f"layer_types has {len(types)} entries for {layers} layers")
        local = tuple(t == "sliding_attention" for t in types)
    elif family == "gemma2":
        local = tuple((i + 1) % 2 != 0 for i in range(layers))
    elif family == "gemma3":
        pattern = hf.get("sliding_window_pattern", 6)
        local = tuple((i + 1) % pattern != 0 for i in range(layers))
    else:
        local = (False,) * layers
    if any(local) and not hf.get("sliding_window"):
        raise UnsupportedModelError("config.json has sliding layers but no sliding_window")
    return local


def _classes(hf: Mapping[str, Any], head_rows: int | None) -> tuple[int, tuple[str, ...]]:
    """(num_labels, id2label) of a classification checkpoint; (0, ()) for a causal LM."""
    architectures = hf.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        return 0, ()
    id2label = hf.get("id2label") or {}
    count = hf.get("num_labels") or len(id2label) or head_rows
    if not count:
        raise UnsupportedModelError(
            "a sequence-classification config.json needs num_labels, id2label or a score head"
        )
    names = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count))
    return int(count), names
