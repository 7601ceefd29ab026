"""tpuscore over HTTP: SGLang's /v1/score and the Cohere/Jina rerank API, through one Batcher.

    tpuscore serve --port 8000            # or: run(create_app(scorer), port=8000)

Endpoints (docs/serving.md has the request and response of each):

- POST /v1/score: SGLang's scoring request and response.
- POST /v1/rerank and /rerank: the Cohere v1 / Jina rerank shape, as vLLM serves it.
- POST /v2/rerank: Cohere's v2 rerank shape.
- GET /health, GET /v1/models, GET /metrics (Prometheus text).

Why Starlette on uvicorn: the HTTP layer is thin on purpose (parse, call the library, map a
`ValidationError.code` to a status), and Starlette gives routing, requests and responses and
nothing more. FastAPI would add pydantic request models whose automatic 422 errors would have to
be undone to give tpuscore's stable codes and SGLang's error shape. uvicorn is the reference ASGI
server: one process, one event loop, so requests from many connections are parsed concurrently
and meet in the `Batcher`, which hands the model batches from one worker.

Every request goes through `Batcher.score_async`: validation runs before it is queued (one
client's bad input never fails another's request), requests that share a query run together,
and a full queue answers 503 with Retry-After instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import prometheus_client
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from tpuscore import Batcher, Overloaded, Scorer, ValidationError
from tpuscore.api import templates, tokenization
from tpuscore.serving import guards
from tpuscore.serving.batcher import DeadlineExceeded
from tpuscore.tasks import ranking

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MAX_BODY_BYTES = 16 << 20
DEFAULT_MAX_ITEMS = 4096
# Cohere's v2 rerank truncates every document to this many tokens unless told otherwise.
COHERE_MAX_TOKENS_PER_DOC = 4096
# Seconds an overloaded server asks a client to wait: a full queue drains within a few batches,
# and Retry-After counts whole seconds.
RETRY_AFTER_S = 1

# Fields each endpoint takes. SCORE_FIELDS adds `labels` (label strings, as Scorer.score takes
# them) to SGLang's fields; the rerank endpoints add `instruction` and `max_tokens_per_doc`.
SCORE_FIELDS = {
    "query",
    "items",
    "label_token_ids",
    "labels",
    "apply_softmax",
    "item_first",
    "model",
}
RERANK_V1_FIELDS = {
    "model",
    "query",
    "documents",
    "top_n",
    "return_documents",
    "instruction",
    "max_tokens_per_doc",
}
RERANK_V2_FIELDS = {"model", "query", "documents", "top_n", "max_tokens_per_doc", "instruction"}
# Fields the original APIs define and tpuscore does not implement: accepted at these default
# values (clients send them), refused with `unsupported_field` otherwise.
SCORE_DEFAULTS_ONLY = {
    "embed_override_token_id": None,
    "query_embed_overrides": None,
    "item_embed_overrides": None,
    "return_pooled_hidden_states": False,
}
RERANK_V1_DEFAULTS_ONLY = {"rank_fields": None, "max_chunks_per_doc": None}
RERANK_V2_DEFAULTS_ONLY = {"relevant_spans": None, "priority": 0}

ERROR_TYPES = {500: "server_error", 503: "service_unavailable", 504: "timeout"}


class ApiError(Exception):
    """An HTTP error with tpuscore's error body: {object, message, type, param, code}."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param
        self.headers = dict(headers or {})

    def response(self) -> Response:
        body = {
            "object": "error",
            "message": str(self),
            "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
            "param": self.param,
            "code": self.code,
        }
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class JSONResponse(Response):
    """JSON with ASCII escapes (any str survives, lone surrogates too) and no NaN or Infinity:
    a non-finite score is a bug to report as a 500, not invalid JSON to send."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":"), allow_nan=False).encode("ascii")


def model_name(model: str | None) -> str:
    """The name a server reports for `--model`: the default model's, a path's last part, or
    the hub id as given."""
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model)
    if path.exists():
        return path.stem if path.is_file() else path.resolve().name
    return str(model)


class Metrics:
    """The Prometheus series of one app, in a registry of its own (apps do not share counts)."""

    def __init__(self) -> None:
        self.registry = prometheus_client.CollectorRegistry()
        kw = {"registry": self.registry, "namespace": "tpuscore"}
        self.requests = prometheus_client.Counter(
            "requests", "HTTP requests answered", ["endpoint", "status"], **kw
        )
        self.items = prometheus_client.Counter(
            "items", "items or documents scored", ["endpoint"], **kw
        )
        self.tokens = prometheus_client.Counter(
            "tokens", "token positions the model ran", ["endpoint"], **kw
        )
        self.latency = prometheus_client.Histogram(
            "request_seconds",
            "time from request to response",
            ["endpoint"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            **kw,
        )
        self.backend_picks = prometheus_client.Counter(
            "backend_picks", "scoring results by the backend that ran them", ["backend"], **kw
        )

    def scored(self, endpoint: str, num_items: int, result: Any) -> None:
        self.items.labels(endpoint).inc(num_items)
        self.tokens.labels(endpoint).inc(result.num_tokens)
        self.backend_picks.labels(result.backend).inc()


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
        max_items: int,
    ):
        if max_body_bytes < 1 or max_items < 1:
            raise ValueError(
                f"max_body_bytes ({max_body_bytes}) and max_items ({max_items}) must be >= 1"
            )
        if isinstance(rerank_template, templates.Template):
            self.template = rerank_template
        else:
            try:
                self.template = templates.get(rerank_template)
            except ValueError as e:  # ValidationError: unknown_template
                raise ValueError(f"--rerank-template: {e}") from None
        try:  # a template whose labels are not single tokens here would fail every rerank
            t = self.template
            scorer.prepare(
                t.render_query("query"),
                [t.render_item("document")],
                labels=list(t.labels),
                item_suffix=t.item_suffix,
            )
        except ValidationError as e:
            raise ValueError(
                f"rerank template {t.name!r} does not fit this model: {e}; "
                "choose another --rerank-template"
            ) from None
        self.scorer, self.batcher = scorer, batcher
        self.model_name = model_name
        self.max_body_bytes, self.max_items = max_body_bytes, max_items
        self.metrics = Metrics()
        self.created = int(time.time())

    # -- POST /v1/score ------------------------------------------------------------------------

    async def score(self, request: Request) -> Response:
        body = await self.read_json(request)
        check_fields(body, SCORE_FIELDS, SCORE_DEFAULTS_ONLY)
        check_optional(body, "model", str)
        items = body.get("items")
        if isinstance(items, str):  # SGLang takes one text item as a bare string
            items = [items]
        self.check_count(items, "items")
        result = await self.scored(
            request,
            query=body.get("query"),
            items=items,
            label_token_ids=body.get("label_token_ids"),
            labels=body.get("labels"),
            apply_softmax=body.get("apply_softmax", False),
            item_first=body.get("item_first", False),
        )
        self.metrics.scored(request.url.path, len(items), result)
        return JSONResponse(
            {
                "scores": result.scores.tolist(),
                "model": self.model_name,
                "usage": usage(result.num_tokens),
                "object": "scoring",
            }
        )

    # -- POST /v1/rerank, /rerank, /v2/rerank --------------------------------------------------

    async def rerank_v1(self, request: Request) -> Response:
        body = await self.read_json(request)
        check_fields(body, RERANK_V1_FIELDS, RERANK_V1_DEFAULTS_ONLY)
        return_documents = body.get("return_documents", True)
        if not isinstance(return_documents, bool):
            raise invalid("return_documents", f"must be a bool, got {return_documents!r}")
        max_tokens = body.get("max_tokens_per_doc")
        ranked, result, num_docs = await self.rerank(request, body, max_tokens)
        self.metrics.scored(request.url.path, num_docs, result)
        results = []
        for r in ranked:
            entry = {"index": r.index, "relevance_score": float(r.score)}
            if return_documents:
                entry["document"] = {"text": r.item}
            results.append(entry)
        return JSONResponse(
            {
                "id": f"rerank-{uuid.uuid4().hex}",
                "model": self.model_name,
                "usage": {"prompt_tokens": result.num_tokens, "total_tokens": result.num_tokens},
                "results": results,
            }
        )

    async def rerank_v2(self, request: Request) -> Response:
        body = await self.read_json(request)
        check_fields(body, RERANK_V2_FIELDS, RERANK_V2_DEFAULTS_ONLY)
        max_tokens = body.get("max_tokens_per_doc", COHERE_MAX_TOKENS_PER_DOC)
        ranked, result, num_docs = await self.rerank(request, body, max_tokens, fit=True)
        self.metrics.scored(request.url.path, num_docs, result)
        tokens = {"input_tokens": result.num_tokens, "output_tokens": 0}
        return JSONResponse(
            {
                "id": str(uuid.uuid4()),
                "results": [{"index": r.index, "relevance_score": float(r.score)} for r in ranked],
                "meta": {"api_version": {"version": "2"}, "billed_units": tokens, "tokens": tokens},
            }
        )

    async def rerank(
        self, request: Request, body: dict[str, Any], max_tokens: Any, *, fit: bool = False
    ):
        """(ranked documents, ScoreResult, document count) under the server's template.

        The relevance score is P(positive label) / (P(positive) + P(negative)), as Scorer.rank
        computes it; `top_n` null or 0 returns every document (vLLM's default is 0). With fit,
        each document is also cut to what fits beside the query (Cohere's v2 behaviour) instead
        of failing sequence_too_long."""
        query = body.get("query")
        if not isinstance(query, str):
            raise invalid("query", f"must be a string, got {query!r}", code="invalid_query")
        check_optional(body, "model", str)
        instruction = check_optional(body, "instruction", str)
        top_n = body.get("top_n")
        if top_n is not None and (not is_int(top_n) or top_n < 0):
            raise invalid("top_n", f"must be a non-negative integer or null, got {top_n!r}")
        if max_tokens is not None and (not is_int(max_tokens) or max_tokens < 1):
            raise invalid(
                "max_tokens_per_doc", f"must be a positive integer or null, got {max_tokens!r}"
            )
        docs = documents(body.get("documents"))
        self.check_count(docs, "documents")
        t = self.template
        rendered = t.render_query(query, instruction=instruction)
        if fit and self.scorer.tokenizer is not None:
            room = await asyncio.to_thread(self.room_beside, rendered)
            if room >= 1:
                max_tokens = room if max_tokens is None else min(max_tokens, room)
        try:
            result = await self.scored(
                request,
                query=rendered,
                items=[t.render_item(doc) for doc in docs],
                labels=list(t.labels),
                item_suffix=t.item_suffix,
                max_item_tokens=max_tokens,
                truncate="right",
            )
        except ValidationError as e:  # name the rerank field, not Scorer.score's
            param = e.param if e.param is None else e.param.replace("items", "documents")
            raise ValidationError(e.code, str(e), param) from None
        ranked = ranking.rank_result(result, docs, positive=0, top_k=top_n or None)
        return ranked, result, len(docs)

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

    # -- GET /health, /v1/models, /metrics ------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.model_name})

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "tpuscore",
            "max_model_len": self.scorer.config.max_position_embeddings,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def prometheus(self, request: Request) -> Response:
        return Response(
            prometheus_client.generate_latest(self.metrics.registry),
            media_type=prometheus_client.CONTENT_TYPE_LATEST,
        )

    # -- request parsing ------------------------------------------------------------------------

    async def read_json(self, request: Request) -> dict[str, Any]:
        """The body as a JSON object, read up to max_body_bytes."""
        media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type != "application/json":
            raise ApiError(
                400,
                "invalid_content_type",
                f"Content-Type must be application/json, got {media_type or 'none'!r}",
            )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self.too_large()
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > self.max_body_bytes:
                    raise self.too_large()
        except ClientDisconnect:
            raise guards.ClientDisconnected() from None
        try:
            value = guards.parse_json(bytes(body))
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, "invalid_json", f"the body is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ApiError(
                400,
                "invalid_request",
                f"the body must be a JSON object, got {type(value).__name__}",
            )
        return value

    def too_large(self) -> ApiError:
        return ApiError(
            413, "body_too_large", f"the body is larger than {self.max_body_bytes} bytes"
        )

    def check_count(self, items: Any, param: str) -> None:
        if isinstance(items, list) and len(items) > self.max_items:
            raise ApiError(
                400,
                "too_many_items",
                f"{param} has {len(items)} entries; this server takes at most {self.max_items}",
                param,
            )

    # -- routing --------------------------------------------------------------------------------

    def endpoint(self, handler: Callable[[Request], Awaitable[Response]]):
        """handler with errors mapped to status codes and every answer counted and timed."""

        async def run(request: Request) -> Response:
            start = time.perf_counter()
            try:
                response = await handler(request)
            except ApiError as e:
                response = e.response()
            except ValidationError as e:
                response = ApiError(400, e.code, str(e), e.param).response()
            except Overloaded as e:
                headers = {"Retry-After": str(RETRY_AFTER_S)}
                response = ApiError(503, "overloaded", str(e), headers=headers).response()
            except DeadlineExceeded as e:
                response = ApiError(504, "deadline_exceeded", str(e)).response()
            except guards.ClientDisconnected:
                path = request.url.path
                logger.info("%s %s: the client disconnected; dropped", request.method, path)
                response = Response(status_code=guards.CLIENT_CLOSED)
            except Exception as e:  # noqa: BLE001 (a bug answers 500; the server stays up)
                logger.exception("%s %s failed", request.method, request.url.path)
                message = f"internal error ({type(e).__name__}); the server log has the details"
                response = ApiError(500, "internal_error", message).response()
            path = request.url.path
            self.metrics.requests.labels(path, str(response.status_code)).inc()
            self.metrics.latency.labels(path).observe(time.perf_counter() - start)
            return response

        return run

    def routes(self) -> list[Route]:
        post, get = ["POST"], ["GET"]
        return [
            Route("/v1/score", self.endpoint(self.score), methods=post),
            Route("/v1/rerank", self.endpoint(self.rerank_v1), methods=post),
            Route("/rerank", self.endpoint(self.rerank_v1), methods=post),
            Route("/v2/rerank", self.endpoint(self.rerank_v2), methods=post),
            Route("/health", self.endpoint(self.health), methods=get),
            Route("/v1/models", self.endpoint(self.models), methods=get),
            Route("/metrics", self.prometheus, methods=get),
        ]


def create_app(
    scorer: Scorer,
    *,
    model_name: str = DEFAULT_MODEL_NAME,
    rerank_template: str | templates.Template = "plain",
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_items: int = DEFAULT_MAX_ITEMS,
    batcher: Batcher | None = None,
    batcher_options: Mapping[str, Any] | None = None,
    allowed_hosts: Collection[str] | None = None,
) -> Starlette:
    """The ASGI app serving `scorer`.

    rerank_template is a `tpuscore.api.templates` name or a `Template` of your own. The app builds a
    Batcher from batcher_options (keyword arguments of `Batcher`; its `request_timeout_s` is the
    server's deadline) and closes it at shutdown, unless given one to share, which the caller
    closes. allowed_hosts: the Host names it answers (default any; `guards.default_allowed_hosts`
    gives a bind address's; `tpuscore serve` uses it). Raises ValueError for an unknown
    template name or a limit below 1."""
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
            max_items=max_items,
        )
    except Exception:
        if own:
            batcher.close()
        raise

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        if own:  # close() drains the queue: off the event loop, which the drain may need
            await asyncio.to_thread(batcher.close)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return ApiError(exc.status_code, code, message, headers=exc.headers).response()

    app = Starlette(
        routes=service.routes(),
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
    )
    app.state.service = service
    if allowed_hosts is not None:
        app.add_middleware(guards.AllowedHosts, hosts=allowed_hosts, refuse=foreign_host)
    return app


def foreign_host(host: str) -> Response:
    message = (
        f"this server does not answer to the host {host!r}; "
        "start it with --allowed-hosts naming it (or '*')"
    )
    return ApiError(400, "invalid_host", message, "Host").response()


def usage(num_tokens: int) -> dict[str, int]:
    """SGLang's usage block: scoring runs prompts only, so completion_tokens is 0."""
    return {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}


def run(app: Starlette, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"):
    """Serve `app` with uvicorn until interrupted (one process: the model is loaded once)."""
    uvicorn.run(app, host=host, port=port, log_level=log_level)


def check_fields(body: dict[str, Any], allowed: set[str], defaults_only: Mapping[str, Any]):
    """Refuse fields the endpoint does not know, and known-but-unimplemented ones set to
    anything but their default."""
    for key, value in body.items():
        if key in allowed:
            continue
        if key in defaults_only:
            default = defaults_only[key]
            if type(value) is type(default) and value == default:
                continue
            raise ApiError(
                400,
                "unsupported_field",
                f"{key} is not supported by tpuscore; leave it out or set it to "
                f"{json.dumps(defaults_only[key])}",
                key,
            )
        raise ApiError(
            400,
            "unknown_field",
            f"unknown field {key!r}; this endpoint takes {', '.join(sorted(allowed))}",
            key,
        )


def check_optional(body: dict[str, Any], key: str, kind: type) -> Any:
    value = body.get(key)
    if value is not None and not isinstance(value, kind):
        raise invalid(key, f"must be a {kind.__name__} or null, got {value!r}")
    return value


def documents(value: Any) -> list[str]:
    """Rerank documents as text: each a string or {"text": string}."""
    if not isinstance(value, list):
        raise invalid("documents", f"must be a list, got {value!r}", code="invalid_documents")
    texts = []
    for i, doc in enumerate(value):
        if isinstance(doc, dict) and set(doc) == {"text"}:
            doc = doc["text"]
        if not isinstance(doc, str):
            raise invalid(
                f"documents[{i}]",
                f'must be a string or {{"text": string}}, got {doc!r}',
                code="invalid_documents",
            )
        texts.append(doc)
    return texts


def invalid(param: str, message: str, *, code: str = "invalid_argument") -> ApiError:
    """A 400 for a field of the wrong type or value; message follows the field's name."""
    return ApiError(400, code, f"{param} {message}", param)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
