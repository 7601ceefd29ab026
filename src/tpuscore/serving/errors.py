"""The server's errors: each raised error becomes an error body in its endpoint's dialect
(`dialects.py`), and the middleware that answers a bug with 500 and counts every answer.

A request that fails its model (`RequestValidationError`), one the library refuses
(`ValidationError`), a full queue (`Overloaded`: 503 with Retry-After), a request past its
deadline (`DeadlineExceeded`: 504), a client that left (`ClientDisconnected`: counted as 499,
logged at INFO, nothing sent), HTTP errors (413 over max_body_bytes, 404, 405, 400 for a foreign
Host), and a bug (500, logged; the server keeps serving).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tpuscore.api.errors import ValidationError
from tpuscore.api.messages import short
from tpuscore.serving import dialects, guards, protocol, score_protocol
from tpuscore.serving.batcher import DeadlineExceeded, Overloaded
from tpuscore.serving.metrics import Metrics

logger = logging.getLogger(__name__)

# A request past a size bound (`RequestLimits`) is well formed but more than this server takes.
SIZE_CODES = frozenset(
    {"too_many_items", "too_many_labels", "too_many_scores", "too_many_queries"}
    | {"input_too_long", "request_too_large"}
)
# What this server does not serve: a model or adapter it has not loaded, or reranking on a server
# started without a rerank template.
NOT_FOUND_CODES = frozenset({"model_not_found", "rerank_not_configured"})
# Seconds an overloaded server asks a client to wait: a full queue drains within a few batches,
# and Retry-After counts whole seconds.
RETRY_AFTER_S = 1


class ApiError(HTTPException):
    """An HTTP error the server raises itself, with its tpuscore code and param."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None):
        super().__init__(status, message)
        self.code, self.param = code, param


def wire_names(error: ValidationError, names: Mapping[str, str]) -> ValidationError:
    """`error` with its param's first part (a library argument) renamed by `names`."""
    if not error.loc or not isinstance(head := error.loc[0], str):
        return error
    return ValidationError(error.code, str(error), loc=(names.get(head, head), *error.loc[1:]))


def rerank_not_configured(path: str) -> ValidationError:
    """The error of a rerank endpoint (or vLLM's /score, which reranks) on a server started
    without a rerank template: 404."""
    return ValidationError(
        "rerank_not_configured",
        f"{path} ranks under the server's rerank template, and this server has none "
        "(--rerank-template none): it serves /v1/score; start it with --rerank-template plain "
        "or qwen3-reranker to rerank",
        None,
    )


async def request_invalid(request: Request, exc: RequestValidationError) -> Response:
    """A body that fails its model: the first error, as tpuscore's code and param."""
    error = exc.errors()[0]
    loc = error.get("loc") or ()
    if len(loc) > 1 and loc[1] in score_protocol.VLLM_SHAPES:  # the score body's shape tag
        dialects.speak(request.scope, "vllm")
    elif len(loc) > 1 and loc[1] == "tei":  # TEI's body on /rerank or /tokenize
        dialects.speak(request.scope, "tei")
    code, param, message = protocol.error_fields(error)
    return dialects.error_response(request.scope, 400, code, message, param)


async def input_refused(request: Request, exc: ValidationError) -> Response:
    """400, 413 for a request past a size bound, 404 for a `model` the server does not serve
    (vLLM's answer to an unknown model or LoRA module) or a rerank on a server without a rerank
    template."""
    status = 413 if exc.code in SIZE_CODES else 404 if exc.code in NOT_FOUND_CODES else 400
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
