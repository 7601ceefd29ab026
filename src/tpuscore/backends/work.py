"""The work of one device step, in the units a device profile prices (`engine/selection.py`),
and the memory terms every backend's estimate is built from.

All memory terms count float32 activations of one layer (layers run one after another under
`lax.scan`). Each backend's own formulas (rows per step, bytes per row) live with the backend.
"""

from __future__ import annotations

import attrs
import numpy as np

from tpuscore.models.config import ModelConfig


@attrs.frozen
class StepWork:
    """One device step: matmul `flops`, `bytes` read from device memory (the weights, cached or
    re-read K/V), attention `scores` computed (each an exp and its softmax share), and `peak`
    memory on one device."""

    flops: float
    bytes: float
    scores: float
    peak: int


def step_work(
    config: ModelConfig,
    itemsize: int,
    *,
    rows: int,
    new: int,
    pairs: float,
    slots: int,
    peak: int,
    kv_bytes: float = 0,
) -> StepWork:
    """A step running `rows` rows of `new` tokens each through the layers, computing `pairs`
    (query token, key) attention scores per head and layer in all, with `slots` positions per row
    through the LM head, reading `kv_bytes` of K/V besides the weights."""
    D, F, V = config.hidden_size, config.intermediate_size, config.vocab_size
    N, K, H, L = config.num_heads, config.num_kv_heads, config.head_dim, config.num_layers
    layer_params = D * H * (2 * N + 2 * K) + 3 * D * F
    flops = 2 * L * layer_params * rows * new + 4 * L * N * H * pairs + 2 * D * V * rows * slots
    weights = (L * layer_params + D * V) * itemsize
    return StepWork(float(flops), float(weights + kv_bytes), float(L * N * pairs), int(peak))


def kv_bytes(config: ModelConfig, positions: int, itemsize: int) -> int:
    """All layers' K and V of `positions` positions."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * positions * itemsize


def segment_tiles(seg_start: np.ndarray, prefix_len: int, block_q: int, block_kv: int) -> int:
    """(query tile, key tile) pairs the segment kernel computes for one packed row: per query
    tile, the key tiles of the prefix up to its last row and those from its first row's segment
    start to its last row (`kernels.segment`'s visible set)."""
    T = len(seg_start)
    last = np.minimum(np.arange(block_q, T + block_q, block_q), T) - 1  # each tile's last row
    first_start = seg_start[::block_q]
    diagonal = last // block_kv - first_start // block_kv + 1
    prefix = np.minimum(-(-prefix_len // block_kv), first_start // block_kv)
    return int((diagonal + prefix).sum())


def activation_bytes_per_token(config: ModelConfig) -> int:
    """float32 activations of one token in one layer: residual, norms, q/k/v/o, MLP."""
    return 4 * (4 * config.hidden_size + 3 * config.intermediate_size)


def dense_attention_bytes(config: ModelConfig, length: int) -> int:
    """Attention of `length` tokens under a dense mask: the [T, T] mask, and per head the float32
    scores, exp weights and their cast."""
    return length * length * (1 + 12 * config.num_heads)


def logits_bytes(config: ModelConfig, slots: int) -> int:
    """float32 logits and their log-softmax over the vocabulary at `slots` positions."""
    return 2 * 4 * slots * config.vocab_size
