"""Each endpoint answers errors in its peer's shape, and every error carries tpuscore's code.

A client written for vLLM, SGLang or Cohere reads an error the way its own server writes one:

- vLLM (`/score` and `/v1/score` with vLLM's fields, `/tokenize`, `/detokenize`, `/rerank`,
  `/v1/rerank`): `{"error": {"message", "type", "param", "code": <status>}}`, vLLM's
  `ErrorResponse` (vllm/entrypoints/openai/protocol.py).
- SGLang (`/v1/score` with SGLang's fields): `{"object": "error", "message", "type", "param",
  "code": <status>}`, SGLang's `ErrorResponse` (python/sglang/srt/entrypoints/openai/protocol.py).
- Cohere (`/v2/rerank`): `{"message"}`.
- tpuscore (everything else: `/health`, unknown paths, ...): `{"object": "error", "message",
  "type", "param", "code": <tpuscore's code>}`.

`/v1/rerank` and `/rerank` are served to Cohere v1, Jina and vLLM clients alike and cannot tell
them apart: they answer vLLM's shape, whose `error.message` Cohere's and Jina's clients show as
they show their own servers' messages. Whatever the shape, the `X-Error-Code` header holds
tpuscore's stable code (`too_many_items`, `invalid_text`, ...), the string to branch on, and the
body's `param` (where the shape has one) names the offending field.

The dialect of a request is its path's, except on `/v1/score` and `/score`, which take SGLang's
and vLLM's bodies: the handler (or the failed model) records which one it was in the request's
scope, and its errors follow.
"""

from __future__ import annotations

import http
import json
from collections.abc import Mapping
from typing import Any, Literal

import starlette.responses
from pydantic import BaseModel
from starlette.responses import Response
from starlette.types import Scope

from tpuscore.api.messages import short

Dialect = Literal["vllm", "sglang", "cohere", "tei", "tpuscore"]
DIALECT_BY_PATH: dict[str, Dialect] = {
    "/v1/score": "sglang",
    "/score": "vllm",
    "/tokenize": "vllm",
    "/detokenize": "vllm",
    "/v1/rerank": "vllm",
    "/rerank": "vllm",
    "/v2/rerank": "cohere",
    "/v1/completions": "vllm",  # OpenAI's shape, as vLLM serves it
}
# Paths whose body decides the dialect (dialect_of): every dialect they may answer in.
SHARED_PATHS: dict[str, tuple[Dialect, ...]] = {
    "/v1/score": ("sglang", "vllm"),
    "/score": ("sglang", "vllm"),
    "/rerank": ("vllm", "tei"),
    "/tokenize": ("vllm", "tei"),
}
SCOPE_KEY = "tpuscore.dialect"
CODE_HEADER = "X-Error-Code"
# A `param` longer than this (a field name is the caller's: an unknown one may be any length) is
# cut as a message's values are.
MAX_PARAM = 200
# tpuscore's own error `type` by status.
TPUSCORE_TYPES = {500: "server_error", 503: "service_unavailable", 504: "timeout"}
# vLLM's and SGLang's `type` by status (their create_error_response defaults); others are the
# status phrase, as vLLM names an HTTP error.
PEER_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}


class JSONResponse(starlette.responses.JSONResponse):
    """JSON with ASCII escapes (any str survives, lone surrogates too) and no NaN or Infinity:
    a non-finite score is a bug to report as a 500, not invalid JSON to send."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":"), allow_nan=False).encode("ascii")


class ErrorBody(BaseModel):
    """tpuscore's error: `code` is a stable string to branch on, `param` names the field."""

    object: Literal["error"] = "error"
    message: str
    type: str
    param: str | None
    code: str


class SglangError(BaseModel):
    """SGLang's error (python/sglang/srt/entrypoints/openai/protocol.py `ErrorResponse`)."""

    object: Literal["error"] = "error"
    message: str
    type: str
    param: str | None = None
    code: int


class VllmErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class VllmError(BaseModel):
    """vLLM's error (vllm/entrypoints/openai/protocol.py `ErrorResponse`): `code` is the
    status."""

    error: VllmErrorInfo


class CohereError(BaseModel):
    """Cohere's error: a message."""

    message: str


class TeiError(BaseModel):
    """TEI's error (router/src/http/types.rs `ErrorResponse`): a message and its kind."""

    error: str
    error_type: str


# TEI's `error_type` by status (its ErrorType, lowercase as it serializes it): a refused input
# is "validation", a full queue "overloaded", a failed or late step "backend".
TEI_TYPES = {500: "backend", 503: "overloaded", 504: "backend"}


ERROR_MODELS: dict[Dialect, type[BaseModel]] = {
    "vllm": VllmError,
    "sglang": SglangError,
    "cohere": CohereError,
    "tei": TeiError,
    "tpuscore": ErrorBody,
}


def dialect_of(scope: Scope) -> Dialect:
    """The dialect a request's errors answer in: the one its handler recorded, else its
    path's."""
    return scope.get(SCOPE_KEY) or DIALECT_BY_PATH.get(scope.get("path", ""), "tpuscore")


def speak(scope: Scope, dialect: Dialect) -> None:
    """Record that this request is in `dialect` (a /score body's shape decides it)."""
    scope[SCOPE_KEY] = dialect


def peer_type(status: int) -> str:
    if status in PEER_TYPES:
        return PEER_TYPES[status]
    try:
        return http.HTTPStatus(status).phrase.replace(" ", "") + "Error"
    except ValueError:
        return "Error"


def error_body(
    dialect: Dialect, status: int, code: str, message: str, param: str | None
) -> BaseModel:
    """The error in `dialect`'s shape."""
    if param is not None and len(param) > MAX_PARAM:
        param = short(param)
    if dialect == "vllm":
        info = VllmErrorInfo(message=message, type=peer_type(status), param=param, code=status)
        return VllmError(error=info)
    if dialect == "sglang":
        return SglangError(message=message, type=peer_type(status), param=param, code=status)
    if dialect == "cohere":
        return CohereError(message=message)
    if dialect == "tei":  # no field for the location: the message names it
        if param is not None and not message.startswith(param):
            message = f"{param}: {message}"
        return TeiError(error=message, error_type=TEI_TYPES.get(status, "validation"))
    kind = TPUSCORE_TYPES.get(status, "invalid_request_error")
    return ErrorBody(message=message, type=kind, param=param, code=code)


def error_response(
    scope: Scope,
    status: int,
    code: str,
    message: str,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """The error answer to the request of `scope`: its dialect's body, tpuscore's code in the
    X-Error-Code header."""
    body = error_body(dialect_of(scope), status, code, message, param)
    return JSONResponse(
        body.model_dump(), status_code=status, headers={**(headers or {}), CODE_HEADER: code}
    )


def error_code(headers: Mapping[str, str]) -> str | None:
    """tpuscore's code of an error answer, from its headers."""
    return headers.get(CODE_HEADER) or headers.get(CODE_HEADER.lower())


def documented_errors(dialect: Dialect | tuple[Dialect, ...]) -> dict[int | str, dict[str, Any]]:
    """The error responses of a POST endpoint in `dialect` (or any of several), for the OpenAPI
    document."""
    dialects = dialect if isinstance(dialect, tuple) else (dialect,)
    models = [ERROR_MODELS[d] for d in dialects]
    model: Any = models[0]
    for other in models[1:]:
        model = model | other
    content = {"model": model}
    code = {CODE_HEADER: {"schema": {"type": "string"}, "description": "tpuscore's error code"}}
    return {
        400: {
            **content,
            "description": "a bad request; the X-Error-Code header says why (docs/serving.md)",
            "headers": code,
        },
        413: {
            **content,
            "description": "the body is larger than --max-body-bytes, or the request is past a "
            "size bound (--max-items, --max-labels, ...; X-Error-Code says which)",
            "headers": code,
        },
        503: {
            **content,
            "description": "the queue is full; retry after Retry-After seconds",
            "headers": {**code, "Retry-After": {"schema": {"type": "integer"}}},
        },
        504: {
            **content,
            "description": "not scored within the request's deadline",
            "headers": code,
        },
    }
