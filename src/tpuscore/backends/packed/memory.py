"""The packed backends' memory estimates: bytes of a packed row and of a step, rows per step."""

from __future__ import annotations

from tpuscore.backends.buckets import pow2_floor
from tpuscore.backends.work import activation_bytes_per_token, dense_attention_bytes, logits_bytes
from tpuscore.models.config import ModelConfig


def packed_bytes(config: ModelConfig, length: int, *, dense_mask: bool) -> int:
    """One packed sequence of `length` tokens: activations, plus with a dense mask its attention
    (`work.dense_attention_bytes`)."""
    attention = dense_attention_bytes(config, length) if dense_mask else 0
    return length * activation_bytes_per_token(config) + attention


def packed_step_bytes(
    config: ModelConfig, rows: int, length: int, slots: int, *, dense_mask: bool
) -> int:
    """One packed step of `rows` sequences of `length` tokens, each scoring `slots` positions:
    the rows' layer memory, and their float32 logits and log-softmax over the vocabulary."""
    return rows * (
        packed_bytes(config, length, dense_mask=dense_mask) + logits_bytes(config, slots)
    )


def packed_rows(
    config: ModelConfig, length: int, budget: int, max_tokens: int, *, dense_mask: bool
) -> int:
    """Packed sequences per step at this length: a power of two whose layer memory fits the
    budget, with at most max_tokens tokens in all (at least 1)."""
    per_row = packed_bytes(config, length, dense_mask=dense_mask)
    return pow2_floor(min(budget // per_row, max_tokens // length))
