"""Compiled executables kept within the memory maps the OS lets a process hold.

XLA:CPU links each executable's kernels into the process as JIT code, in memory maps of their
own: about a hundred per decoder step (docs/benchmarks.md, "Executables' memory maps"). Linux caps a
process's maps at vm.max_map_count (65,530 by default), so a process holding some 550 step
executables can link no more: XLA logs "LLVM compilation error: Cannot allocate memory" and the
process dies (SIGSEGV). A service meeting many shapes, or `warmup(all=True)` over a shape set of
more than a few hundred, got there.

`Guard.check()` runs after every engine call: when a compile happened since the last check and
the process holds more than `HIGH_WATER` of its limit, every compiled executable is dropped
(`jax.clear_caches()`, process-wide), and later steps compile again, or load from the persistent
compilation cache. `Guard.check_warmup()` refuses a shape set whose executables cannot all stay
(`ValidationError("shape_set_too_large")`), judged from the maps its first shapes took.
Without /proc (macOS, Windows) both do nothing.
"""

from __future__ import annotations

import logging
import threading

import jax
from jax import monitoring

from tpuscore.api.errors import ValidationError

logger = logging.getLogger(__name__)

MAPS = "/proc/self/maps"
MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"
# Fired for each executable JAX builds, compiled or loaded from the persistent cache.
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# Maps in use past which the executables are dropped: the rest is room for what one engine call
# compiles (a few dozen steps at most) and for the process's own allocations.
HIGH_WATER = 0.75
# Shapes warmup compiles before judging how many maps the whole set would take.
WARMUP_PROBE = 8


def map_count() -> int | None:
    """Memory maps this process holds now, or None where /proc does not say."""
    try:
        with open(MAPS, "rb") as maps:
            return maps.read().count(b"\n")
    except OSError:
        return None


def map_limit() -> int | None:
    """vm.max_map_count, or None where /proc does not say."""
    try:
        with open(MAX_MAP_COUNT) as limit:
            return int(limit.read())
    except (OSError, ValueError):
        return None


class Guard:
    """Watches the process's memory maps for the executables JAX builds (module doc).

    `compiles` counts executables built since the guard started; `dropped` how many times the
    executables were dropped."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # held by `check`
        self.counting = threading.Lock()  # compiles finish on several threads at once
        self.compiles = 0
        self.checked_at = 0  # `compiles` at the last check
        self.dropped = 0
        monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, _seconds: float, **_: object) -> None:
        if event == COMPILE_EVENT:
            with self.counting:
                self.compiles += 1

    def check(self) -> bool:
        """Drop every compiled executable if a compile since the last check left the process
        past `HIGH_WATER` of its map limit; True if it did."""
        with self.lock:
            if self.compiles == self.checked_at:
                return False  # nothing new linked: the count cannot have grown from JAX
            self.checked_at = self.compiles
            count, limit = map_count(), map_limit()
            if count is None or limit is None or count < limit * HIGH_WATER:
                return False
            jax.clear_caches()
            self.dropped += 1
            logger.warning(
                "%d memory maps of the %d this process may hold (vm.max_map_count): dropped "
                "every compiled executable; later steps compile again or load from the "
                "persistent compilation cache (docs/serving.md#compiled-shapes)",
                count, limit,
            )  # fmt: skip
            return True

    def check_warmup(self, total: int, done: int, maps_before: int | None) -> None:
        """After `done` of `total` shapes compiled from `maps_before` maps: ValidationError
        ("shape_set_too_large") if, at the maps each has taken, the whole set would pass
        `HIGH_WATER` of the limit."""
        count, limit = map_count(), map_limit()
        if None in (count, limit, maps_before) or done == 0:
            return
        high_water = limit * HIGH_WATER
        per_shape = max(count - maps_before, 0) / done
        projected = maps_before + per_shape * total
        if projected < high_water:
            return
        fits = max(int((high_water - maps_before) / per_shape), 0) if per_shape else total
        raise ValidationError(
            "shape_set_too_large",
            f"the shape set's {total} executables would take about {projected:,.0f} memory "
            f"maps (~{per_shape:.0f} each, measured on the first {done}), past "
            f"{HIGH_WATER:.0%} of the {limit:,} this process may hold "
            f"(vm.max_map_count): about {fits} fit. Narrow the limits, warm one backend, or "
            "raise the OS limit (sysctl -w vm.max_map_count=1048576); see "
            "docs/serving.md#compiled-shapes",
            "limits",
        )


_guard: Guard | None = None
_guard_lock = threading.Lock()


def guard() -> Guard:
    """The process's one `Guard` (executables and maps are process-wide)."""
    global _guard
    with _guard_lock:
        if _guard is None:
            _guard = Guard()
        return _guard
