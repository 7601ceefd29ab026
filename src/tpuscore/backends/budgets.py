"""Budgets: the bytes a backend's steps may plan for, and the device memory left for one step.

On an accelerator that reports its memory a budget is a share of it; on CPU (which reports none), a
fixed number of bytes. A backend (`Budgeted`) sizes its steps to its activation budget divided by
its own safety factor, which `engine/memory_guard.py` doubles each time one of its steps still runs
out of memory. The factor lives on the backend instance, so each scorer's pool has its own: two
scorers in one process never shrink each other's steps.
"""

from __future__ import annotations

import os

import jax

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


class Budgeted:
    """A backend that sizes its steps to `activation_bytes` over its own `safety` factor (1
    until one of its steps ran out of memory). Subclasses set `activation_bytes` and have
    `work(batches)`, the priced steps of their plan, which the memory guard counts."""

    activation_bytes: int
    safety: float = 1.0

    def grow_safety(self) -> float:
        """Double this backend's safety factor (for the rest of its life); returns the new one."""
        self.safety = 2 * self.safety
        return self.safety

    @property
    def budget(self) -> int:
        """The bytes a step may plan for: the activation budget over the safety factor."""
        return max(1, int(self.activation_bytes / self.safety))

    @property
    def peak_budget(self) -> int:
        """What a step's estimated peak may reach: its budget, and what the backend holds across
        steps (a query's K/V) where it has its own budget for that."""
        return self.budget
