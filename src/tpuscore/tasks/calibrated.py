"""Calibrated scores over the engine: the model's fingerprint, loading a calibration for it,
scoring labelled examples to fit one, and attaching `calibrated` to results. The math is
`tpuscore.api.calibration`'s."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from tpuscore.api import calibration, templates
from tpuscore.api.calibration import Calibration
from tpuscore.api.requests import ScoreOptions, ScoreRequest
from tpuscore.api.results import ScoreResult
from tpuscore.engine.runner import Engine
from tpuscore.parallel.sharding import to_host

# The weights a fingerprint reads: every checkpoint has the first two and they differ between
# fine-tunes of one base (a head, where there is one, is what a classifier fine-tune changes).
FINGERPRINT_WEIGHTS = ("embed", "final_norm", "lm_head", "score")


def model_fingerprint(engine: Engine) -> str:
    """The engine's model's identity, as `calibration.fingerprint` computes it."""
    weights = engine.model.weights
    arrays = [to_host(weights[name]) for name in FINGERPRINT_WEIGHTS if name in weights]
    return calibration.fingerprint(dataclasses.asdict(engine.model.config), arrays)


def load(path: str | os.PathLike, engine: Engine) -> Calibration:
    """The calibration at path, refused (`CalibrationMismatch`) if fitted for another model."""
    loaded = Calibration.load(path)
    loaded.check(model=model_fingerprint(engine), template=loaded.template)
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


def score_examples(
    engine: Engine,
    queries: Sequence[str | list[int]],
    items: Sequence[str | list[int]],
    options: ScoreOptions,
    template: templates.Template | None = None,
) -> tuple[ScoreRequest, list[np.ndarray]]:
    """Score (query, item) pairs, one request per distinct query run together: (the first
    request, for its labels; logprobs [labels] per pair in order). With a template, its
    rendering, labels and suffix, as `Scorer.rank` applies them."""
    if template is not None:
        options = attrs.evolve(
            options, labels=list(template.labels), item_suffix=template.item_suffix
        )
    by_query: dict[Any, list[int]] = {}
    for i, query in enumerate(queries):
        by_query.setdefault(_key(query), []).append(i)
    requests = []
    for indexes in by_query.values():
        query, group = queries[indexes[0]], [items[i] for i in indexes]
        if template is not None:
            query, group = template.render_query(query), [template.render_item(x) for x in group]
        requests.append(engine.prepare(query, group, options))
    rows: list[np.ndarray | None] = [None] * len(queries)
    for indexes, result in zip(by_query.values(), engine.run(requests), strict=True):
        for i, row in zip(indexes, result.logprobs, strict=True):
            rows[i] = row
    return requests[0], rows


def _key(query: str | list[int]) -> Any:
    return query if isinstance(query, str) else tuple(query)
