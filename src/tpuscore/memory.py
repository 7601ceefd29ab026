"""Memory budgets: how much a backend may hold for a cache or for one step's activations.

On an accelerator that reports its memory, a share of it; on CPU (which reports none), a fixed
number of bytes.
"""

from __future__ import annotations

import jax

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


def activation_bytes_per_token(config: ModelConfig) -> int:
    """float32 activations of one token in one layer: residual, norms, q/k/v/o, MLP."""
    return 4 * (4 * config.hidden_size + 3 * config.intermediate_size)
