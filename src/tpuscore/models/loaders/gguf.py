"""Reading a GGUF file: the config from its metadata, its tensors under Hugging Face names and
its tokenizer.

Tensors come out dequantized to float32 in torch layout, so `weights.params_from_checkpoint`
treats a GGUF exactly like a safetensors checkpoint. Two llama.cpp conventions are undone here:
ggml lists dimensions fastest-first (numpy's shape is the reverse), and the Llama converter
interleaves the two RoPE halves of every Q and K head.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Any

import gguf
import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from tpuscore.models.config import ModelConfig, UnsupportedModelError
from tpuscore.models.weights import CheckpointMismatchError

logger = logging.getLogger(__name__)

_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GGUF_FAMILIES = ("llama", "qwen2", "qwen3")  # the architectures this reader maps
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")

# Pre-tokenizer regexes, as transformers and llama.cpp spell them for these `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4  # llama.cpp's tokenizer.ggml.token_type values
_REQUIRED = object()


@dataclasses.dataclass(frozen=True)
class GGUFCheckpoint:
    config: ModelConfig
    tensors: dict[str, np.ndarray]  # Hugging Face names, float32, torch layout
    tokenizer: tokenizers.Tokenizer


def read_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
    """Read a llama, qwen2 or qwen3 GGUF file into a config, float32 tensors and a tokenizer."""
    try:
        reader = gguf.GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError) as e:  # gguf's reader names no file, only numpy
        size = os.path.getsize(path)
        raise CheckpointMismatchError(
            f"{os.fspath(path)} is not a whole GGUF file ({size} bytes): truncated or corrupt "
            f"({type(e).__name__}: {e})"
        ) from e
    meta = _Metadata(reader, os.fspath(path))
    tensor_names = {t.name for t in reader.tensors}
    tokens = meta.get("tokenizer.ggml.tokens")
    config = _config(meta, tensor_names, len(tokens))
    tensors = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        value = _dequantize(t)
        if config.family == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            value = _unpermute_rope(value, config.num_heads)
        elif config.family == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            value = _unpermute_rope(value, config.num_kv_heads)
        tensors[name] = value
    logger.info("read %s: %s, %d tensors", meta.path, config.family, len(tensors))
    return GGUFCheckpoint(config, tensors, _tokenizer(meta, tokens))


def _hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor; names without one pass through unchanged."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    return gguf_name


class _Metadata:
    """A GGUF's metadata; a missing required key fails with the key's name."""

    def __init__(self, reader: gguf.GGUFReader, path: str):
        self.fields = reader.fields
        self.path = path

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        field = self.fields.get(key)
        if field is not None:
            return field.contents()
        if default is _REQUIRED:
            raise ValueError(f"{self.path}: GGUF metadata has no {key!r}")
        return default

    def get_float(self, key: str) -> float:
        # GGUF stores float32; the shortest decimal that rounds to it is what config.json said.
        return float(str(np.float32(self.get(key))))


def _config(meta: _Metadata, tensor_names: set[str], n_tokens: int) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in GGUF_FAMILIES:
        raise UnsupportedModelError(
            f"{meta.path}: general.architecture {arch!r} is not supported; "
            f"supported: {', '.join(GGUF_FAMILIES)}"
        )
    scaling = {k: meta.get(k) for k in meta.fields if k.startswith(f"{arch}.rope.scaling.")}
    if scaling and scaling.get(f"{arch}.rope.scaling.type") != "none":
        raise UnsupportedModelError(f"{meta.path}: RoPE scaling is not supported: {scaling}")
    hidden = meta.get(f"{arch}.embedding_length")
    heads = meta.get(f"{arch}.attention.head_count")
    head_dim = meta.get(f"{arch}.attention.key_length", hidden // heads)
    rotary = meta.get(f"{arch}.rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise UnsupportedModelError(
            f"{meta.path}: {arch}.rope.dimension_count={rotary} differs from head_dim={head_dim}; "
            "partial rotary embeddings are not supported"
        )

    def has_bias(kind: str) -> bool:
        return any(name.endswith(f".{kind}.bias") for name in tensor_names)

    # The same family rules as ModelConfig.from_hf, with bias tensors standing in for
    # attention_bias (GGUF metadata has no such flag).
    return ModelConfig(
        family=arch,
        vocab_size=meta.get(f"{arch}.vocab_size", n_tokens),
        hidden_size=hidden,
        intermediate_size=meta.get(f"{arch}.feed_forward_length"),
        num_layers=meta.get(f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=meta.get(f"{arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=meta.get_float(f"{arch}.attention.layer_norm_rms_epsilon"),
        rope_theta=meta.get_float(f"{arch}.rope.freq_base"),
        max_position_embeddings=meta.get(f"{arch}.context_length"),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias=arch == "qwen2" or has_bias("attn_q"),
        o_bias=arch != "qwen2" and has_bias("attn_output"),
        qk_norm=arch == "qwen3",
    )


def _dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # A copy: F32 tensors would otherwise be read-only views of the memory-mapped file.
    return np.array(values, dtype=np.float32).reshape(tuple(reversed(tensor.shape.tolist())))


def _unpermute_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute`: per head, rows interleaved as (H/2, 2) back to (2, H/2)."""
    return w.reshape(heads, -1, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _split_pre_tokenizer(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _gpt2_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


# tokenizer.ggml.pre -> (pre-tokenizer factory, BPE ignore_merges). llama.cpp looks a whole
# pre-token up in the vocabulary before merging for Llama 3, as its tokenizer.json does.
_PRE_TOKENIZERS = {
    "smollm": (
        lambda: pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), _gpt2_pre_tokenizer()]
        ),
        False,
    ),
    "llama-bpe": (lambda: _split_pre_tokenizer(_LLAMA3_SPLIT), True),
    "llama3": (lambda: _split_pre_tokenizer(_LLAMA3_SPLIT), True),
    "qwen2": (lambda: _split_pre_tokenizer(_QWEN2_SPLIT), False),
}


def _tokenizer(meta: _Metadata, tokens: list[str]) -> tokenizers.Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(
            f"{meta.path}: tokenizer.ggml.model {kind!r} is not supported; "
            "supported: gpt2 (byte-level BPE)"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre in _PRE_TOKENIZERS:
        make_pre_tokenizer, ignore_merges = _PRE_TOKENIZERS[pre]
    else:
        logger.warning(
            "tokenizer.ggml.pre %r is not known; splitting text as GPT-2 does, which may not "
            "match the original tokenizer",
            pre,
        )
        make_pre_tokenizer, ignore_merges = _gpt2_pre_tokenizer, False
    merges = [tuple(merge.split(" ")) for merge in meta.get("tokenizer.ggml.merges")]
    tokenizer = tokenizers.Tokenizer(
        models.BPE(
            vocab={token: i for i, token in enumerate(tokens)},
            merges=merges,
            ignore_merges=ignore_merges,
        )
    )
    tokenizer.pre_tokenizer = make_pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()

    # Control tokens (like <|im_start|>) and user-defined ones must match whole in the text.
    typed = list(zip(tokens, meta.get("tokenizer.ggml.token_type", [0] * len(tokens)), strict=True))
    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, kind in typed
            if kind == _TOKEN_CONTROL
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, kind in typed
            if kind == _TOKEN_USER_DEFINED
        ]
    )
    if meta.get("tokenizer.ggml.add_bos_token", False):
        bos_id = meta.get("tokenizer.ggml.bos_token_id")
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=[bos, "$A"],
            pair=[bos, "$A", f"{bos}:1", "$B:1"],
            special_tokens=[(bos, bos_id)],
        )
    return tokenizer
