"""Backends by name: each name maps to a factory `factory(config, params, **options) -> Backend`.

A backend whose class sets `supports_item_first = False` is never handed an item_first batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from tpuscore.batching import BackendOutput, ScoreBatch

AUTO = "auto"


class Backend(Protocol):
    """Scores a validated, bucket-padded batch. Never validates input or post-processes scores."""

    def score(self, batch: ScoreBatch) -> BackendOutput: ...


BackendFactory = Callable[..., Backend]

_FACTORIES: dict[str, BackendFactory] = {}


def register(name: str, factory: BackendFactory) -> None:
    """Make `factory` selectable as `backend=name`; registering a name again replaces it."""
    if not isinstance(name, str) or not name or name == AUTO:
        raise ValueError(
            f"backend name must be a non-empty string other than {AUTO!r}, got {name!r}"
        )
    if not callable(factory):
        raise TypeError(f"factory for backend {name!r} must be callable, got {factory!r}")
    _FACTORIES[name] = factory


def available() -> list[str]:
    """Registered backend names, sorted."""
    return sorted(_FACTORIES)


def factory(name: str) -> BackendFactory:
    return _FACTORIES[name]


def select(batch: ScoreBatch) -> str:
    """The backend "auto" runs for this batch: prefill_extend whenever the query comes first (it
    runs the query once, not once per item), else serial."""
    return "serial" if batch.item_first else "prefill_extend"
