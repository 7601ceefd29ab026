"""Chunked documents over the engine: every chunk of every document is an item of ONE request
against the shared query, so the query runs once for all of them; each document's score is its
chunks' aggregate (`tpuscore.api.chunking`, docs/chunking.md).

A text document is tokenized on its own (as an item is) and cut on token boundaries; a chunk is
the text between them: from the end of the token before its first to the end of its last, so a
space that opens a word stays with the word. Re-encoded on its own a chunk gives the document's
tokens there wherever the tokenizer's pre-tokenizer splits at that boundary, as byte-level BPE
does at word starts; a boundary inside a character of several tokens leaves the whole character
to the chunk before. A token-id document is cut as it is.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import tokenizers

from tpuscore.api import bounds, templates, validation
from tpuscore.api.argument_checks import check_truncation, is_token_list, listed
from tpuscore.api.chunking import Chunking
from tpuscore.api.errors import ValidationError
from tpuscore.api.requests import RequestLimits, ScoreOptions, ScoreRequest
from tpuscore.api.results import ScoreResult
from tpuscore.engine.runner import Engine
from tpuscore.tasks import ranking


@attrs.frozen
class Chunks:
    """Documents cut into chunks: items (text or token ids) in document order, each chunk's
    document, and its [start, end) token span within the document."""

    items: list[str] | list[list[int]]
    document: np.ndarray  # int [chunks]
    spans: list[tuple[int, int]]
    num_documents: int


def split(
    tokenizer: tokenizers.Tokenizer | None,
    documents: Any,
    chunking: Chunking,
    param: str = "items",
    *,
    limits: RequestLimits,
    num_labels: int = 0,
    holder: str = validation.SCORER_BOUNDS,
) -> Chunks:
    """Cut every document (all text or all token ids) by `chunking`; more chunks than `limits`
    takes items (or, with num_labels, answers scores) are refused before any is built (a
    one-token window over a long text would build one piece per token)."""
    documents = listed(documents)
    if isinstance(documents, str) or not isinstance(documents, Sequence):
        raise ValidationError("invalid_items", f"{param} must be a list, got {documents!r}", param)
    items: list[Any] = []
    owners: list[int] = []
    spans: list[tuple[int, int]] = []
    texts = [d for d in documents if isinstance(d, str)]
    if texts and tokenizer is None:
        raise ValidationError("invalid_items", "this model has no tokenizer: give token ids", param)
    encodings = iter(tokenizer.encode_batch(texts, add_special_tokens=False) if texts else [])
    cutters = []
    for d, document in enumerate(documents):
        if isinstance(document, str):
            offsets = next(encodings).offsets
            ends = [0] + [end for _, end in offsets[:-1]] + [len(document)]

            def piece(start: int, end: int, doc=document, ends=ends) -> str:
                return doc[ends[start] : ends[end]]

            n = len(offsets)
        elif is_token_list(document):  # as an unchunked item: bytes or a range is not one
            n = len(document)
            ids = document.tolist() if isinstance(document, np.ndarray) else document

            def piece(start: int, end: int, doc=ids) -> list[int]:
                return list(doc[start:end])
        else:
            raise ValidationError(
                "invalid_items", f"{param}[{d}] must be text or token ids", f"{param}[{d}]"
            )
        cutters.append((n, piece))
    total = sum(chunking.count(n) for n, _ in cutters)
    bounds.check_chunks(limits, total, num_labels, holder, param)
    for d, (n, piece) in enumerate(cutters):
        for span in chunking.spans(n):
            items.append(piece(*span))
            owners.append(d)
            spans.append(span)
    return Chunks(items, np.asarray(owners, np.int64), spans, len(documents))


def _plan(chunking: Any, options: ScoreOptions) -> Chunking:
    """The request's `Chunking`, its max_item_tokens checked against the window."""
    plan = Chunking.of(chunking)
    check_truncation(options.max_item_tokens, options.truncate)
    plan.check_cap(options.max_item_tokens)
    return plan


def located(error: ValidationError, chunks: Chunks) -> ValidationError:
    """An error about chunk k of the request (param "items[k]...") as one about its document."""
    match = re.fullmatch(r"items\[(\d+)\](.*)", error.param or "")
    if match is None:
        return error
    k = int(match[1])
    d = int(chunks.document[k])
    first = int(np.searchsorted(chunks.document, d))
    message = f"{error} (chunk {k - first}, tokens {list(chunks.spans[k])} of items[{d}])"
    return ValidationError(error.code, message, f"items[{d}]{match[2]}")


@attrs.frozen
class ChunkedResult:
    """A chunked score: per document its score, its best chunk and its chunks'.

    Attributes:
        scores: the documents' aggregated scores, float64 [documents].
        best_chunk: each document's best-scoring chunk, an index among its own chunks.
        best_span: that chunk's [start, end) tokens in the document.
        chunk_scores: each document's chunks' scores, float64 [its chunks].
        chunks: the `ScoreResult` of every chunk, documents' chunks in order [chunks, labels]
            (None from `rank`, which keeps only the scores).
        document: the document of each chunk, int [chunks]; spans: each chunk's token span.
    """

    scores: np.ndarray
    best_chunk: np.ndarray
    best_span: list[tuple[int, int]]
    chunk_scores: list[np.ndarray]
    chunks: ScoreResult | None
    document: np.ndarray
    spans: list[tuple[int, int]]


def aggregate(
    chunks: Chunks, relevance: np.ndarray, chunking: Chunking, result: ScoreResult | None = None
) -> ChunkedResult:
    """The `ChunkedResult` of the chunks' scores [chunks] (and their `ScoreResult`)."""
    per_doc = [relevance[chunks.document == d] for d in range(chunks.num_documents)]
    reduced = [chunking.reduce(s) for s in per_doc]
    first = np.searchsorted(chunks.document, np.arange(chunks.num_documents))
    best = np.array([b for _, b in reduced], np.int64)
    return ChunkedResult(
        scores=np.array([s for s, _ in reduced], np.float64),
        best_chunk=best,
        best_span=[chunks.spans[f + b] for f, b in zip(first, best, strict=True)],
        chunk_scores=per_doc,
        chunks=result,
        document=chunks.document,
        spans=chunks.spans,
    )


def positive_label(request: ScoreRequest, positive: Any = None) -> int:
    """The positive label's index, checked as `rank` checks it (at least two labels)."""
    num_labels = len(request.label_ids)
    return ranking._check_rank(num_labels, positive, None, request.classification)[0]


def score(
    engine: Engine,
    query: Any,
    items: Any,
    chunking: Any,
    options: ScoreOptions,
    *,
    positive: Any = None,
    backend: str | None = None,
) -> ChunkedResult:
    """`Scorer.score(..., chunking=)`: every chunk an item of one request; the chunks' result
    carries `calibrated` per chunk under the engine's calibration (as an item's would; the
    documents' aggregated scores are not calibrated)."""
    prepared = prepare_items(engine, query, items, chunking, options, positive=positive)
    return prepared.documents(engine.run([prepared.request], backend=backend)[0])


@attrs.frozen
class ChunkedRequest:
    """A request whose items are its documents' chunks, prepared, and how to read its result
    back as the documents'."""

    request: ScoreRequest
    chunks: Chunks
    chunking: Chunking
    positive: int

    def documents(self, result: ScoreResult) -> ChunkedResult:
        """The chunks' result as the documents': a chunk's score is rank's, the positive
        label's probability within the labels (a classification model's class probability)."""
        relevance = result.label_probs[:, self.positive].astype(np.float64)
        return aggregate(self.chunks, relevance, self.chunking, result)


def prepare_chunks(
    engine: Engine,
    query: Any,
    items: Any,
    chunking: Any,
    options: ScoreOptions,
    prepare: Callable[[list[Any]], ScoreRequest],
    positive: Any = None,
) -> ChunkedRequest:
    """The documents' size checked before any is tokenized, their chunks cut (their count
    checked before any is built) and prepared by `prepare` as the request's items, an error in
    a chunk located at its document; at least two labels for a causal LM, as `rank` needs."""
    plan = _plan(chunking, options)
    validation.check_request_size(query, items, options, engine.facts)
    chunks = split(engine.tokenizer, items, plan, limits=engine.limits)
    try:
        request = prepare(chunks.items)
    except ValidationError as e:
        raise located(e, chunks) from None
    return ChunkedRequest(request, chunks, plan, positive_label(request, positive))


def prepare_items(
    engine: Engine, query: Any, items: Any, chunking: Any, options: ScoreOptions, *,
    positive: Any = None,
) -> ScoreRequest | ChunkedRequest:  # fmt: skip
    """`Scorer.prepare`: the request, or where `chunking` is given its items' chunks prepared
    as `score(chunking=)` prepares them (a `ChunkedRequest` ranking by label `positive`)."""
    if chunking is None:
        return engine.prepare(query, items, options)
    return prepare_chunks(
        engine, query, items, chunking, options,
        lambda chunk_items: engine.prepare(query, chunk_items, options), positive,
    )  # fmt: skip


@attrs.frozen
class RankedDocument:
    """One ranked document: `RankedItem`'s fields, its best chunk and that chunk's span."""

    index: int
    score: float
    item: str | list[int]
    best_chunk: int
    best_span: tuple[int, int]


def rank_documents(
    chunked: ChunkedResult, items: Sequence[Any], top_k: int | None = None
) -> list[RankedDocument]:
    """Documents by aggregated score, best first, ties in input order."""
    order = np.argsort(-chunked.scores, kind="stable")[:top_k]
    return [
        RankedDocument(
            int(i),
            float(chunked.scores[i]),
            items[i],
            int(chunked.best_chunk[i]),
            chunked.best_span[i],
        )
        for i in order
    ]


def rank(
    engine: Engine,
    query: Any,
    items: Any,
    chunking: Any,
    options: ScoreOptions,
    *,
    positive: Any = None,
    top_k: Any = None,
    template: str | templates.Template | None = None,
    instruction: Any = None,
    backend: str | None = None,
) -> list[RankedDocument]:
    """`Scorer.rank(..., chunking=)`: the chunks ranked as `Scorer.rank` ranks items (the
    template renders each chunk as a document), in one request; then the documents."""
    chunking = _plan(chunking, options)
    if top_k is not None:
        top_k = ranking._check_index(top_k, "top_k", minimum=1)
    validation.check_request_size(query, items, options, engine.facts)  # before tokenizing
    chunks = split(engine.tokenizer, items, chunking, limits=engine.limits)
    try:
        ranked = ranking.rank(
            engine, query, chunks.items, options, positive=positive, template=template,
            instruction=instruction, backend=backend,
        )  # fmt: skip
    except ValidationError as e:
        raise located(e, chunks) from None
    relevance = np.empty(len(chunks.items))
    for r in ranked:
        relevance[r.index] = r.score
    return rank_documents(aggregate(chunks, relevance, chunking), list(items), top_k)


def rank_items(
    engine: Engine, query: Any, items: Any, chunking: Any, options: ScoreOptions, *,
    show_progress: bool = False, **rank_options: Any,
) -> list[ranking.RankedItem] | list[RankedDocument]:  # fmt: skip
    """`Scorer.rank`: the items ranked whole (`ranking.rank`), or by their chunks (`rank`)
    where `chunking` is given."""
    if chunking is None:
        return ranking.rank(
            engine, query, items, options, show_progress=show_progress, **rank_options
        )
    return rank(engine, query, items, chunking, options, **rank_options)
