"""Tiny random Hugging Face checkpoints and reference scores computed with transformers.

The library is checked against this independent implementation: `make_checkpoint` writes a
random model of one family (`config.json`, `model.safetensors`, `tokenizer.json`) and
`hf_logprobs` scores token sequences with transformers, one unpadded sequence at a time.

Dimensions are prime-ish and every parameter is random (biases non-zero, norm weights not
ones) so that a transposed, permuted or skipped tensor changes the scores.
"""

from __future__ import annotations

import functools
import os
import pathlib
from typing import Any

import numpy as np
import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # keep test logs readable

BOS = "<|bos|>"
EOS = "<|eos|>"
TOKENIZER_VOCAB_SIZE = 313  # 256 bytes + 2 specials + 55 merges
MODEL_VOCAB_SIZE = 331  # > TOKENIZER_VOCAB_SIZE: ids no text encodes to still get logits

_CORPUS = """\
The quick brown fox jumps over the lazy dog while the farmer watches from the gate.
In the morning the market opens early, and the traders set out apples, bread and cheese.
A good recommendation system ranks the items a person is most likely to want next.
She asked whether the capital of France is Paris, and the answer was simply yes.

Language models read a prompt one token at a time and predict the token that comes next.
When the query is long, the model must remember where each word sat in the sentence;
rotary position embeddings rotate the queries and keys so that attention sees the distance.
Scoring many items against one query reuses the same prefix again and again.

The river ran past the old mill, under the stone bridge, and out toward the sea.
Children played in the park until the evening light faded and the street lamps came on.
Numbers such as 12, 345 and 6789 appear in text too, as do dates like 2024-05-17.
Is this review positive or negative? The film was long, but the ending was wonderful.
"""

_SPECIAL_IDS = {BOS: 0, EOS: 1}  # specials come first in the trainer, so they get ids 0 and 1

# One entry per model family; `make_checkpoint(path, case)` builds it.
#   model_type: the transformers `model_type` of the config.
#   add_bos: whether the tokenizer prepends <|bos|> when asked for special tokens.
#   config: kwargs for the config class (on top of the shared `_COMMON_CONFIG`).
# transformers 5 takes RoPE settings as one `rope_parameters` dict (rope_type, rope_theta and
# the scaling keys); the old `rope_theta` / `rope_scaling` arguments are gone.
FAMILY_CASES: dict[str, dict[str, Any]] = {
    # GQA (6 query heads share 2 kv heads); head_dim 10 != hidden 42 / 6 heads.
    "llama_gqa_untied": {
        "model_type": "llama",
        "add_bos": False,
        "config": {
            "hidden_size": 42,
            "num_attention_heads": 6,
            "num_key_value_heads": 2,
            "head_dim": 10,
            "intermediate_size": 58,
            "num_hidden_layers": 2,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    },
    # Llama-3 RoPE scaling with a small original context (64) so that all three frequency bands
    # (kept, interpolated, divided by factor) occur for head_dim 22 within a 300-token prompt.
    # MHA (kv heads == heads), tied embeddings, tokenizer with BOS.
    "llama3_rope_tied": {
        "model_type": "llama",
        "add_bos": True,
        "config": {
            "hidden_size": 66,
            "num_attention_heads": 3,
            "num_key_value_heads": 3,
            "intermediate_size": 83,
            "num_hidden_layers": 2,
            "tie_word_embeddings": True,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    },
    # Qwen2: q/k/v projections carry biases; MQA (1 kv head); odd intermediate; tied.
    "qwen2_bias": {
        "model_type": "qwen2",
        "add_bos": False,
        "config": {
            "hidden_size": 70,
            "num_attention_heads": 5,
            "num_key_value_heads": 1,
            "intermediate_size": 97,
            "num_hidden_layers": 2,
            "tie_word_embeddings": True,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    },
    # Qwen3: RMSNorm on q and k per head; explicit head_dim 14 (4 * 14 != hidden 38); GQA; untied.
    "qwen3_qknorm": {
        "model_type": "qwen3",
        "add_bos": False,
        "config": {
            "hidden_size": 38,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 14,
            "intermediate_size": 61,
            "num_hidden_layers": 2,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    },
}

# Gemma and classification-head cases (issue 23). Not in conftest's FAMILY_CASES, so the tests
# parametrized over the causal families do not grow; test_gemma.py and test_seq_cls.py use them.
# Windows (7, 9) are shorter than the test sequences, so the sliding layers really cut; soft-caps
# are small enough to bend the random model's scores.
FAMILY_CASES |= {
    # Gemma 2: local then global layer, query_pre_attn_scalar != head_dim, both soft-caps, GQA.
    "gemma2_window": {
        "model_type": "gemma2",
        "add_bos": True,
        "config": {
            "hidden_size": 48,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 14,
            "intermediate_size": 71,
            "num_hidden_layers": 2,
            "hidden_activation": "gelu_pytorch_tanh",
            "rms_norm_eps": 1e-6,
            "query_pre_attn_scalar": 19,
            "sliding_window": 7,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 1.5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    },
    # Gemma 3 (text): q/k norms, a local RoPE base apart from the global one (linear-scaled),
    # global layer first so the scan really switches, MQA.
    "gemma3_window": {
        "model_type": "gemma3_text",
        "add_bos": True,
        "config": {
            "hidden_size": 52,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "intermediate_size": 67,
            "num_hidden_layers": 2,
            "hidden_activation": "gelu_pytorch_tanh",
            "rms_norm_eps": 1e-6,
            "query_pre_attn_scalar": 23,
            "sliding_window": 9,
            "layer_types": ["full_attention", "sliding_attention"],
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "rope_theta": 100000.0, "factor": 2.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
        },
    },
    # Sequence classification heads: one logit (sigmoid scores), three named classes, and two
    # classes with a pad token that moves the pooled token.
    "llama_seq_cls": {
        "model_type": "llama",
        "add_bos": False,
        "head": "seq_cls",
        "config": {
            **FAMILY_CASES["llama_gqa_untied"]["config"],
            "num_labels": 1,
        },
    },
    "qwen2_seq_cls": {
        "model_type": "qwen2",
        "add_bos": False,
        "head": "seq_cls",
        "config": {
            **FAMILY_CASES["qwen2_bias"]["config"],
            "id2label": {0: "negative", 1: "neutral", 2: "positive"},
        },
    },
    # Gemma 1 ((1 + w) norms, GeGLU, scaled embeddings, no sandwich norms) under a head.
    "gemma_seq_cls": {
        "model_type": "gemma",
        "add_bos": True,
        "head": "seq_cls",
        "config": {
            "hidden_size": 44,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 12,
            "intermediate_size": 53,
            "num_hidden_layers": 2,
            "hidden_act": "gelu_pytorch_tanh",
            "rms_norm_eps": 1e-6,
            "num_labels": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    },
    "qwen3_seq_cls": {
        "model_type": "qwen3",
        "add_bos": False,
        "head": "seq_cls",
        "pad_token_id": 1,
        "config": {**FAMILY_CASES["qwen3_qknorm"]["config"], "num_labels": 2},
    },
}

_COMMON_CONFIG: dict[str, Any] = {
    "vocab_size": MODEL_VOCAB_SIZE,
    "max_position_embeddings": 512,
    "hidden_act": "silu",
    "bos_token_id": _SPECIAL_IDS[BOS],
    "eos_token_id": _SPECIAL_IDS[EOS],
    "pad_token_id": None,
    "dtype": "float32",
}

_NORM_STD = 0.3  # norm weights ~ N(1, 0.3^2)
_WEIGHT_STD = 0.1  # matrices, embeddings and biases ~ N(0, 0.1^2)


def train_tokenizer(path_dir: str | os.PathLike[str], *, add_bos: bool) -> tokenizers.Tokenizer:
    """Train a byte-level BPE tokenizer on a built-in corpus, save `tokenizer.json`, return it.

    All 256 bytes are in the alphabet, so any unicode text encodes. With `add_bos`, encoding with
    `add_special_tokens=True` prepends <|bos|>; `add_special_tokens=False` never does.
    Deterministic: every call gives the same vocabulary and merges.
    """
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    for token, token_id in _SPECIAL_IDS.items():
        assert tok.token_to_id(token) == token_id, (token, tok.token_to_id(token))
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A",
            pair=f"{BOS} $A $B:1",
            special_tokens=[(BOS, _SPECIAL_IDS[BOS])],
        )
    path = pathlib.Path(path_dir)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return tok


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with seeded normal noise: norms near 1, the rest near 0."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():  # tied weights are listed once
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            param.copy_(1.0 + _NORM_STD * noise)
        else:
            param.copy_(_WEIGHT_STD * noise)


def make_checkpoint(path_dir: str | os.PathLike[str], case: str, seed: int = 0) -> pathlib.Path:
    """Write a random float32 checkpoint of `FAMILY_CASES[case]` and its tokenizer to `path_dir`.

    The directory gets `config.json`, `model.safetensors` and `tokenizer.json`.
    """
    if case not in FAMILY_CASES:
        raise ValueError(f"case={case!r} is unknown; expected one of {sorted(FAMILY_CASES)}")
    spec = FAMILY_CASES[case]
    common = {**_COMMON_CONFIG, "pad_token_id": spec.get("pad_token_id")}
    config = AutoConfig.for_model(spec["model_type"], **(common | spec["config"]))
    torch.manual_seed(seed)
    auto = AutoModelForSequenceClassification if spec.get("head") else AutoModelForCausalLM
    model = auto.from_config(config).to(torch.float32)
    _randomize(model, seed)
    path = pathlib.Path(path_dir)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    train_tokenizer(path, add_bos=spec["add_bos"])
    return path


@functools.lru_cache(maxsize=16)
def _load_model(path: str, mtime_ns: int, classifier: bool) -> torch.nn.Module:
    """Load once per checkpoint; `mtime_ns` keys the cache so a rewritten checkpoint reloads."""
    del mtime_ns
    auto = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def load_model(path_dir: str | os.PathLike[str], classifier: bool = False) -> torch.nn.Module:
    """The checkpoint as a float32, eager-attention, eval-mode transformers model (cached);
    classifier: as `AutoModelForSequenceClassification`."""
    path = pathlib.Path(path_dir).resolve()
    return _load_model(str(path), (path / "model.safetensors").stat().st_mtime_ns, classifier)


def hf_class_logits(path_dir: str | os.PathLike[str], sequences: list[list[int]]) -> np.ndarray:
    """transformers' `AutoModelForSequenceClassification` logits [len(sequences), num_labels]
    (float64), each sequence run alone, pooled as transformers pools (the last non-pad token)."""
    model = load_model(path_dir, classifier=True)
    out = []
    for seq in sequences:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq], dtype=torch.long), use_cache=False).logits
        out.append(logits[0].to(torch.float64).numpy())
    return np.stack(out)


def hf_logprobs(
    path_dir: str | os.PathLike[str], sequences: list[list[int]], label_ids: list[int]
) -> np.ndarray:
    """log P(label | sequence) for each sequence and label, computed by transformers from the
    checkpoint at `path_dir` (see `model_logprobs`)."""
    return model_logprobs(load_model(path_dir), sequences, label_ids)


def model_logprobs(
    model: torch.nn.Module, sequences: list[list[int]], label_ids: list[int]
) -> np.ndarray:
    """log P(label | sequence) for each sequence and label, computed by a transformers model.

    Each sequence runs alone (no padding); the logits at its last position go through a float64
    log_softmax over the whole model vocabulary. Returns float64 [len(sequences), len(label_ids)].
    """
    vocab_size = model.config.vocab_size
    bad_labels = [i for i in label_ids if not 0 <= i < vocab_size]
    if bad_labels:
        raise ValueError(f"label_ids {bad_labels} are outside the vocabulary [0, {vocab_size})")
    out = np.empty((len(sequences), len(label_ids)), dtype=np.float64)
    for row, seq in enumerate(sequences):
        if not seq:
            raise ValueError(f"sequences[{row}] is empty; each sequence needs at least one token")
        bad = [i for i in seq if not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"sequences[{row}] has ids {bad} outside [0, {vocab_size})")
        input_ids = torch.tensor([seq], dtype=torch.long)  # [1, T]
        with torch.no_grad():
            logits = model(input_ids=input_ids, use_cache=False).logits  # [1, T, V]
        logprobs = torch.log_softmax(logits[0, -1].to(torch.float64), dim=-1)  # [V]
        out[row] = logprobs[label_ids].numpy()
    return out
