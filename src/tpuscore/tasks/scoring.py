"""The facade's requests, chunked or not: `Scorer.score`, `prepare`, `plan`, `run` and the
mapping doors (`prepare_request`, `prepare_batch`, `validate_batch`, `score_batch`), where a
request with `chunking` is a `ChunkedRequest` (`tasks.chunking`): its chunks run as the items of
the same engine run as every other request's, and come back as its documents' `ChunkedResult`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from tpuscore.api import validation
from tpuscore.api.errors import ValidationError
from tpuscore.api.requests import ScoreOptions, ScoreRequest
from tpuscore.api.results import ScoreResult
from tpuscore.engine import progress, selection
from tpuscore.engine.runner import Engine
from tpuscore.tasks.chunking import ChunkedRequest, ChunkedResult, prepare_chunks, prepare_items


def score_items(
    engine: Engine, query: Any, items: Any, chunking: Any, options: ScoreOptions, *,
    backend: str | None = None,
) -> ScoreResult | ChunkedResult:  # fmt: skip
    """`Scorer.score`: the items scored whole, or by their chunks where `chunking` is given."""
    prepared = prepare_items(engine, query, items, chunking, options)
    return run(engine, [prepared], backend=backend)[0]


def plan_items(
    engine: Engine, query: Any, items: Any, chunking: Any, options: ScoreOptions
) -> selection.Plan:
    """`Scorer.plan`: every backend's estimate for the request, or for that of its chunks."""
    prepared = prepare_items(engine, query, items, chunking, options)
    return engine.plan(prepared.request if isinstance(prepared, ChunkedRequest) else prepared)


def score_batch(
    engine: Engine, requests: Any, *, backend: str | None = None, show_progress: bool = False
) -> list[ScoreResult | ChunkedResult]:
    """`Scorer.score_batch`: one result per request, all checked first and run together; a
    request with `chunking` scores its items as documents by their chunks, as `score(chunking=)`
    does (its result a `ChunkedResult`), its chunks items of the same run as every request's."""
    prepared = prepare_batch(engine, requests, backend, "raise")
    with progress.bar(len(prepared), "request", enabled=show_progress) as advance:
        return run(engine, prepared, backend=backend, on_progress=advance)


def validate_batch(
    engine: Engine, requests: Any, backend: str | None = None
) -> list[ValidationError | None]:
    """`Scorer.validate_batch`: per request, its located error, or None where `score_batch`
    takes it (`chunking` included)."""
    prepared = prepare_batch(engine, requests, backend, "return")
    return [p if isinstance(p, ValidationError) else None for p in prepared]


def prepare_batch(engine: Engine, requests: Any, backend: str | None, errors: str) -> list[Any]:
    """`Scorer.prepare_batch`: `Engine.prepare_batch` of the requests, each by `prepare_request`."""
    return engine.prepare_batch(requests, backend, errors, prepare=partial(prepare_request, engine))


def prepare_request(
    engine: Engine, request: Any, backend: str | None = None
) -> ScoreRequest | ChunkedRequest:
    """`Scorer.prepare_request`: one request (a mapping of `score`'s arguments) prepared, or
    with `chunking` its chunks prepared as a `ChunkedRequest`, which `run` reads back as its
    documents' `ChunkedResult`."""
    if not isinstance(request, Mapping) or "chunking" not in request:
        return engine.prepare_request(request, backend)
    rest = {k: v for k, v in request.items() if k != "chunking"}
    if request["chunking"] is None:
        return engine.prepare_request(rest, backend)
    return _prepare_chunked(engine, rest, request["chunking"], backend)


def run(
    engine: Engine,
    prepared: Sequence[ScoreRequest | ChunkedRequest],
    *,
    backend: str | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> list[ScoreResult | ChunkedResult]:
    """`Scorer.run`: the prepared requests in one `Engine.run`, a `ChunkedRequest` as its
    chunks, read back as its documents'."""
    if not isinstance(prepared, Sequence) or not any(
        isinstance(p, ChunkedRequest) for p in prepared
    ):
        return engine.run(prepared, backend=backend, on_progress=on_progress)  # it checks them
    runs = [p.request if isinstance(p, ChunkedRequest) else p for p in prepared]
    results = engine.run(runs, backend=backend, on_progress=on_progress)
    return [
        p.documents(result) if isinstance(p, ChunkedRequest) else result
        for p, result in zip(prepared, results, strict=True)
    ]


def _prepare_chunked(
    engine: Engine, request: Mapping[str, Any], chunking: Any, backend: str | None
) -> ChunkedRequest:
    """A `score_batch` request's chunks prepared as `score(chunking=)` prepares them, and checked
    for `backend` as any request of the batch is."""
    query, items, options = validation.request_arguments(request)
    return prepare_chunks(
        engine, query, items, chunking, options,
        lambda chunk_items: engine.prepare_request({**request, "items": chunk_items}, backend),
    )  # fmt: skip
