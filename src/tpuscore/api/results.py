"""What `Scorer.score` returns, and the one way to join the results of a request's parts."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import scipy.special


def _read_only_float32(logprobs) -> np.ndarray:
    logprobs = np.array(logprobs, dtype=np.float32)
    logprobs.setflags(write=False)
    return logprobs


@attrs.frozen
class ScoreResult:
    """Scores for every item x label, or every item x class of a classification model.

    Attributes:
        logprobs: log P(label | sequence) over the full vocabulary, read-only float32
            [items, labels]. For a classification model (`classification`): the class logits
            [items, num_labels] at each sequence's last token, as transformers'
            `*ForSequenceClassification` returns them.
        backend: the backend that ran ("none" when there were no items).
        num_tokens: token positions processed, for usage accounting; a request scored with
            others that share its query gets its own item tokens plus a share of the query's.
        apply_softmax: which of `label_probs` and `probs` is `scores` (for a classification
            model: `probs` or the logits).
        classification: whether `logprobs` holds a classification head's logits.
        calibrated: P(positive) per item under the scorer's score calibration, read-only
            float32 [items]; None where none was loaded or it covers other labels
            (docs/calibration.md).
        probs, label_probs, scores: derived below.
    """

    logprobs: np.ndarray = attrs.field(converter=_read_only_float32)
    backend: str
    num_tokens: int
    apply_softmax: bool = False
    classification: bool = False
    calibrated: np.ndarray | None = attrs.field(default=None, kw_only=True)

    @classmethod
    def empty(
        cls, num_labels: int, apply_softmax: bool, classification: bool = False
    ) -> ScoreResult:
        """The result for no items: shape [0, num_labels], from no backend."""
        return cls(np.zeros((0, num_labels)), "none", 0, apply_softmax, classification)

    @classmethod
    def concat(cls, parts: Sequence[ScoreResult]) -> ScoreResult:
        """One request's result from the results of its items' consecutive parts, in order (a
        request the Batcher splits over steps, `rank`'s progress pages): the logprobs stacked,
        the tokens summed, the backends that ran joined by "+" when they differ. Every part
        must be of the same kind (labels, `apply_softmax`, `classification`): the joined result
        reads its scores as each part does."""
        if not parts:
            raise ValueError("concat needs at least one part (ScoreResult.empty for no items)")
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        kinds = {(p.logprobs.shape[1], p.apply_softmax, p.classification) for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"the parts are of different kinds (labels, softmax, head): {kinds}")
        backends = dict.fromkeys(p.backend for p in parts if p.backend != "none")
        return cls(
            np.concatenate([p.logprobs for p in parts]),
            "+".join(backends) or "none",
            sum(p.num_tokens for p in parts),
            first.apply_softmax,
            first.classification,
            calibrated=None
            if any(p.calibrated is None for p in parts)
            else np.concatenate([p.calibrated for p in parts]),
        )

    @property
    def probs(self) -> np.ndarray:
        """P(label | sequence): the model's true probabilities. For a classification model, its
        class probabilities: the softmax over the classes, or the sigmoid of a single class (as
        sentence-transformers and vLLM score single-logit rerankers)."""
        if not self.classification:
            return np.exp(self.logprobs)
        if self.logprobs.shape[1] == 1:
            return scipy.special.expit(self.logprobs)
        return scipy.special.softmax(self.logprobs, axis=1)

    @property
    def label_probs(self) -> np.ndarray:
        """Softmax over the given labels per item; rows sum to 1 (relative, not true, probs).
        For a classification model, `probs`."""
        if self.classification:
            return self.probs
        return scipy.special.softmax(self.logprobs, axis=1)

    @property
    def scores(self) -> np.ndarray:
        """SGLang /v1/score semantics: label_probs if apply_softmax else probs; for a
        classification model, probs if apply_softmax else the class logits."""
        if self.classification:
            return self.probs if self.apply_softmax else self.logprobs
        return self.label_probs if self.apply_softmax else self.probs
