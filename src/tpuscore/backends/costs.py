"""Costs: the memory budgets a backend may use, each backend's memory estimates, and the work of
one device step.

Budgets: on an accelerator that reports its memory, a share of it; on CPU (which reports none), a
fixed number of bytes; either divided by the backend's safety factor, which doubles each time a
step still runs out of memory (`memory_guard.py`). Estimates: the bytes one step of each backend
holds, from the model's dimensions, so a backend can split its work to fit. All estimates count
float32 activations of one layer (layers run one after another under `lax.scan`).

`StepWork` counts what a step computes and reads (FLOPs, bytes, attention scores) and its peak
memory; `selection.py` prices it with a device profile.
"""

from __future__ import annotations

import os

import attrs
import jax
import numpy as np

from tpuscore.backends.buckets import pow2_floor
from tpuscore.models.config import ModelConfig

CPU_CACHE_BYTES = 1 << 30
ACCELERATOR_CACHE_SHARE = 0.1
CPU_ACTIVATION_BYTES = 1 << 28
ACCELERATOR_ACTIVATION_SHARE = 0.125


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


_SAFETY: dict[str, float] = {}


def safety_factor(estimate: str) -> float:
    """How much smaller than its budget an estimate's steps are sized (1 until a step of it ran
    out of memory)."""
    return _SAFETY.get(estimate, 1.0)


def grow_safety(estimate: str) -> float:
    """Double an estimate's safety factor for the rest of the process; returns the new one."""
    _SAFETY[estimate] = 2 * safety_factor(estimate)
    return _SAFETY[estimate]


def budget(configured: int, estimate: str) -> int:
    """The bytes a step of this estimate may plan for: its configured budget over its safety
    factor."""
    return max(1, int(configured / safety_factor(estimate)))


class Budgeted:
    """A backend that sizes its steps to `activation_bytes` under the safety factor of its
    `estimate` (its registered name)."""

    estimate: str
    activation_bytes: int

    @property
    def budget(self) -> int:
        """The bytes a step may plan for: the activation budget over the safety factor."""
        return budget(self.activation_bytes, self.estimate)

    @property
    def peak_budget(self) -> int:
        """What a step's estimated peak may reach: its budget, and what the backend holds across
        steps (a query's K/V) where it has its own budget for that."""
        return self.budget


def device_capacity() -> int:
    """Bytes one step may still take at most: free memory of the first device where it reports
    it (its limit less what is in use, weights and prefix caches included), else the host's
    available memory (CPU)."""
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


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
    return rows * (
        packed_bytes(config, length, dense_mask=dense_mask) + logits_bytes(config, slots)
    )


def logits_bytes(config: ModelConfig, slots: int) -> int:
    """float32 logits and their log-softmax over the vocabulary at `slots` positions."""
    return 2 * 4 * slots * config.vocab_size


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
    (`decoder.score_block_tokens`). With a prefix per row (rows of different queries, stacked and
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


def serial_row_bytes(config: ModelConfig, length: int) -> int:
    """One serial sequence: its layer memory under a dense causal mask, and its float32 logits
    and log-softmax at the scored position."""
    return packed_bytes(config, length, dense_mask=True) + 2 * 4 * config.vocab_size


def serial_batch_rows(
    config: ModelConfig, length: int, budget: int, max_batch_tokens: int, max_rows: int
) -> int:
    """Sequences per serial step: a power of two (so chunks reuse count buckets) whose memory
    fits the budget, with at most max_batch_tokens tokens (at least 1)."""
    fits = budget // serial_row_bytes(config, length)
    return pow2_floor(min(max_rows, max_batch_tokens // length, fits))


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


@attrs.frozen
class StepWork:
    """One device step, in the units a device profile prices (`selection.py`): matmul `flops`,
    `bytes` read from device memory (the weights, cached or re-read K/V), attention `scores`
    computed (each an exp and its softmax share), and `peak` memory on one device."""

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
    start to its last row (`kernels.segment_attention`'s visible set)."""
    T = len(seg_start)
    last = np.minimum(np.arange(block_q, T + block_q, block_q), T) - 1  # each tile's last row
    first_start = seg_start[::block_q]
    diagonal = last // block_kv - first_start // block_kv + 1
    prefix = np.minimum(-(-prefix_len // block_kv), first_start // block_kv)
    return int((diagonal + prefix).sum())
