"""tpuscore over HTTP: SGLang's /v1/score and the Cohere/Jina rerank API, through one Batcher.

    tpuscore serve --port 8000            # or: run(create_app(scorer), port=8000)

Endpoints (docs/serving.md has the request and response of each; `GET /openapi.json` publishes
them, `GET /docs` shows them):

- POST /v1/score and /score: SGLang's scoring request and response, or vLLM's (text_1/text_2,
  queries/documents, data_1/data_2), told apart by their fields.
- POST /tokenize and /detokenize: vLLM's, under the served model's tokenizer.
- POST /v1/rerank and /rerank: the Cohere v1 / Jina rerank shape, as vLLM serves it.
- POST /v2/rerank: Cohere's v2 rerank shape.
- GET /health, GET /v1/models, GET /metrics (Prometheus text).

The wire format is `serving/protocol.py`'s models; this module wires them to the library. A
handler is thin: FastAPI parses the body into its model, the handler calls the Batcher and
builds the response model. Errors become an error body in the endpoint's dialect
(`dialects.py`: vLLM's, SGLang's, Cohere's), in one place each: a request
that fails its model (`RequestValidationError`), one the library refuses (`ValidationError`), a
full queue (`Overloaded`: 503 with Retry-After), a request past its deadline
(`DeadlineExceeded`: 504), a client that left (`ClientDisconnected`: counted as 499, logged at
INFO, nothing sent), HTTP errors (413 over max_body_bytes, 404, 405, 400 for a foreign Host),
and a bug (500, logged; the server keeps serving). `guards.py` holds the deadline, disconnect,
Host and JSON-depth checks.

uvicorn is the reference ASGI server: one process, one event loop, so requests from many
connections are parsed concurrently and meet in the `Batcher`, which hands the model batches
from one worker. Every request goes through `Batcher.score_async`: validation runs before it is
queued (one client's bad input never fails another's request), requests that share a query run
together, and a full queue answers 503 with Retry-After instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Coroutine, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import tpuscore
from tpuscore.api import templates, tokenization, validation
from tpuscore.api.chunking import Chunking
from tpuscore.api.errors import ValidationError
from tpuscore.api.messages import short
from tpuscore.api.requests import RequestLimits
from tpuscore.scorer import Scorer
from tpuscore.serving import completions, dialects, guards, protocol, tei
from tpuscore.serving.batcher import Batcher, DeadlineExceeded, Overloaded
from tpuscore.serving.dialects import JSONResponse
from tpuscore.serving.metrics import CONTENT_TYPE, Metrics, MetricsNames
from tpuscore.tasks import chunking as chunked
from tpuscore.tasks import ranking

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MAX_BODY_BYTES = 16 << 20
DEFAULT_MAX_ITEMS = RequestLimits().max_items
# Seconds an idle keep-alive connection stays open: past the 60 s idle timeout common to load
# balancers (AWS ALB, GCP's and nginx's defaults are 60 s or less), uvicorn's 5 s is not.
DEFAULT_KEEP_ALIVE_S = 75
# A request past a size bound (`RequestLimits`) is well formed but more than this server takes.
SIZE_CODES = frozenset(
    {"too_many_items", "too_many_labels", "too_many_scores", "too_many_queries"}
    | {"input_too_long", "request_too_large"}
)
# Seconds an overloaded server asks a client to wait: a full queue drains within a few batches,
# and Retry-After counts whole seconds.
RETRY_AFTER_S = 1
# The library calls a rerank's documents `items`; its errors name them as the wire does.
RERANK_PARAMS = {"items": "documents"}


class ApiError(HTTPException):
    """An HTTP error the server raises itself, with its tpuscore code and param."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None):
        super().__init__(status, message)
        self.code, self.param = code, param


def model_name(model: str | None) -> str:
    """The name a server reports for `--model`: the default model's, a path's last part, or
    the hub id as given."""
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model)
    if path.exists():
        return path.stem if path.is_file() else path.resolve().name
    return str(model)


# -- reading a body -------------------------------------------------------------------------------


class JsonRequest(Request):
    """A request whose body is read up to the server's max_body_bytes and must be a JSON object
    (FastAPI's "custom Request class" pattern: FastAPI then reads the body from here)."""

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            limit = self.app.state.service.max_body_bytes
            declared = self.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limit:
                raise too_large(limit)
            body = bytearray()
            try:
                async for chunk in self.stream():
                    body += chunk
                    if len(body) > limit:
                        raise too_large(limit)
            except ClientDisconnect:  # mid-body
                raise guards.ClientDisconnected() from None
            self._body = bytes(body)
        return self._body

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            media_type = self.headers.get("content-type", "").split(";")[0].strip().lower()
            if media_type != "application/json":
                raise ApiError(
                    400,
                    "invalid_content_type",
                    "Content-Type must be application/json, "
                    f"got {short(media_type) if media_type else 'none'}",
                )
            body = await self.body()
            try:
                value = guards.parse_json(body)
            except ValueError as e:  # guards.JsonTooDeep too
                raise ApiError(400, "invalid_json", f"the body is not valid JSON: {e}") from None
            if not isinstance(value, dict):
                raise ApiError(
                    400,
                    "invalid_request",
                    f"the body must be a JSON object, got {type(value).__name__}",
                )
            self._json = value
        return self._json


def too_large(limit: int) -> ApiError:
    return ApiError(413, "body_too_large", f"the body is larger than {limit} bytes")


class JsonBodyRoute(APIRoute):
    """A POST endpoint: its body is read and checked as a JSON object (`JsonRequest`) before
    FastAPI parses it into the endpoint's model."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        parse_and_handle = super().get_route_handler()

        async def handle(request: Request) -> Response:
            request = JsonRequest(request.scope, request.receive)
            await request.json()
            return await parse_and_handle(request)

        return handle


# -- the endpoints --------------------------------------------------------------------------------


class Service:
    """The endpoints over one scorer and its batcher."""

    def __init__(
        self,
        scorer: Scorer,
        batcher: Batcher,
        *,
        model_name: str,
        rerank_template: str | templates.Template,
        max_body_bytes: int,
        limits: RequestLimits,
    ):
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes ({max_body_bytes}) must be >= 1")
        if isinstance(rerank_template, templates.Template):
            self.template = rerank_template
        else:
            try:
                self.template = templates.get(rerank_template)
            except ValueError as e:  # ValidationError: unknown_template
                raise ValueError(f"--rerank-template: {e}") from None
        # A classification model ranks by its own classes: the template renders the text and
        # supplies the item suffix, not the labels; the relevant class is the only one, else the
        # last (LABEL_1 of a binary classifier).
        classes = scorer.config.num_labels
        self.labels = None if classes else list(self.template.labels)
        self.positive = ranking.relevant_class(classes)
        try:  # a template whose labels are not single tokens here would fail every rerank
            t = self.template
            scorer.prepare(
                t.render_query("query"),
                [t.render_item("document")],
                labels=self.labels,
                item_suffix=t.item_suffix,
            )
        except ValidationError as e:
            raise ValueError(
                f"rerank template {t.name!r} does not fit this model: {e}; "
                "choose another --rerank-template"
            ) from None
        fitted = scorer.score_calibration
        if fitted is not None and fitted.template is not None:  # docs/calibration.md
            fitted.check(template=self.template.name)
        self.scorer, self.batcher = scorer, batcher
        self.model_name = model_name
        self.max_body_bytes, self.limits = max_body_bytes, limits
        self.num_labels = len(self.labels) if self.labels else classes
        self.metrics = Metrics(executables_guard=scorer.engine.executables)
        self.created = int(time.time())

    async def score(self, request: Request, body: protocol.ScoreRequest) -> Response:
        """SGLang's scoring: P(label | query + item) for each item and label; on a classification
        model (no label_token_ids), its class logits per item, or their softmax (sigmoid for one
        class) with apply_softmax, as SGLang scores SequenceClassification models."""
        items = [body.items] if isinstance(body.items, str) else body.items
        validation.check_size(
            self.limits,
            items=("items", items),
            values={"query": body.query, "labels": body.labels},
            num_labels=validation.label_count(body.labels, body.label_token_ids),
        )
        result = await self.scored(
            request, query=body.query, items=items, **protocol.score_options(body)
        )
        self.metrics.scored(request.url.path, len(items), result)
        response = protocol.ScoreResponse(
            scores=result.scores.tolist(),
            model=self.model_name,
            usage=protocol.Usage.of(result.num_tokens),
            calibrated=protocol.calibrated(result),
        )
        return JSONResponse(response.model_dump(exclude_none=True))

    async def rerank_v1(self, request: Request, body: protocol.RerankRequest) -> Response:
        """Documents sorted by relevance to the query, highest first (Cohere v1, Jina, vLLM)."""
        ranked, result = await self.rerank(request, body)
        self.metrics.scored(request.url.path, len(body.documents), result)
        results = [
            protocol.RerankResult(
                index=r.index,
                relevance_score=float(r.score),
                calibrated_score=protocol.calibrated(result, r.index),
                chunk=protocol.RerankChunk.of(r),
                document=protocol.RerankDocument.of(body.originals[r.index])
                if body.return_documents
                else None,
            )
            for r in ranked
        ]
        usage = protocol.RerankUsage(
            prompt_tokens=result.num_tokens, total_tokens=result.num_tokens
        )
        response = protocol.RerankResponse(
            id=f"rerank-{uuid.uuid4().hex}", model=self.model_name, usage=usage, results=results
        )
        return JSONResponse(response.model_dump(exclude_none=True))  # no document: no key

    async def rerank_v2(self, request: Request, body: protocol.RerankV2Request) -> Response:
        """Documents sorted by relevance to the query, highest first (Cohere v2)."""
        ranked, result = await self.rerank(request, body, fit=True)
        self.metrics.scored(request.url.path, len(body.documents), result)
        tokens = protocol.BilledUnits(input_tokens=result.num_tokens)
        response = protocol.RerankV2Response(
            id=str(uuid.uuid4()),
            results=[
                protocol.RerankV2Result(
                    index=r.index,
                    relevance_score=float(r.score),
                    calibrated_score=protocol.calibrated(result, r.index),
                    chunk=protocol.RerankChunk.of(r),
                )
                for r in ranked
            ],
            meta=protocol.RerankV2Meta(
                api_version=protocol.ApiVersion(), billed_units=tokens, tokens=tokens
            ),
        )
        return JSONResponse(response.model_dump(exclude_none=True))

    async def rerank(
        self,
        request: Request,
        body: protocol.RerankRequest | protocol.RerankV2Request,
        *,
        fit: bool = False,
    ):
        """(ranked documents, ScoreResult) under the server's template.

        The relevance score is P(positive label) / (P(positive) + P(negative)), as Scorer.rank
        computes it, or on a classification model the relevant class's probability; `top_n` null
        or 0 returns every document (vLLM's default is 0). max_tokens_per_doc cuts each
        document to the text of its first that many tokens, counted on the document alone (the
        template's words around it are not the document's). With fit, each rendered document is
        also cut to what fits beside the query (Cohere's v2 behaviour) instead of failing
        sequence_too_long."""
        docs = body.documents
        validation.check_size(
            self.limits,
            items=("documents", docs),
            values={"query": body.query, "instruction": body.instruction},
            num_labels=self.num_labels,
        )
        # Before anything tokenizes them (room_beside does, for v2).
        validation.check_texts(
            {"query": body.query, "instruction": body.instruction, "documents": docs}
        )
        t = self.template
        query = t.render_query(body.query, instruction=body.instruction)
        tokenizer, max_tokens, texts = self.scorer.tokenizer, None, docs
        if fit and tokenizer is not None:
            room = await asyncio.to_thread(self.room_beside, query)
            if room >= 1:  # else the query alone is too long: sequence_too_long says so
                max_tokens = room
        chunks = None
        if (chunking := protocol.chunking(body)) is not None:  # docs/chunking.md
            chunks, chunking = await asyncio.to_thread(
                self.chunked, query, docs, chunking, body.max_tokens_per_doc
            )
            texts = chunks.items  # a chunk is window tokens; fit still fits
        elif body.max_tokens_per_doc is not None and tokenizer is not None:
            # The document's own tokens, not the template's words around it.
            texts = await asyncio.to_thread(
                tokenization.cut_to_tokens, tokenizer, docs, body.max_tokens_per_doc
            )
        try:
            result = await self.scored(
                request,
                query=query,
                items=[t.render_item(text) for text in texts],
                labels=self.labels,
                item_suffix=t.item_suffix,
                max_item_tokens=max_tokens,
                truncate="right",
            )
        except ValidationError as e:
            e = e if chunks is None else chunked.located(e, chunks)
            raise wire_names(e, RERANK_PARAMS) from None
        if chunks is not None:
            scored = chunked.aggregate(chunks, result.label_probs[:, self.positive], chunking)
            # A chunk's calibrated probability is not its document's: none is returned.
            result = attrs.evolve(result, calibrated=None)
            return chunked.rank_documents(scored, docs, body.top_n or None), result
        ranked = ranking.rank_result(result, docs, positive=self.positive, top_k=body.top_n or None)
        return ranked, result

    def chunked(self, query: str, docs: list[str], options: dict[str, Any], max_tokens: int | None):
        """(chunks, Chunking) of the documents; a window left out (Cohere's max_chunks_per_doc
        alone) is max_tokens_per_doc, else what fits beside the query and the template."""
        if "window" not in options and max_tokens is None:
            part = self.template.render_item("")
            max_tokens = self.room_beside(query) - len(
                tokenization.encode_items(self.require_tokenizer("documents"), [part])[0]
            )
        options.setdefault("window", max_tokens)
        plan = Chunking.of(options)
        return chunked.split(self.require_tokenizer("documents"), docs, plan, "documents"), plan

    def room_beside(self, rendered_query: str) -> int:
        """A document's most tokens beside this query under the template: the model's positions
        less the query's and the item suffix's tokens."""
        tokenizer = self.scorer.tokenizer
        query = tokenization.encode_query(tokenizer, rendered_query)
        suffix = tokenization.encode_suffix(tokenizer, self.template.item_suffix or "")
        return self.scorer.config.max_position_embeddings - len(query) - len(suffix)

    async def scored(self, request: Request, **score_kwargs: Any):
        """The Batcher's result for this HTTP request, under its deadline (the header, at most
        the server's), dropped unscored if its client disconnects first."""
        timeout_s = guards.request_timeout(request.headers, self.batcher.request_timeout_s)
        work = self.batcher.score_async(timeout_s=timeout_s, **score_kwargs)
        return await guards.unless_disconnected(request.receive, work)

    async def score_any(self, request: Request, body: protocol.AnyScoreRequest) -> Response:
        """SGLang's or vLLM's score request, told apart by their fields."""
        if isinstance(body, protocol.ScoreRequest):
            dialects.speak(request.scope, "sglang")
            return await self.score(request, body)
        dialects.speak(request.scope, "vllm")
        return await self.score_pairs(request, body)

    async def score_pairs(
        self,
        request: Request,
        body: protocol.VllmTextScoreRequest
        | protocol.VllmQueriesScoreRequest
        | protocol.VllmDataScoreRequest,
    ) -> Response:
        """vLLM's scoring: each (query, document) pair's reranker score, as /v1/rerank gives
        the same pair (the server's template and labels)."""
        pairs = body.pairs()
        first, second = body.SIDES
        queries = [query for query, _ in pairs]
        validation.check_size(
            self.limits,
            items=(second, [doc for _, doc in pairs]),
            values={first: queries if len(set(queries)) > 1 else queries[:1]},
            num_labels=self.num_labels,
        )
        validation.check_texts({side: getattr(body, side) for side in body.SIDES})
        by_query: dict[str, list[int]] = {}
        for i, query in enumerate(queries):
            by_query.setdefault(query, []).append(i)
        # Each distinct query is a batcher request: the request is admitted whole or not at all.
        most = min(self.limits.max_queries, self.batcher.max_pending)
        if len(by_query) > most:
            raise ValidationError(
                "too_many_queries",
                f"{first} holds {len(by_query)} distinct queries; each is scored as a request of "
                f"its own, and this server takes at most {most} in one request "
                "(--max-queries, --max-pending)",
                first,
            )
        groups = list(by_query.items())
        results = await all_or_none(
            self.relevance(request, query, [pairs[i][1] for i in indexes], body.SIDES, indexes)
            for query, indexes in groups
        )
        scores = [0.0] * len(pairs)
        num_tokens = 0
        for (_, indexes), result in zip(groups, results, strict=True):
            num_tokens += result.num_tokens
            for ranked in ranking.rank_result(result, indexes, positive=self.positive):
                scores[ranked.item] = ranked.score  # as /v1/rerank scores the pair
            self.metrics.scored(request.url.path, len(indexes), result)
        response = protocol.VllmScoreResponse(
            id=f"score-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.model_name,
            data=[protocol.VllmScoreData(index=i, score=s) for i, s in enumerate(scores)],
            usage=protocol.VllmUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )
        return JSONResponse(response.model_dump())

    async def relevance(
        self,
        request: Request,
        query: str,
        docs: list[str],
        sides: tuple[str, str],
        indexes: list[int],
    ):
        """The ScoreResult of docs against query under the server's template and labels, which
        `ranking.rank_result` turns into the relevance scores a rerank gives. An error names the
        wire's fields, a document by its pair's index (docs[j] is pair indexes[j])."""
        t = self.template
        try:
            return await self.scored(
                request,
                query=t.render_query(query),
                items=[t.render_item(doc) for doc in docs],
                labels=self.labels,
                item_suffix=t.item_suffix,
            )
        except ValidationError as e:
            if e.loc[:1] == ("items",) and len(e.loc) > 1 and isinstance(e.loc[1], int):
                loc = (sides[1], indexes[e.loc[1]], *e.loc[2:])
                raise ValidationError(e.code, str(e), loc=loc) from None
            raise wire_names(e, {"query": sides[0], "items": sides[1]}) from None

    async def tokenize(self, body: protocol.TokenizeRequest) -> Response:
        """vLLM's /tokenize: the prompt's token ids under the scorer's tokenizer."""
        tokenizer = self.require_tokenizer("prompt")
        validation.check_size(self.limits, items=("prompt", []), values={"prompt": body.prompt})
        validation.check_text(body.prompt, "prompt")
        encoding = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        response = protocol.TokenizeResponse(
            count=len(encoding.ids),
            max_model_len=self.scorer.config.max_position_embeddings,
            tokens=encoding.ids,
            token_strs=encoding.tokens if body.return_token_strs else None,
        )
        return JSONResponse(response.model_dump())

    async def detokenize(self, body: protocol.DetokenizeRequest) -> Response:
        """vLLM's /detokenize: the text of token ids under the scorer's tokenizer."""
        tokenizer = self.require_tokenizer("tokens")
        validation.check_size(self.limits, items=("tokens", []), values={"tokens": body.tokens})
        vocab_size = self.scorer.config.vocab_size
        for j, t in enumerate(body.tokens):
            if not 0 <= t < vocab_size:
                code = "token_id_negative" if t < 0 else "token_id_exceeds_vocab"
                raise ValidationError(
                    code,
                    f"tokens[{j}] is {t}; the model's vocabulary has {vocab_size} tokens "
                    f"(ids 0..{vocab_size - 1})",
                    "tokens",
                )
        prompt = tokenizer.decode(body.tokens, skip_special_tokens=False)
        return JSONResponse(protocol.DetokenizeResponse(prompt=prompt).model_dump())

    def require_tokenizer(self, param: str):
        if self.scorer.tokenizer is None:
            raise ValidationError(
                "invalid_argument",
                "this server's model has no tokenizer: it takes token ids only",
                param,
            )
        return self.scorer.tokenizer

    async def health(self) -> Response:
        """`ok` once the model is loaded."""
        return JSONResponse(protocol.Health(model=self.model_name).model_dump())

    async def models(self) -> Response:
        """The one model this server serves."""
        card = protocol.ModelCard(
            id=self.model_name,
            created=self.created,
            max_model_len=self.scorer.config.max_position_embeddings,
        )
        return JSONResponse(protocol.ModelList(data=[card]).model_dump())

    async def prometheus(self) -> Response:
        """The Prometheus series: requests by status, latency, items, tokens, backends."""
        return Response(self.metrics.text(), media_type=CONTENT_TYPE)


async def all_or_none(works: Iterable[Awaitable[T]]) -> list[T]:
    """Every result of `works`, run concurrently; if one fails, the others are cancelled (a
    batcher request cancelled is dropped unscored) before its error is raised."""
    tasks = [asyncio.ensure_future(work) for work in works]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def wire_names(error: ValidationError, names: Mapping[str, str]) -> ValidationError:
    """`error` with its param's first part (a library argument) renamed by `names`."""
    if not error.loc or not isinstance(head := error.loc[0], str):
        return error
    return ValidationError(error.code, str(error), loc=(names.get(head, head), *error.loc[1:]))


# -- errors and counts ----------------------------------------------------------------------------


async def request_invalid(request: Request, exc: RequestValidationError) -> Response:
    """A body that fails its model: the first error, as tpuscore's code and param."""
    error = exc.errors()[0]
    loc = error.get("loc") or ()
    if len(loc) > 1 and loc[1] in protocol.VLLM_SHAPES:  # the score body's shape tag
        dialects.speak(request.scope, "vllm")
    elif len(loc) > 1 and loc[1] == "tei":  # TEI's body on /rerank or /tokenize
        dialects.speak(request.scope, "tei")
    code, param, message = protocol.error_fields(error)
    return dialects.error_response(request.scope, 400, code, message, param)


async def input_refused(request: Request, exc: ValidationError) -> Response:
    """400, or 413 for a request past a size bound."""
    status = 413 if exc.code in SIZE_CODES else 400
    return dialects.error_response(request.scope, status, exc.code, str(exc), exc.param)


async def overloaded(request: Request, exc: Overloaded) -> Response:
    headers = {"Retry-After": str(RETRY_AFTER_S)}
    return dialects.error_response(request.scope, 503, "overloaded", str(exc), headers=headers)


async def deadline_exceeded(request: Request, exc: DeadlineExceeded) -> Response:
    return dialects.error_response(request.scope, 504, "deadline_exceeded", str(exc))


async def client_left(request: Request, exc: guards.ClientDisconnected) -> Response:
    """Nobody reads this answer: its status is for the metrics (499) and the log."""
    logger.info("%s %s: the client disconnected; dropped", request.method, request.url.path)
    return Response(status_code=guards.CLIENT_CLOSED)


def foreign_host(host: str, scope: Scope) -> Response:
    message = (
        f"this server does not answer to the host {short(host)}; "
        "start it with --allowed-hosts naming it (or '*')"
    )
    return dialects.error_response(scope, 400, "invalid_host", message, "Host")


async def http_error(request: Request, exc: HTTPException) -> Response:
    if isinstance(exc, ApiError):
        return dialects.error_response(
            request.scope, exc.status_code, exc.code, exc.detail, exc.param
        )
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return dialects.error_response(
        request.scope, exc.status_code, code, message, headers=exc.headers
    )


class CountedAndGuarded:
    """ASGI middleware: a bug below answers 500 `internal_error` (logged with its traceback;
    the server keeps serving), and every answer of an endpoint in `counted` is counted and
    timed by path and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics, counted: set[str]):
        self.app, self.metrics, self.counted = app, metrics, counted

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = None

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as e:
            logger.exception("%s %s failed", scope["method"], scope["path"])
            if status is not None:  # the answer has begun: nothing else can be sent
                raise
            message = f"internal error ({type(e).__name__}); the server log has the details"
            answer = dialects.error_response(scope, 500, "internal_error", message)
            await answer(scope, receive, sending)
        route = scope.get("route")
        path = getattr(route, "path", None)
        if path in self.counted and scope["method"] in getattr(route, "methods", ()):
            self.metrics.answered(path, status or 500, time.perf_counter() - start)


# -- the app --------------------------------------------------------------------------------------


def create_app(
    scorer: Scorer,
    *,
    model_name: str = DEFAULT_MODEL_NAME,
    rerank_template: str | templates.Template = "plain",
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    limits: RequestLimits | None = None,
    max_items: int | None = None,
    batcher: Batcher | None = None,
    batcher_options: Mapping[str, Any] | None = None,
    allowed_hosts: Collection[str] | None = None,
    metrics_names: MetricsNames = "tpuscore",
) -> FastAPI:
    """The ASGI app serving `scorer`.

    rerank_template is a `tpuscore.api.templates` name or a `Template` of your own. The app
    builds a Batcher from batcher_options (keyword arguments of `Batcher`; its
    `request_timeout_s` is the server's deadline) and closes it at shutdown, unless given one
    to share, which the caller closes.

    allowed_hosts: the Host names it answers besides the address a connection reached, others
    get 400 `invalid_host`; default (None): on a loopback address the loopback names, on
    another any (`guards.AllowedHosts`). limits bound each request's size (`RequestLimits`'
    defaults unless given; max_items, if given, replaces its max_items). Raises ValueError for
    an unknown template name or a limit below 1. metrics_names: `/metrics`' series, tpuscore's,
    vLLM's or both (serving/metrics.py)."""
    limits = limits or RequestLimits()
    if max_items is not None:
        limits = attrs.evolve(limits, max_items=max_items)
    own = batcher is None
    if own:
        batcher = Batcher(scorer, **dict(batcher_options or {}))
    try:
        service = Service(
            scorer,
            batcher,
            model_name=model_name,
            rerank_template=rerank_template,
            max_body_bytes=max_body_bytes,
            limits=limits,
        )
        service.metrics = Metrics(
            metrics_names,
            model_name=model_name,
            batcher=batcher,
            executables_guard=scorer.engine.executables,
        )
    except Exception:
        if own:
            batcher.close()
        raise

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if own:  # close() drains the queue: off the event loop, which the drain may need
            await asyncio.to_thread(batcher.close)

    app = FastAPI(
        title="tpuscore",
        version=tpuscore.__version__,
        summary="Score items with a decoder-only LLM: SGLang's /v1/score, Cohere/Jina rerank.",
        lifespan=lifespan,
        docs_url="/docs",
        redoc_url=None,
        default_response_class=JSONResponse,
    )
    app.state.service = service

    scoring = [  # (path, handler, response model): POST, the body a JSON object
        ("/v1/score", service.score_any, protocol.ScoreResponse | protocol.VllmScoreResponse),
        ("/score", service.score_any, protocol.ScoreResponse | protocol.VllmScoreResponse),
        ("/detokenize", service.detokenize, protocol.DetokenizeResponse),
        ("/v1/rerank", service.rerank_v1, protocol.RerankResponse),
        ("/v2/rerank", service.rerank_v2, protocol.RerankV2Response),
        *tei.routes(service),  # /rerank and /tokenize: TEI's bodies beside the others
    ]
    for path, handler, model in scoring:
        app.router.add_api_route(
            path,
            handler,
            methods=["POST"],
            response_model=model,
            responses=dialects.documented_errors(
                dialects.SHARED_PATHS.get(path, dialects.DIALECT_BY_PATH[path])
            ),
            route_class_override=JsonBodyRoute,
        )
    app.add_api_route("/health", service.health, methods=["GET"], response_model=protocol.Health)
    app.add_api_route(
        "/v1/models", service.models, methods=["GET"], response_model=protocol.ModelList
    )
    app.add_api_route(
        "/metrics", service.prometheus, methods=["GET"], response_class=PlainTextResponse
    )
    completion = completions.register(
        app,
        service,
        JsonBodyRoute,
        dialects.documented_errors(dialects.DIALECT_BY_PATH[completions.PATH]),
    )
    counted = {path for path, _, _ in scoring} | {"/health", "/v1/models", completion}

    app.add_exception_handler(RequestValidationError, request_invalid)
    app.add_exception_handler(ValidationError, input_refused)
    app.add_exception_handler(Overloaded, overloaded)
    app.add_exception_handler(DeadlineExceeded, deadline_exceeded)
    app.add_exception_handler(guards.ClientDisconnected, client_left)
    app.add_exception_handler(HTTPException, http_error)
    app.add_middleware(CountedAndGuarded, metrics=service.metrics, counted=counted)
    app.add_middleware(guards.AllowedHosts, hosts=allowed_hosts, refuse=foreign_host)
    app.openapi = _without_422(app)
    return app


# OpenAPI links: where one answer's values feed another request (schemathesis' stateful runs
# follow them). (path, method) -> {link name: (target path, its method, request body)}.
LINKS = {
    ("/tokenize", "post"): {
        "Detokenize": ("/detokenize", "post", {"tokens": "$response.body#/tokens"}),
        "ScoreTheTokens": (
            "/v1/score",
            "post",
            {"query": "$response.body#/tokens", "items": [[1]], "label_token_ids": [1]},
        ),
    },
    ("/detokenize", "post"): {
        "Tokenize": ("/tokenize", "post", {"prompt": "$response.body#/prompt"}),
        "Rerank": (
            "/v1/rerank",
            "post",
            {"query": "$response.body#/prompt", "documents": ["$response.body#/prompt"]},
        ),
    },
    ("/v1/models", "get"): {
        "ScoreWithTheModel": (
            "/score",
            "post",
            {"model": "$response.body#/data/0/id", "text_1": "q", "text_2": ["d"]},
        ),
    },
}


def _without_422(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """app.openapi, less the 422 FastAPI documents for every body (a request that fails its
    model gets a 400 with its dialect's error body, documented as such), plus `LINKS`."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            for operations in schema["paths"].values():
                for operation in operations.values():
                    operation["responses"].pop("422", None)
            for (path, method), links in LINKS.items():
                ok = schema["paths"][path][method]["responses"]["200"]
                ok["links"] = {
                    name: {
                        "operationRef": "#/paths/" + target.replace("/", "~1") + "/" + verb,
                        "requestBody": body,
                    }
                    for name, (target, verb, body) in links.items()
                }
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
        return app.openapi_schema

    return openapi


def run(
    app: FastAPI,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    timeout_keep_alive: float = DEFAULT_KEEP_ALIVE_S,
):
    """Serve `app` with uvicorn until interrupted (one process: the model is loaded once).

    timeout_keep_alive: seconds an idle connection stays open; longer than the idle timeout
    of the load balancer in front, so the server never closes a connection the balancer is
    about to reuse (which its client would see as a reset)."""
    if not timeout_keep_alive > 0:
        raise ValueError(f"timeout_keep_alive must be > 0 seconds, got {timeout_keep_alive!r}")
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_keep_alive=timeout_keep_alive
    )
    uvicorn.Server(config).run()
