"""tpuscore: score candidate items with a decoder-only LLM in JAX.

>>> scorer = Scorer.from_pretrained()  # the embedded SmolLM2-135M-Instruct
>>> result = scorer.score("The capital of France is", [""], labels=[" Paris", " London"])
>>> result.logprobs  # [n_items, n_labels]: log P(label | query + item)

The public names load on first use (PEP 562), so `import tpuscore.api` alone loads no backend,
kernel or model.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public name -> the module that defines it (a module itself when the name is a subpackage).
_EXPORTS = {
    "Batcher": "tpuscore.serving.batcher",
    "CheckpointMismatchError": "tpuscore.models.weights",
    "DeadlineExceeded": "tpuscore.serving.batcher",
    "DefaultModelMissingError": "tpuscore.models.loaders.default",
    "LoglikelihoodResult": "tpuscore.tasks.loglikelihood",
    "ModelConfig": "tpuscore.models.config",
    "Overloaded": "tpuscore.serving.admission",
    "PrecisionError": "tpuscore.models.model",
    "RankedItem": "tpuscore.tasks.ranking",
    "ScoreOptions": "tpuscore.api.requests",
    "ScoreResult": "tpuscore.api.results",
    "Scorer": "tpuscore.scorer",
    "Template": "tpuscore.api.templates",
    "UnsupportedModelError": "tpuscore.models.config",
    "ValidationError": "tpuscore.api.errors",
    "backends": "tpuscore.backends",
    "templates": "tpuscore.api.templates",
}
_MODULES = {"backends", "templates"}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tpuscore' has no attribute {name!r}")
    value = importlib.import_module(module)
    if name not in _MODULES:
        value = getattr(value, name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return [*__all__, "__version__"]


if TYPE_CHECKING:  # the names for type checkers and editors
    from tpuscore import backends as backends
    from tpuscore.api import templates as templates
    from tpuscore.api.errors import ValidationError as ValidationError
    from tpuscore.api.requests import ScoreOptions as ScoreOptions
    from tpuscore.api.results import ScoreResult as ScoreResult
    from tpuscore.api.templates import Template as Template
    from tpuscore.models.config import ModelConfig as ModelConfig
    from tpuscore.models.config import UnsupportedModelError as UnsupportedModelError
    from tpuscore.models.loaders.default import DefaultModelMissingError as DefaultModelMissingError
    from tpuscore.models.model import PrecisionError as PrecisionError
    from tpuscore.models.weights import CheckpointMismatchError as CheckpointMismatchError
    from tpuscore.scorer import Scorer as Scorer
    from tpuscore.serving.admission import Overloaded as Overloaded
    from tpuscore.serving.batcher import Batcher as Batcher
    from tpuscore.serving.batcher import DeadlineExceeded as DeadlineExceeded
    from tpuscore.tasks.loglikelihood import LoglikelihoodResult as LoglikelihoodResult
    from tpuscore.tasks.ranking import RankedItem as RankedItem
