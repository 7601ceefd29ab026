"""`EngineView`: what a facade over an `Engine` shows of it, read from its `engine` attribute
(the model's config and weights, the tokenizer, the backends, the bounds), so that the facade
(`tpuscore.Scorer`) holds only its calls."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import TYPE_CHECKING

from tpuscore.backends import registry

if TYPE_CHECKING:
    from tpuscore.engine.runner import Engine


def _engine_attribute(path: str, doc: str, convert: Callable = lambda x: x) -> property:
    """A read-only attribute of the engine at dotted `path` (as `convert` gives it)."""
    return property(lambda self: convert(operator.attrgetter(path)(self.engine)), doc=doc)


class EngineView:
    """The engine's attributes, on an object holding it as `engine`."""

    engine: Engine

    config = _engine_attribute("model.config", "The model's `ModelConfig`.")
    params = _engine_attribute("model.weights", "The parameters on device.")
    dtype = _engine_attribute("model.dtype", "Attention's and K/V's dtype.")
    mesh = _engine_attribute("model.layout.mesh", "The mesh, or None.")
    tokenizer = _engine_attribute("tokenizer", "The tokenizer, or None.")
    backends = _engine_attribute("backends", "The `BackendPool`.")
    cost_model = _engine_attribute("cost_model", "auto's `CostModel`.")
    model_name = _engine_attribute("model_name", "What a server reports and requests name.")
    score_calibration = property(  # settable: another calibration (or path) for the same model
        lambda self: self.engine.score_calibration,
        lambda self, fitted: setattr(self.engine, "score_calibration", fitted),
        doc="A `Calibration` (docs/calibration.md), or None; set one, a path or None.",
    )
    adapters = _engine_attribute("model.adapter_names", "LoRA adapters, in load order.", list)
    limits = _engine_attribute("limits", "How large one request may be (`RequestLimits`).")

    def get_backend(self, name: str) -> registry.Backend:
        """The scorer's backend `name`, built on first use."""
        return self.engine.backends.get(name)
