"""tpuscore: score candidate items with a decoder-only LLM in JAX.

>>> scorer = Scorer.from_pretrained()  # the embedded SmolLM2-135M-Instruct
>>> result = scorer.score("The capital of France is", [""], labels=[" Paris", " London"])
>>> result.logprobs  # [n_items, n_labels]: log P(label | query + item)
"""

from tpuscore import backends
from tpuscore.errors import ValidationError
from tpuscore.models.config import ModelConfig, UnsupportedModelError
from tpuscore.models.default import DefaultModelMissingError
from tpuscore.models.weights import CheckpointMismatchError
from tpuscore.results import ScoreResult
from tpuscore.scorer import Scorer

__all__ = [
    "CheckpointMismatchError",
    "DefaultModelMissingError",
    "ModelConfig",
    "ScoreResult",
    "Scorer",
    "UnsupportedModelError",
    "ValidationError",
    "backends",
]
__version__ = "0.1.0"
