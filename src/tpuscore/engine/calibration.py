"""Score calibration at the engine: the model's fingerprint, loading a calibration fitted for
it, and attaching `calibrated` to the results `Engine.run` returns. The math is
`tpuscore.api.calibration`'s; fitting one (scoring labelled examples) is `tasks/calibrated.py`'s."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import attrs

from tpuscore.api import calibration
from tpuscore.api.calibration import Calibration
from tpuscore.api.errors import ValidationError
from tpuscore.api.messages import short
from tpuscore.api.requests import ScoreRequest
from tpuscore.api.results import ScoreResult
from tpuscore.models.model import Model
from tpuscore.parallel.sharding import to_host

# The weights a fingerprint reads: every checkpoint has the first two and they differ between
# fine-tunes of one base (a head, where there is one, is what a classifier fine-tune changes).
FINGERPRINT_WEIGHTS = ("embed", "final_norm", "lm_head", "score")


def model_fingerprint(model: Model) -> str:
    """The model's identity, as `calibration.fingerprint` computes it."""
    weights = model.weights
    arrays = [to_host(weights[name]) for name in FINGERPRINT_WEIGHTS if name in weights]
    return calibration.fingerprint(dataclasses.asdict(model.config), arrays)


def load(value: Calibration | str | os.PathLike | None, model: Model) -> Calibration | None:
    """The calibration `value` is (a loaded `Calibration`) or names (a file's path; None: none),
    refused (`CalibrationMismatch`) if fitted for another model. Anything else is
    `invalid_calibration`: `scorer.score_calibration = ...` takes what `score_calibration=`
    takes, and is checked as it is (an unchecked one applied another model's fit silently)."""
    if value is None:
        return None
    if isinstance(value, Calibration):
        loaded = value
    elif isinstance(value, (str, os.PathLike)):
        loaded = Calibration.load(value)
    else:
        raise ValidationError(
            "invalid_calibration",
            f"score_calibration must be a calibration file's path or a Calibration, got "
            f"{short(value)}",
            "score_calibration",
        )
    loaded.check(model=model_fingerprint(model), template=loaded.template)
    return loaded


def attach(
    fitted: Calibration | None, requests: Sequence[ScoreRequest], results: list[ScoreResult]
) -> list[ScoreResult]:
    """The results with `calibrated` set where the calibration covers the request's labels and
    its model: the base model's requests, not a LoRA adapter's (an adapter is another model,
    whose scores the base's fit does not describe)."""
    if fitted is None:
        return results
    return [
        attrs.evolve(result, calibrated=fitted.probabilities(result.logprobs))
        if fitted.covers(request.label_ids, request.classification)
        and request.adapter == 0
        and len(result.logprobs)
        else result
        for request, result in zip(requests, results, strict=True)
    ]
