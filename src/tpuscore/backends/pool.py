"""A scorer's backend instances: built on first use from their registration and options."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from typing import Any

from tpuscore.backends import registry
from tpuscore.models.model import Model


class BackendPool:
    """One instance per backend name for one model. Options are validated when the pool is built,
    so a bad option fails at construction, not mid-request. batch_invariant: build every
    instance in that mode (its options' `batch_invariant` field set, where it has one).
    Thread-safe."""

    def __init__(
        self,
        model: Model,
        options: Mapping[str, Mapping[str, Any]] | None,
        batch_invariant: bool = False,
    ):
        self.model = model
        self.batch_invariant = batch_invariant
        options = options or {}
        self._options = {name: registry.backend_options(name, options[name]) for name in options}
        self._instances: dict[str, registry.Backend] = {}
        self._lock = threading.Lock()

    def fresh(self) -> BackendPool:
        """A pool of new instances (own caches and state) on the same model and options."""
        pool = BackendPool(self.model, None, self.batch_invariant)
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
                self._instances[name] = backend
            return self._instances[name]


def _has_field(options: Any, name: str) -> bool:
    return dataclasses.is_dataclass(options) and any(
        f.name == name for f in dataclasses.fields(options)
    )
