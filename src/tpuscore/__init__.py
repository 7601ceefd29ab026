"""tpuscore: score candidate items with a decoder-only LLM in JAX.

>>> scorer = Scorer.from_pretrained()  # the embedded SmolLM2-135M-Instruct
>>> result = scorer.score("The capital of France is", [""], labels=[" Paris", " London"])
>>> result.logprobs  # [n_items, n_labels]: log P(label | query + item)
"""

from tpuscore import backends
from tpuscore.api import templates
from tpuscore.api.errors import ValidationError
from tpuscore.api.results import ScoreResult
from tpuscore.api.templates import Template
from tpuscore.models.config import ModelConfig, UnsupportedModelError
from tpuscore.models.loaders.default import DefaultModelMissingError
from tpuscore.models.weights import CheckpointMismatchError
from tpuscore.scorer import Scorer
from tpuscore.serving.batcher import Batcher, Overloaded
from tpuscore.tasks.loglikelihood import LoglikelihoodResult
from tpuscore.tasks.ranking import RankedItem

__all__ = [
    "Batcher",
    "CheckpointMismatchError",
    "DefaultModelMissingError",
    "LoglikelihoodResult",
    "ModelConfig",
    "Overloaded",
    "RankedItem",
    "ScoreResult",
    "Scorer",
    "Template",
    "UnsupportedModelError",
    "ValidationError",
    "backends",
    "templates",
]
__version__ = "0.1.0"
