"""Compiled executables kept within the memory maps the OS lets a process hold.

XLA:CPU links each executable's kernels into the process as JIT code, in memory maps of their
own: about a hundred per decoder step (docs/benchmarks.md, "Executables' memory maps"). Linux caps a
process's maps at vm.max_map_count (65,530 by default), so a process holding some 550 step
executables can link no more: XLA logs "LLVM compilation error: Cannot allocate memory" and the
process dies (SIGSEGV). A service meeting many shapes, or `warmup(all=True)` over a shape set of
more than a few hundred, got there.

Each scorer holds its own `Guard` (its engine builds one, or takes one given), and the guard
holds the scorer's own copies of its backends' jitted steps (`Guard.own`): JAX caches executables
per jitted function, so a scorer's executables live in its copies and can be dropped without
touching another scorer's. `Guard.check()` runs after every engine call: when a compile happened
in the process since the last check and the process holds more than `high_water` of its limit,
the guard drops its scorer's executables (each copy's `clear_cache()`), and that scorer's later
steps compile again, or load from the persistent compilation cache. Maps are a process-wide
resource, so a scorer may drop its executables for maps another scorer took; it never drops
another's. `Guard.check_warmup()` refuses a shape set whose executables cannot all stay
(`ValidationError("shape_set_too_large")`), judged from the maps its first shapes took.
Without /proc (macOS, Windows) both do nothing.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

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


def map_count(path: str = MAPS) -> int | None:
    """Memory maps this process holds now, or None where /proc does not say."""
    try:
        with open(path, "rb") as maps:
            return maps.read().count(b"\n")
    except OSError:
        return None


def map_limit(path: str = MAX_MAP_COUNT) -> int | None:
    """vm.max_map_count, or None where /proc does not say."""
    try:
        with open(path) as limit:
            return int(limit.read())
    except (OSError, ValueError):
        return None


# Executables built in this process, compiled or loaded (`compiles`): one listener for all guards.
_compiles = 0
_counting = threading.Lock()  # compiles finish on several threads at once


def _on_event(event: str, _seconds: float, **_: object) -> None:
    global _compiles
    if event == COMPILE_EVENT:
        with _counting:
            _compiles += 1


monitoring.register_event_duration_secs_listener(_on_event)


def compiles() -> int:
    """Executables this process has built since tpuscore was imported."""
    return _compiles


def is_jitted(value: object) -> bool:
    """Whether `value` is a `jax.jit`-wrapped function (one that caches its executables)."""
    return callable(value) and hasattr(value, "clear_cache") and hasattr(value, "_fun")


class Guard:
    """Watches the process's memory maps for the executables its scorer builds (module doc).

    map_count, map_limit: what reads the maps in use and the limit (default /proc; a test gives
    its own). high_water: the share of the limit past which the executables are dropped.
    warmup_probe: shapes `check_warmup` is called after. `dropped` counts the drops."""

    def __init__(
        self,
        *,
        map_count: Callable[[], int | None] = map_count,
        map_limit: Callable[[], int | None] = map_limit,
        high_water: float = HIGH_WATER,
        warmup_probe: int = WARMUP_PROBE,
    ) -> None:
        self.map_count, self.map_limit = map_count, map_limit
        self.high_water, self.warmup_probe = high_water, warmup_probe
        self.lock = threading.Lock()  # held by `check` and while copies are made
        self.checked_at = compiles()  # the process's compiles at the last check
        self.dropped = 0
        self._copies: dict[Callable, Callable] = {}  # a jitted function -> this guard's copy

    def jit(self, jitted: Callable) -> Callable:
        """This guard's copy of a `jax.jit`-wrapped function: the same computation and static
        arguments, with executables of its own (one copy per function, so every backend
        instance of the scorer, warmup's included, shares it)."""
        with self.lock:
            copy = self._copies.get(jitted)
            if copy is None:
                copy = self._copies[jitted] = _copy(jitted)
            return copy

    def own(self, backend: object) -> None:
        """Give `backend` this guard's copies of the jitted steps its class holds (the step
        attributes it calls through the instance, `self.prefill(...)`)."""
        for name in dir(type(backend)):
            value = getattr(type(backend), name, None)
            if is_jitted(value):
                setattr(backend, name, self.jit(value))

    @property
    def held(self) -> int:
        """Executables this guard's copies hold now."""
        with self.lock:
            return sum(copy._cache_size() for copy in self._copies.values())

    def drop(self) -> None:
        """Drop every executable of this guard's copies (and nothing of any other guard)."""
        with self.lock:
            self._drop()

    def _drop(self) -> None:
        for copy in self._copies.values():
            copy.clear_cache()
        self.dropped += 1

    def check(self) -> bool:
        """Drop this guard's executables if a compile since the last check left the process
        past `high_water` of its map limit; True if it did."""
        with self.lock:
            built = compiles()
            if built == self.checked_at:
                return False  # nothing new linked: the count cannot have grown from JAX
            self.checked_at = built
            count, limit = self.map_count(), self.map_limit()
            if count is None or limit is None or count < limit * self.high_water:
                return False
            self._drop()
            logger.warning(
                "%d memory maps of the %d this process may hold (vm.max_map_count): dropped "
                "this scorer's compiled executables; its later steps compile again or load from "
                "the persistent compilation cache (docs/serving.md#compiled-shapes)",
                count, limit,
            )  # fmt: skip
            return True

    def check_warmup(self, total: int, done: int, maps_before: int | None) -> None:
        """After `done` of `total` shapes compiled from `maps_before` maps: ValidationError
        ("shape_set_too_large") if, at the maps each has taken, the whole set would pass
        `high_water` of the limit."""
        count, limit = self.map_count(), self.map_limit()
        if None in (count, limit, maps_before) or done == 0:
            return
        high_water = limit * self.high_water
        per_shape = max(count - maps_before, 0) / done
        projected = maps_before + per_shape * total
        if projected < high_water:
            return
        fits = max(int((high_water - maps_before) / per_shape), 0) if per_shape else total
        raise ValidationError(
            "shape_set_too_large",
            f"the shape set's {total} executables would take about {projected:,.0f} memory "
            f"maps (~{per_shape:.0f} each, measured on the first {done}), past "
            f"{self.high_water:.0%} of the {limit:,} this process may hold "
            f"(vm.max_map_count): about {fits} fit. Narrow the limits, warm one backend, or "
            "raise the OS limit (sysctl -w vm.max_map_count=1048576); see "
            "docs/serving.md#compiled-shapes",
            "limits",
        )


def _copy(jitted: Callable) -> Callable:
    """`jitted` wrapped anew around a function object of its own: JAX keys its executable
    caches by that object, so the copy's executables are its own to drop."""
    fun, info = jitted._fun, jitted._jit_info

    @functools.wraps(fun)
    def own(*args: Any, **kwargs: Any) -> Any:
        return fun(*args, **kwargs)

    return jax.jit(own, static_argnums=info.static_argnums, static_argnames=info.static_argnames)
