"""What keeps a long-lived server bounded, apart from its routes: deadlines, disconnects, hosts,
JSON nesting.

- A request's deadline comes from the `X-Request-Timeout` header (seconds), capped by the
  server's `--request-timeout`; the Batcher drops a request past it unscored (504).
- A client that disconnects while its request waits cancels it (`unless_disconnected`): it is
  never scored, logged at INFO and counted as status 499, the code nginx gave to this case.
- Work run in a thread beside the Batcher (`run_held`) keeps its place under the server's bounds
  until the thread ends, past its deadline too: a running thread cannot be stopped.
- `AllowedHosts` refuses a Host header the server does not answer to (a DNS-rebinding page in a
  browser reaches a loopback server under its own host name): by default, on a loopback address,
  anything but the loopback names and the address itself.
- `parse_json` bounds nesting depth, so that no deeply nested body reaches recursive code (repr,
  model validation) to end in a RecursionError.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import math
import threading
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any, TypeVar

from tpuscore.api.errors import ValidationError
from tpuscore.api.messages import short

T = TypeVar("T")

TIMEOUT_HEADER = "X-Request-Timeout"
# Nesting of a request body: every endpoint's fields are at most 3 deep (a body, its items, an
# item's token ids), so 32 leaves room and stays far from Python's recursion limit.
MAX_JSON_DEPTH = 32
# The Host names a loopback server answers by default.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# The status a request whose client left is counted as (nginx's "client closed request").
CLIENT_CLOSED = 499


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready."""


class JsonTooDeep(ValueError):
    """A JSON body nested deeper than MAX_JSON_DEPTH."""


def request_timeout(headers: Mapping[str, str], server_timeout: float | None) -> float | None:
    """Seconds until a request's deadline: the header's value, at most the server's; the
    server's without the header; None for no deadline. A bad header value is invalid_argument."""
    raw = headers.get(TIMEOUT_HEADER.lower())
    if raw is None:
        return server_timeout
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValidationError(
            "invalid_argument",
            f"{TIMEOUT_HEADER} must be a positive number of seconds, got {short(raw)}",
            TIMEOUT_HEADER,
        )
    return seconds if server_timeout is None else min(seconds, server_timeout)


async def unless_disconnected(receive: Callable[[], Awaitable[dict]], work: Awaitable[T]) -> T:
    """`await work`, cancelled if the client disconnects first (then ClientDisconnected).

    receive is the ASGI receive of a request whose body has been read: its next message is
    `http.disconnect`, when the client leaves (uvicorn sends it on a lost connection)."""

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            # The work drops itself (a batcher request gives up its place) before the client is
            # answered: answered first, a worker freed meanwhile could still score it.
            await asyncio.wait({task})
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def run_held(
    work: Callable[[], T], release: Callable[[], None], timeout_s: float | None
) -> T:
    """work() in a thread, awaited until timeout_s (TimeoutError), then release(): when work
    ends, or at once where a deadline or a cancel comes before it starts (it then never runs)."""
    lock = threading.Lock()
    started = dropped = False

    def run() -> T | None:
        nonlocal started
        with lock:
            if dropped:
                return None
            started = True
        try:
            return work()
        finally:
            release()

    try:
        return await asyncio.wait_for(asyncio.to_thread(run), timeout_s)
    except BaseException:
        with lock:
            dropped = True
            if not started:
                release()
        raise


def parse_json(body: bytes | str) -> Any:
    """The body's JSON value. Raises ValueError (JsonTooDeep past MAX_JSON_DEPTH, or
    json.JSONDecodeError) for what is not JSON within the bound."""
    try:
        value = json.loads(body)
    except RecursionError:  # deeper than the parser's own bound
        raise JsonTooDeep(f"the JSON is nested deeper than {MAX_JSON_DEPTH} levels") from None
    opens = body.count(b"[" if isinstance(body, bytes) else "[")
    opens += body.count(b"{" if isinstance(body, bytes) else "{")
    if opens > MAX_JSON_DEPTH and _depth(value) > MAX_JSON_DEPTH:
        raise JsonTooDeep(f"the JSON is nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def _depth(value: Any) -> int:
    """Nesting depth of a JSON value, without recursion (a scalar is 0)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if depth > deepest:
            deepest = depth
            if deepest > MAX_JSON_DEPTH:
                return deepest
        stack.extend((c, depth + 1) for c in children if isinstance(c, (list, dict)))
    return deepest if isinstance(value, (list, dict)) else 0


def is_loopback(host: str) -> bool:
    """Whether host (a name or an address) is this machine's loopback: localhost, 127.0.0.0/8,
    ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(bind_host: str) -> list[str] | None:
    """The Host names a server bound to bind_host answers by default: the loopback names and
    the address itself for a loopback bind (127.0.0.2 answers to "127.0.0.2"), any (None)
    otherwise, where a proxy or the deployment decides. `AllowedHosts(hosts=None)` applies the
    same rule to each connection's own local address."""
    if not is_loopback(bind_host):
        return None
    return list(dict.fromkeys([*LOOPBACK_HOSTS, bind_host.lower().strip("[]")]))


class AllowedHosts:
    """ASGI middleware: an HTTP request whose Host header (port aside) is not allowed gets
    `refuse(host, scope)`, a response; lifespan and other scopes pass.

    Allowed: the address the connection reached (the ASGI scope's `server`: a Host naming the
    very address the client connected to cannot be a rebinding page's), and `hosts`, or with
    hosts None, `default_allowed_hosts` of that address: the loopback names on a loopback
    address, any host on another. `*` in hosts allows any host."""

    def __init__(self, app: Any, hosts: Collection[str] | None, refuse: Callable[[str, dict], Any]):
        self.app = app
        self.hosts = None if hosts is None else {h.lower().strip("[]") for h in hosts}
        self.refuse = refuse

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            host = host_name(dict(scope["headers"]).get(b"host", b"").decode("latin-1"))
            if not self.allows(host, scope):
                await self.refuse(host, scope)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def allows(self, host: str, scope: dict) -> bool:
        if self.hosts is not None and "*" in self.hosts:
            return True
        local = str((scope.get("server") or ("",))[0]).lower().strip("[]")
        if host and host == local:
            return True
        if self.hosts is not None:
            return host in self.hosts
        allowed = default_allowed_hosts(local) if local else None
        return allowed is None or host in allowed


def host_name(header: str) -> str:
    """The name in a Host header, lower case, without its port or IPv6 brackets."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header[1:]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header
