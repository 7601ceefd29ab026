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
handler is thin (`Service`, service.py, with each dialect's handlers in sglang.py, vllm.py and
rerank.py): FastAPI parses the body into its model (body.py reads it), the handler calls the
Batcher and builds the response model. Errors become an error body in the endpoint's dialect
(`dialects.py`: vLLM's, SGLang's, Cohere's), in one place each (errors.py): a request
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
from collections.abc import Callable, Collection, Mapping
from typing import Any

import attrs
import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import PlainTextResponse

import tpuscore
from tpuscore.api import templates
from tpuscore.api.errors import ValidationError
from tpuscore.api.requests import RequestLimits
from tpuscore.models.loaders import model_name
from tpuscore.models.loaders.default import NAME as DEFAULT_MODEL_NAME
from tpuscore.scorer import Scorer
from tpuscore.serving import completions, dialects, guards, responses, tei
from tpuscore.serving.batcher import Batcher, DeadlineExceeded, Overloaded
from tpuscore.serving.body import JsonBodyRoute
from tpuscore.serving.dialects import JSONResponse
from tpuscore.serving.errors import (
    CountedAndGuarded,
    client_left,
    deadline_exceeded,
    foreign_host,
    http_error,
    input_refused,
    overloaded,
    request_invalid,
    rerank_not_configured,
    wire_names,
)
from tpuscore.serving.metrics import Metrics, MetricsNames
from tpuscore.serving.service import Service

# Names other modules and callers import from here.
__all__ = [
    "DEFAULT_KEEP_ALIVE_S",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_ITEMS",
    "DEFAULT_MODEL_NAME",
    "JSONResponse",
    "Service",
    "create_app",
    "model_name",
    "run",
    "wire_names",
]

DEFAULT_MAX_BODY_BYTES = 16 << 20
DEFAULT_MAX_ITEMS = RequestLimits().max_items
# Tokens the server's batcher holds queued (estimated from text bytes until tokenized): about
# 300 MB of token lists at most, where --max-pending alone let 1024 bodies of 16 MiB queue. A
# request alone in the queue always gets in, so the largest body is never refused for it.
DEFAULT_MAX_QUEUED_TOKENS = 1 << 23
# Seconds an idle keep-alive connection stays open: past the 60 s idle timeout common to load
# balancers (AWS ALB, GCP's and nginx's defaults are 60 s or less), uvicorn's 5 s is not.
DEFAULT_KEEP_ALIVE_S = 75


def create_app(
    scorer: Scorer,
    *,
    model_name: str | None = None,
    rerank_template: str | templates.Template | None = "plain",
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    limits: RequestLimits | None = None,
    max_items: int | None = None,
    batcher: Batcher | None = None,
    batcher_options: Mapping[str, Any] | None = None,
    allowed_hosts: Collection[str] | None = None,
    metrics_names: MetricsNames = "tpuscore",
) -> FastAPI:
    """The ASGI app serving `scorer`.

    model_name: what responses and /v1/models call the model, and what a request's "model"
    may name (default: the scorer's `model_name`). rerank_template is a
    `tpuscore.api.templates` name or a `Template` of your own, or None (or "none"): no rerank
    (the rerank endpoints and vLLM's /score answer 404 `rerank_not_configured`; /v1/score is
    served, whatever the model's tokenizer makes of the templates' labels). The app
    builds a Batcher from batcher_options (keyword arguments of `Batcher`; its
    `request_timeout_s` is the server's deadline; `max_queued_tokens` defaults to
    `DEFAULT_MAX_QUEUED_TOKENS`) and closes it at shutdown, unless given one to share, which the
    caller closes.

    allowed_hosts: the Host names it answers besides the address a connection reached, others
    get 400 `invalid_host`; default (None): on a loopback address the loopback names, on
    another any (`guards.AllowedHosts`). limits bound each request's size (`RequestLimits`'
    defaults unless given; max_items, if given, replaces its max_items). Raises ValueError for
    an unknown template name or a limit below 1. metrics_names: `/metrics`' series, tpuscore's,
    vLLM's or both (serving/metrics.py)."""
    model_name = scorer.model_name if model_name is None else model_name
    limits = limits or RequestLimits()
    if max_items is not None:
        limits = attrs.evolve(limits, max_items=max_items)
    own = batcher is None
    if own:
        options = {"max_queued_tokens": DEFAULT_MAX_QUEUED_TOKENS, **(batcher_options or {})}
        batcher = Batcher(scorer, **options)
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
        ("/v1/score", service.score_any, responses.ScoreResponse | responses.VllmScoreResponse),
        ("/score", service.score_any, responses.ScoreResponse | responses.VllmScoreResponse),
        ("/detokenize", service.detokenize, responses.DetokenizeResponse),
        ("/v1/rerank", service.rerank_v1, responses.RerankResponse),
        ("/v2/rerank", service.rerank_v2, responses.RerankV2Response),
        *tei.routes(service),  # /rerank and /tokenize: TEI's bodies beside the others
    ]
    if service.template is None:  # --rerank-template none: the rerank paths answer 404
        reranks = {"/v1/rerank", "/v2/rerank", "/rerank"}
        scoring = [route for route in scoring if route[0] not in reranks]
        for path in sorted(reranks):
            app.router.add_api_route(path, _not_configured(path), methods=["POST"])
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
    app.add_api_route("/health", service.health, methods=["GET"], response_model=responses.Health)
    app.add_api_route(
        "/v1/models", service.models, methods=["GET"], response_model=responses.ModelList
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
    if service.template is None:
        counted |= {"/v1/rerank", "/v2/rerank", "/rerank"}

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


def _not_configured(path: str):
    """A handler that refuses every request to a rerank path, its body unread."""

    async def refuse() -> None:
        raise rerank_not_configured(path)

    return refuse


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
