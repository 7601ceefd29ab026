"""Fitting a score calibration: scoring labelled examples over the engine (the fit's math is
`tpuscore.api.calibration`'s; loading one and attaching `calibrated` to results are
`engine/calibration.py`'s)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from tpuscore.api import templates
from tpuscore.api.requests import ScoreOptions, ScoreRequest
from tpuscore.engine.runner import Engine


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
