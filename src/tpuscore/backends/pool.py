"""A scorer's backend instances: built on first use from their registration and options."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tpuscore.backends import registry
from tpuscore.models.model import Model

if TYPE_CHECKING:  # the engine builds the guard and hands it down
    from tpuscore.engine.executables import Guard


class BackendPool:
    """One instance per backend name for one model. Options are validated when the pool is built,
    so a bad option fails at construction, not mid-request. batch_invariant: build every
    instance in that mode (its options' `batch_invariant` field set, where it has one).
    executables_guard: the scorer's `engine.executables.Guard`: each instance runs the guard's
    copies of its jitted steps (`Guard.own`); None, the steps as their classes hold them,
    shared with every pool without a guard. Thread-safe."""

    def __init__(
        self,
        model: Model,
        options: Mapping[str, Mapping[str, Any]] | None,
        batch_invariant: bool = False,
        executables_guard: Guard | None = None,
    ):
        self.model = model
        self.guard = executables_guard
        self.batch_invariant = batch_invariant
        options = options or {}
        self._options = {name: registry.backend_options(name, options[name]) for name in options}
        self._instances: dict[str, registry.Backend] = {}
        self._lock = threading.Lock()

    def fresh(self) -> BackendPool:
        """A pool of new instances (own caches and state) on the same model, options and guard:
        the executables they build are the scorer's."""
        pool = BackendPool(self.model, None, self.batch_invariant, self.guard)
        pool._options = self._options
        return pool

    def get(self, name: str) -> registry.Backend:
        with self._lock:
            if name not in self._instances:
                reg = registry.registration(registry.backend_name(name))
                options = self._options.get(name)
                if options is None and reg.options is not None:
                    options = reg.options()
                if self.batch_invariant and _has_field(options, "batch_invariant"):
                    options = dataclasses.replace(options, batch_invariant=True)
                backend = reg.factory(self.model, options)
                registry.check_protocol(name, backend)
                if self.guard is not None:
                    self.guard.own(backend)
                self._instances[name] = backend
            return self._instances[name]


def _has_field(options: Any, name: str) -> bool:
    return dataclasses.is_dataclass(options) and any(
        f.name == name for f in dataclasses.fields(options)
    )
