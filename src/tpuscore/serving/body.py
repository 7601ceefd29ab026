"""Reading a POST body: at most the server's max_body_bytes, and a JSON object, before FastAPI
parses it into the endpoint's model."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from tpuscore.api.messages import short
from tpuscore.serving import guards
from tpuscore.serving.errors import ApiError


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
