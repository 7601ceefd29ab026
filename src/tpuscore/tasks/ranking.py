"""Ranking: items sorted by the positive label's probability within the labels.

`Scorer.rank` follows sentence-transformers' `CrossEncoder.rank`: it returns every item (or the
`top_k` best) sorted by score, highest first, each with its index in the input and the input item
itself. The score of an item is P(positive | query + item) / sum of P(label | query + item) over
the labels: for a yes/no pair, P(yes) / (P(yes) + P(no)), as Qwen3-Reranker and the Cohere/Jina
rerank servers compute it. On a classification model, `positive` indexes its classes and the
score is that class's probability: the softmax over the classes, or the sigmoid of a single
logit (one-logit rerankers and reward models); by default the relevant class, the last
(`relevant_class`), as the server's rerank endpoints rank. A template on a classification model
renders the text and supplies the item suffix; the model's classes stand in for its labels.
Equal scores keep their input order (a stable sort), so a ranking is reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from typing import Any

import attrs
import numpy as np

from tpuscore.api import templates
from tpuscore.api.argument_checks import listed
from tpuscore.api.errors import ValidationError
from tpuscore.api.requests import ScoreOptions, ScoreRequest
from tpuscore.api.results import ScoreResult
from tpuscore.api.validation import check_text
from tpuscore.engine import progress
from tpuscore.engine.runner import Engine

# With a progress bar, rank scores its items in pages of this many, one backend call each, so
# the bar moves; prefill_extend's prefix cache serves the query to every page after the first.
PROGRESS_PAGE_ITEMS = 256


@attrs.frozen
class RankedItem:
    """One ranked item: its position in the input, its score and the item as given."""

    index: int
    score: float
    item: str | list[int]


def relevant_class(num_classes: int) -> int:
    """The class a classification model ranks by: the only one of a one-logit reranker, else
    the last (LABEL_1 of a binary relevance classifier)."""
    return max(num_classes - 1, 0)


def default_positive(num_labels: int, classification: bool) -> int:
    """`positive` when none is given: the first label (a template's positive is its first), or
    a classification model's `relevant_class`."""
    return relevant_class(num_labels) if classification else 0


def _check_index(value: Any, param: str, *, minimum: int, below: int | None = None) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Integral):
        raise ValidationError("invalid_argument", f"{param} must be an int, got {value!r}", param)
    value = int(value)
    if value < minimum or (below is not None and value >= below):
        limit = f">= {minimum}" if below is None else f"in [{minimum}, {below})"
        raise ValidationError("invalid_argument", f"{param} must be {limit}, got {value}", param)
    return value


def _check_rank(
    num_labels: int, positive: Any, top_k: Any, classification: bool = False
) -> tuple[int, int | None]:
    if positive is None:
        positive = default_positive(num_labels, classification)
    if num_labels < 2 and not classification:
        raise ValidationError(
            "invalid_argument",
            f"ranking needs at least two labels, got {num_labels}: the positive label's "
            "probability within a single label is always 1",
            "labels",
        )
    positive = _check_index(positive, "positive", minimum=0, below=num_labels)
    if top_k is not None:
        top_k = _check_index(top_k, "top_k", minimum=1)
    return positive, top_k


def rank_result(
    result: ScoreResult,
    items: Sequence[str | list[int]],
    *,
    positive: int | None = None,
    top_k: int | None = None,
) -> list[RankedItem]:
    """Rank scored items: the positive label's probability within the labels, highest first.

    Args:
        result: `score`'s result for `items` (any `apply_softmax`: the score is recomputed from
            `result.label_probs`).
        items: the items as given to `score`, returned in each `RankedItem`.
        positive: the index of the positive label in the labels (None: `default_positive`).
        top_k: keep the best top_k items (all when None or when there are fewer).

    Raises:
        ValidationError: `invalid_argument` for a positive index outside the labels, fewer than
            two labels (the probability within one label is always 1), or a top_k that is not
            a positive int.
        ValueError: items and result of different lengths (a caller's bug, not bad input).
    """
    num_items, num_labels = result.logprobs.shape
    if len(items) != num_items:
        raise ValueError(f"{len(items)} items but the result scores {num_items}")
    positive, top_k = _check_rank(num_labels, positive, top_k, result.classification)
    scores = result.label_probs[:, positive]
    order = np.argsort(-scores, kind="stable")[:top_k]
    return [RankedItem(int(i), float(scores[i]), items[i]) for i in order]


def rank(
    engine: Engine,
    query: Any,
    items: Any,
    options: ScoreOptions,
    *,
    positive: Any = None,
    top_k: Any = None,
    template: str | templates.Template | None = None,
    instruction: Any = None,
    backend: str | None = None,
    show_progress: bool = False,
) -> list[RankedItem]:
    """`Scorer.rank`: score the items (through a template if given), then `rank_result`."""
    items = listed(items)
    query_text, item_texts = query, items
    if template is not None:
        tmpl = template if isinstance(template, templates.Template) else templates.get(template)
        for name in ("labels", "label_token_ids", "item_suffix"):
            if getattr(options, name) is not None:
                what = "item suffix" if name == "item_suffix" else f"labels {list(tmpl.labels)}"
                raise ValidationError(
                    "invalid_argument",
                    f"template {tmpl.name!r} supplies the {what}; do not also give {name}",
                    name,
                )
        query_text, item_texts = _render(tmpl, query, items, instruction)
        # A classification model scores its own classes: the template's labels do not apply.
        labels = None if engine.facts.num_classes else list(tmpl.labels)
        options = attrs.evolve(options, labels=labels, item_suffix=tmpl.item_suffix)
    elif instruction is not None:
        raise ValidationError(
            "invalid_argument", "instruction is only used with a template", "instruction"
        )
    request = engine.prepare(query_text, item_texts, options)
    # Checked before the model runs, not after.
    _check_rank(len(request.label_ids), positive, top_k, request.classification)
    result = _score(engine, request, backend, show_progress)
    return rank_result(result, list(items), positive=positive, top_k=top_k)


def _render(
    template: templates.Template, query: Any, items: Any, instruction: Any
) -> tuple[str, list[str]]:
    """The template's query and item texts; a template renders text only."""
    if not isinstance(query, str):
        raise ValidationError(
            "invalid_query", f"a template renders text: query must be a str, got {query!r}", "query"
        )
    if isinstance(items, str) or not isinstance(items, Sequence):
        raise ValidationError(
            "invalid_items", f"items must be a list of str, got {items!r}", "items"
        )
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise ValidationError(
                "invalid_items",
                f"a template renders text: items[{i}] must be a str, got {item!r}",
                f"items[{i}]",
            )
    if instruction is not None:
        if not isinstance(instruction, str):
            raise ValidationError(
                "invalid_argument",
                f"instruction must be a str, got {instruction!r}",
                "instruction",
            )
        check_text(instruction, "instruction")
    return template.render_query(query, instruction), [template.render_item(it) for it in items]


def _score(
    engine: Engine, request: ScoreRequest, backend: str | None, show_progress: bool
) -> ScoreResult:
    """The request's result; with a progress bar, page by page so the bar moves."""
    if not show_progress:
        return engine.run([request], backend=backend)[0]
    pages = [
        attrs.evolve(request, items=request.items[start : start + PROGRESS_PAGE_ITEMS])
        for start in range(0, len(request.items), PROGRESS_PAGE_ITEMS)
    ]
    results = []
    with progress.bar(len(request.items), "item", enabled=True) as advance:
        for page in pages:
            results.extend(engine.run([page], backend=backend))
            advance(len(page.items))
    if not results:
        return ScoreResult.empty(
            len(request.label_ids), request.apply_softmax, request.classification
        )
    return ScoreResult.concat(results)
