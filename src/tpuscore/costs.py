"""Costs: the memory budgets a backend may use and each backend's memory estimates.

Budgets: on an accelerator that reports its memory, a share of it; on CPU (which reports none), a
fixed number of bytes. Estimates: the bytes one step of each backend holds, from the model's
dimensions, so a backend can split its work to fit. All estimates count float32 activations of
one layer (layers run one after another under `lax.scan`).
"""

from __future__ import annotations

import jax

from tpuscore.buckets import pow2_floor
from tpuscore.models.config import ModelConfig

CPU_CACHE_BYTES = 1 << 30
ACCELERATOR_CACHE_SHARE = 0.1
CPU_ACTIVATION_BYTES = 1 << 28
ACCELERATOR_ACTIVATION_SHARE = 0.125
CPU_SCORE_BLOCK_BYTES = 4 << 20  # about an L2 cache: see `decoder._prefix_parts`
SCORE_BLOCK_BYTES = 256 << 20


def memory_budget(accelerator_share: float, cpu_bytes: int) -> int:
    """A share of the first device's memory on an accelerator that reports it, else cpu_bytes."""
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"] * accelerator_share)
    return cpu_bytes


def cache_budget() -> int:
    """1 GiB on CPU; a tenth of the device's memory on an accelerator that reports it."""
    return memory_budget(ACCELERATOR_CACHE_SHARE, CPU_CACHE_BYTES)


def activation_budget() -> int:
    """256 MiB on CPU; an eighth of the device's memory on an accelerator that reports it."""
    return memory_budget(ACCELERATOR_ACTIVATION_SHARE, CPU_ACTIVATION_BYTES)


def activation_bytes_per_token(config: ModelConfig) -> int:
    """float32 activations of one token in one layer: residual, norms, q/k/v/o, MLP."""
    return 4 * (4 * config.hidden_size + 3 * config.intermediate_size)


def packed_bytes(config: ModelConfig, length: int, *, dense_mask: bool) -> int:
    """One packed sequence of `length` tokens: activations, plus with a dense mask the [T, T]
    mask and per head the float32 scores, exp weights and their cast."""
    attention = length * length * (1 + 12 * config.num_heads) if dense_mask else 0
    return length * activation_bytes_per_token(config) + attention


def packed_step_bytes(
    config: ModelConfig, rows: int, length: int, slots: int, *, dense_mask: bool
) -> int:
    """One packed step of `rows` sequences of `length` tokens, each scoring `slots` positions:
    the rows' layer memory, and their float32 logits and log-softmax over the vocabulary."""
    lm_head = 2 * 4 * slots * config.vocab_size
    return rows * (packed_bytes(config, length, dense_mask=dense_mask) + lm_head)


def packed_rows(
    config: ModelConfig, length: int, budget: int, max_tokens: int, *, dense_mask: bool
) -> int:
    """Packed sequences per step at this length: a power of two whose layer memory fits the
    budget, with at most max_tokens tokens in all (at least 1)."""
    per_row = packed_bytes(config, length, dense_mask=dense_mask)
    return pow2_floor(min(budget // per_row, max_tokens // length))


def extend_batch_rows(
    config: ModelConfig, item_len: int, budget: int, max_tokens: int, row_prefix_len: int = 0
) -> int:
    """Items per prefill_extend step at this item length: a power of two whose activations fit
    the budget, with at most max_tokens item tokens.

    Per item token, in float32: activations, and scores and exp weights against its own item.
    Scores against a prefix shared by the whole step go through fixed-size blocks
    (`score_block_tokens`). With a prefix per row (rows of different queries, stacked and padded
    to `row_prefix_len` positions), each row also holds its own copy of that prefix's K/V, and its
    scores against it are not blocked."""
    K, H = config.num_kv_heads, config.head_dim
    per_token = activation_bytes_per_token(config) + 4 * 3 * config.num_heads * item_len
    per_token += (
        4 * 3 * config.num_heads * row_prefix_len + 2 * 4 * K * H * row_prefix_len // item_len
    )
    return pow2_floor(min(max_tokens, budget // per_token) // item_len)


def serial_batch_rows(length: int, max_batch_tokens: int, max_rows: int) -> int:
    """Sequences per serial step: a power of two, so chunks reuse count buckets."""
    return pow2_floor(min(max_rows, max_batch_tokens // length))


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


def score_block_tokens(tokens: int, bytes_per_token: int) -> int:
    """The largest divisor of tokens whose attention scores fit the score block (at least 1)."""
    budget = CPU_SCORE_BLOCK_BYTES if jax.default_backend() == "cpu" else SCORE_BLOCK_BYTES
    fits = max(1, budget // bytes_per_token)
    return max(t for t in range(1, min(tokens, fits) + 1) if tokens % t == 0)
