"""tpuscore: score candidate items with a decoder-only LLM in JAX.

>>> scorer = Scorer.from_pretrained()  # the embedded SmolLM2-135M-Instruct
>>> result = scorer.score("The capital of France is", [""], labels=[" Paris", " London"])
>>> result.logprobs  # [n_items, n_labels]: log P(label | query + item)
"""

from tpuscore import backends, templates
from tpuscore.errors import ValidationError
from tpuscore.loglikelihood import LoglikelihoodResult
from tpuscore.models.config import ModelConfig, UnsupportedModelError
from tpuscore.models.default import DefaultModelMissingError
from tpuscore.models.weights import CheckpointMismatchError
from tpuscore.ranking import RankedItem
from tpuscore.results import ScoreResult
from tpuscore.scorer import Scorer
from tpuscore.templates import Template

__all__ = [
    "CheckpointMismatchError",
    "DefaultModelMissingError",
    "LoglikelihoodResult",
    "ModelConfig",
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
