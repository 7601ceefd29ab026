"""The parameter tree and the map from Hugging Face checkpoint names onto it.

Every layer's weights are stacked on a leading L axis so the decoder scans over layers (one
compiled layer, not L copies). Axis letters: L layers, V vocab, D model, F MLP, N query heads,
K kv heads, H head dim.

    embed [V, D]   final_norm [D]   lm_head [D, V] (untied causal LMs only)
    score [D, C] (classification heads only, C = num_labels)
    layers/attn_norm [L, D]   wq [L, D, N, H]   wk, wv [L, D, K, H]   wo [L, N, H, D]
           bq [L, N, H], bk, bv [L, K, H] (qkv_bias)   bo [L, D] (o_bias)
           q_norm, k_norm [L, H] (qk_norm)
           mlp_norm [L, D]   w_gate, w_up [L, D, F]   w_down [L, F, D]
           post_attn_norm, post_mlp_norm [L, D] (sandwich_norms)

Norm weights are stored as the checkpoint has them: Gemma's (1 + w) is the decoder's business
(`config.norm_offset`), so it is added in float32 whatever the parameter dtype, as transformers
does. Gemma 2 and 3 reuse the name post_attention_layernorm for the norm *after* attention; their
MLP's input norm is pre_feedforward_layernorm.

GGUF checkpoints are renamed to Hugging Face names first (`models/gguf.py`), so this table is
the only place that knows where a checkpoint tensor lands.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from tpuscore.models.config import ModelConfig

Params = dict  # {"embed": array, "layers": {name: array}, ...}

# Checkpoint tensors that carry no weights (recomputed from the config).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match the parameters its config implies."""


def param_shapes(config: ModelConfig) -> Params:
    """The shape of every parameter, as the same nested dict the loaders build."""
    L, V, D, F = config.num_layers, config.vocab_size, config.hidden_size, config.intermediate_size
    N, K, H = config.num_heads, config.num_kv_heads, config.head_dim
    layers = {
        "attn_norm": (L, D),
        "wq": (L, D, N, H),
        "wk": (L, D, K, H),
        "wv": (L, D, K, H),
        "wo": (L, N, H, D),
        "mlp_norm": (L, D),
        "w_gate": (L, D, F),
        "w_up": (L, D, F),
        "w_down": (L, F, D),
    }
    if config.qkv_bias:
        layers |= {"bq": (L, N, H), "bk": (L, K, H), "bv": (L, K, H)}
    if config.o_bias:
        layers["bo"] = (L, D)
    if config.qk_norm:
        layers |= {"q_norm": (L, H), "k_norm": (L, H)}
    if config.sandwich_norms:
        layers |= {"post_attn_norm": (L, D), "post_mlp_norm": (L, D)}
    shapes: Params = {"embed": (V, D), "final_norm": (D,), "layers": layers}
    if config.classifier:
        shapes["score"] = (D, config.num_labels)
    elif not config.tie_word_embeddings:
        shapes["lm_head"] = (D, V)
    return shapes


def _linear(heads: int | None = None, out_heads: int | None = None):
    """torch Linear weight [out, in] -> [in, out], optionally splitting heads."""

    def transform(w: np.ndarray) -> np.ndarray:
        w = w.T
        if heads is not None:  # [D, N*H] -> [D, N, H]
            w = w.reshape(w.shape[0], heads, -1)
        if out_heads is not None:  # [N*H, D] -> [N, H, D]
            w = w.reshape(out_heads, -1, w.shape[-1])
        return w

    return transform


def _split_heads(heads: int):
    return lambda b: b.reshape(heads, -1)


def _identity(x: np.ndarray) -> np.ndarray:
    return x


def _layer_table(config: ModelConfig) -> dict[str, tuple[str, Callable]]:
    """Per-layer checkpoint suffix -> (parameter name, value transform)."""
    N, K = config.num_heads, config.num_kv_heads
    table = {
        "input_layernorm.weight": ("attn_norm", _identity),
        "self_attn.q_proj.weight": ("wq", _linear(heads=N)),
        "self_attn.k_proj.weight": ("wk", _linear(heads=K)),
        "self_attn.v_proj.weight": ("wv", _linear(heads=K)),
        "self_attn.o_proj.weight": ("wo", _linear(out_heads=N)),
        "mlp.gate_proj.weight": ("w_gate", _linear()),
        "mlp.up_proj.weight": ("w_up", _linear()),
        "mlp.down_proj.weight": ("w_down", _linear()),
    }
    if config.sandwich_norms:
        table |= {
            "post_attention_layernorm.weight": ("post_attn_norm", _identity),
            "pre_feedforward_layernorm.weight": ("mlp_norm", _identity),
            "post_feedforward_layernorm.weight": ("post_mlp_norm", _identity),
        }
    else:
        table["post_attention_layernorm.weight"] = ("mlp_norm", _identity)
    if config.qkv_bias:
        table |= {
            "self_attn.q_proj.bias": ("bq", _split_heads(N)),
            "self_attn.k_proj.bias": ("bk", _split_heads(K)),
            "self_attn.v_proj.bias": ("bv", _split_heads(K)),
        }
    if config.o_bias:
        table["self_attn.o_proj.bias"] = ("bo", _identity)
    if config.qk_norm:
        table |= {
            "self_attn.q_norm.weight": ("q_norm", _identity),
            "self_attn.k_norm.weight": ("k_norm", _identity),
        }
    return table


def params_from_checkpoint(
    config: ModelConfig, tensors: Mapping[str, np.ndarray], dtype: np.dtype = np.float32
) -> Params:
    """Map Hugging Face-named tensors onto the parameter tree, cast to `dtype`.

    Fails once, naming every missing, unexpected or misshapen tensor.
    """
    top = {
        "model.embed_tokens.weight": ("embed", _identity),
        "model.norm.weight": ("final_norm", _identity),
    }
    if config.classifier:
        top["score.weight"] = ("score", _linear())
    elif not config.tie_word_embeddings:
        top["lm_head.weight"] = ("lm_head", _linear())
    layer_table = _layer_table(config)
    expected = set(top) | {
        f"model.layers.{i}.{suffix}" for i in range(config.num_layers) for suffix in layer_table
    }
    # A tied checkpoint may still carry a copy of the embedding as lm_head; it is unused.
    optional = {"lm_head.weight"} if config.tie_word_embeddings and not config.classifier else set()
    present = {name for name in tensors if not _IGNORED.match(name)}
    missing = sorted(expected - present)
    unexpected = sorted(present - expected - optional)

    shapes = param_shapes(config)
    params: Params = {"layers": {}}
    stacked: dict[str, list] = {
        name: [None] * config.num_layers for name, _ in layer_table.values()
    }
    misshapen = []

    def put(value: np.ndarray, want: tuple, where: str) -> np.ndarray | None:
        if value.shape != want:
            misshapen.append(f"{where}: shape {value.shape}, expected {want}")
            return None
        return np.asarray(value, dtype=dtype)

    for ckpt_name, (name, transform) in top.items():
        if ckpt_name in present:
            params[name] = put(transform(np.asarray(tensors[ckpt_name])), shapes[name], ckpt_name)
    layer_re = re.compile(r"model\.layers\.(\d+)\.(.+)")
    for ckpt_name in sorted(present & expected):
        m = layer_re.fullmatch(ckpt_name)
        if not m:
            continue
        i, suffix = int(m.group(1)), m.group(2)
        name, transform = layer_table[suffix]
        value = transform(np.asarray(tensors[ckpt_name]))
        stacked[name][i] = put(value, shapes["layers"][name][1:], ckpt_name)

    if missing or unexpected or misshapen:
        lines = [f"checkpoint does not match its {config.family} config:"]
        lines += [f"  missing: {n}" for n in missing]
        lines += [f"  unexpected: {n}" for n in unexpected]
        lines += [f"  {m}" for m in misshapen]
        raise CheckpointMismatchError("\n".join(lines))
    params["layers"] = {name: np.stack(values) for name, values in stacked.items()}
    return params


def layers_as_bits(params: Params) -> Params:
    """params with every bfloat16 layer weight as its uint16 bits (`Model.params` on CPU).

    XLA:CPU has no bfloat16 dynamic-slice: a layer scan over bfloat16 weights widens the whole
    stack to float32 on every call and narrows each layer's slice back, which cost the mixed
    precision a quarter of its step. uint16 slices natively; the decoder's scan casts each slice's
    bits back (`bits_as_bfloat16`), which costs nothing.
    """

    def bits(a):
        return jax.lax.bitcast_convert_type(a, jnp.uint16) if a.dtype == jnp.bfloat16 else a

    return {**params, "layers": jax.tree.map(bits, params["layers"])}


def bits_as_bfloat16(tree):
    """Undo `layers_as_bits` on a tree of layer weights (uint16 leaves back to bfloat16)."""

    def weights(a):
        return jax.lax.bitcast_convert_type(a, jnp.bfloat16) if a.dtype == jnp.uint16 else a

    return jax.tree.map(weights, tree)
