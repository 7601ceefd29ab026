"""prefill_extend's memory estimates: bytes of an extend row and a prefill row, rows per step."""

from __future__ import annotations

from tpuscore.backends.buckets import pow2_floor
from tpuscore.backends.work import activation_bytes_per_token
from tpuscore.models.config import ModelConfig


def extend_batch_rows(
    config: ModelConfig, item_len: int, budget: int, max_tokens: int, row_prefix_len: int = 0
) -> int:
    """Items per extend step at this item length: a power of two whose activations fit the
    budget, with at most max_tokens item tokens.

    Per item token, in float32: activations, and scores and exp weights against its own item.
    Scores against a prefix shared by the whole step go through fixed-size blocks
    (`attention.score_block_tokens`). With a prefix per row (rows of different queries, stacked and
    padded to `row_prefix_len` positions), each row also holds its own copy of that prefix's K/V,
    and its scores against it are not blocked."""
    per_token = extend_row_bytes(config, item_len, row_prefix_len) // item_len
    return pow2_floor(min(max_tokens, budget // per_token) // item_len)


def extend_row_bytes(config: ModelConfig, item_len: int, row_prefix_len: int = 0) -> int:
    """One row of an extend step (see `extend_batch_rows`)."""
    K, H = config.num_kv_heads, config.head_dim
    per_token = activation_bytes_per_token(config) + 4 * 3 * config.num_heads * item_len
    per_token += 4 * 3 * config.num_heads * row_prefix_len
    return item_len * per_token + 2 * 4 * K * H * row_prefix_len


def prefill_row_bytes(config: ModelConfig, length: int, base_len: int) -> int:
    """One row of a batched prefill step: `length` new tokens continuing a cached prefix of
    `base_len` padded positions. In float32: activations, scores and exp weights against its own
    tokens and against its prefix, and its copy of the prefix's K/V."""
    N, K, H = config.num_heads, config.num_kv_heads, config.head_dim
    per_token = activation_bytes_per_token(config) + 4 * 3 * N * (length + base_len)
    return length * per_token + 2 * 4 * K * H * base_len


def prefill_rows(
    config: ModelConfig, length: int, base_len: int, budget: int, max_tokens: int
) -> int:
    """Queries per batched prefill step (see `prefill_row_bytes`): a power of two whose memory
    fits the budget, with at most max_tokens tokens in all (at least 1)."""
    per_row = prefill_row_bytes(config, length, base_len)
    return pow2_floor(min(budget // per_row, max_tokens // length))
