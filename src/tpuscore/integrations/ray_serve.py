"""`tpuscore serve` as N replicas on Ray Serve, routed by query so the prefix cache keeps working.

    from ray import serve
    from tpuscore.integrations.ray_serve import build_app

    serve.run(build_app("Qwen/Qwen3-Reranker-0.6B", num_replicas=4,
                        app_options={"rerank_template": "qwen3-reranker"}))
    # or: tpuscore serve --replicas 4 (--max-replicas 8 to autoscale)

Two deployments:

- `Replica`: each replica loads the model once and serves `serving.app.create_app`'s app, the
  same endpoints, batcher and errors as `tpuscore serve`; a request reaches it as its method,
  path, headers (its Host too, which the app checks against `allowed_hosts`) and body, and runs
  through that app in process.
- `Gateway`, the HTTP ingress: reads the body, takes the query's first characters (or token
  ids) as the request's affinity key, and calls the replicas through a handle whose request
  router is `QueryAffinityRouter`. Ray's HTTP proxy hands a request router only the request's
  ASGI scope, never its body, so the key must be read before routing: hence the gateway.

`QueryAffinityRouter` ranks the replicas by rendezvous hashing of the key: requests that share
a query go to the same replica, whose prefix cache and batcher then serve the query once; a
replica joining or leaving moves only the keys it wins or held. The rank order is also the
fallback: Ray's router skips a replica at `max_ongoing_requests`, and when the preferred one's
queue is longer than the shortest by more than `imbalance` requests, the least loaded go first.
Requests without a query (tokenize, health) take the least loaded replica.

A replica that dies under a request: the gateway retries the request once on another replica
(scoring has no side effect, and the dead replica's answer never arrives, so the client gets
exactly one), and answers 503 `replica_unavailable` with Retry-After if that fails too.
Autoscaling follows Ray Serve's ongoing requests per replica (`autoscaling_config`).
Needs the `ray` extra (ray[serve]); imported lazily, never by `import tpuscore`.
"""

# No `from __future__ import annotations`: FastAPI reads the gateway's parameter types at run
# time, from the class Ray Serve rebuilds.
import hashlib
import json
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
from starlette.responses import Response

from tpuscore.serving import guards

logger = logging.getLogger(__name__)

# How much of a query is its affinity key: its first characters (or token ids). Queries equal
# this far go to one replica; a prefix-cache hit needs the whole query, and a rerank renders the
# query before the documents, so a longer key only spreads near-identical queries apart.
AFFINITY_PREFIX_CHARS = 512
AFFINITY_PREFIX_IDS = 128
# Fields that hold the query, per dialect: SGLang's, Cohere's, Jina's, TEI's, vLLM's.
QUERY_FIELDS = ("query", "text_1", "queries", "data_1")
DEFAULT_IMBALANCE = 8  # queued requests beyond the least loaded replica's before falling back
RETRIES = 1  # on another replica, after a replica died under the request
RETRY_AFTER_S = 1
# Headers a replica's answer keeps (the others are the gateway's own to set).
DROPPED_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "date", "server"})


def affinity_key(body: bytes) -> str | None:
    """The request's query prefix as a short hash, or None for a body with no query."""
    try:
        value = guards.parse_json(body)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    query = next((value[f] for f in QUERY_FIELDS if f in value), None)
    if isinstance(query, list) and query and not isinstance(query[0], int):
        query = query[0]  # vLLM's list of queries: the first
    if isinstance(query, str):
        prefix = query[:AFFINITY_PREFIX_CHARS]
    elif isinstance(query, list) and all(isinstance(t, int) for t in query):
        prefix = json.dumps(query[:AFFINITY_PREFIX_IDS])
    else:
        return None
    return hashlib.blake2b(prefix.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def rendezvous_order(key: str, replica_ids: list[str]) -> list[str]:
    """The replicas in the key's preference order (highest random weight first)."""

    def weight(replica: str) -> bytes:
        return hashlib.blake2b(f"{key}/{replica}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=weight, reverse=True)


class QueryAffinityRouter(RequestRouter):
    """Ray Serve request router: the replicas in rendezvous-hash order of the request's
    `affinity_key` keyword, least loaded first when that order is imbalanced."""

    def initialize_state(self, imbalance: int = DEFAULT_IMBALANCE, **kwargs: Any) -> None:
        self.imbalance = imbalance

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = None if pending_request is None else pending_request.kwargs.get("affinity_key")
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = {rid: self.queue_len(r) for rid, r in by_id.items()}
        if key is None:
            order = sorted(by_id, key=lambda rid: loads[rid])
        else:
            order = rendezvous_order(key, list(by_id))
            known = [loads[rid] for rid in order if loads[rid] is not None]
            first = loads[order[0]]
            if first is not None and known and first - min(known) > self.imbalance:
                order.sort(key=lambda rid: float("inf") if loads[rid] is None else loads[rid])
        return [[by_id[rid]] for rid in order]

    def queue_len(self, replica: RunningReplica) -> int | None:
        """The replica's ongoing requests as Ray's router last saw them (None: not known)."""
        if not self._use_replica_queue_len_cache:
            return None
        return self._replica_queue_len_cache.get(replica.replica_id)


class RoundRobinRouter(RequestRouter):
    """The replicas in turn, whatever the request: the baseline `QueryAffinityRouter` is
    measured against (a load balancer without affinity)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.turn = 0

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        replicas = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        start = self.turn % len(replicas)
        self.turn += 1
        return [[r] for r in replicas[start:] + replicas[:start]]


ROUTERS = {"query": QueryAffinityRouter, "round_robin": RoundRobinRouter}


@serve.deployment
class Replica:
    """One model and `tpuscore serve`'s app over it, per replica."""

    def __init__(
        self,
        model: str | None,
        scorer_options: dict[str, Any],
        app_options: dict[str, Any],
    ):
        import httpx

        from tpuscore import Scorer
        from tpuscore.serving.app import create_app

        self.scorer = Scorer.from_pretrained(model, **scorer_options)
        self.app = create_app(self.scorer, **app_options)
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://replica", timeout=None
        )
        context = serve.get_replica_context()
        # The replica actor's name (namespace "serve"): which replica answered, in a header.
        self.replica_id = context.replica_id.to_full_id_str() if context is not None else "local"

    async def __call__(
        self,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes,
        affinity_key: str | None = None,
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        """The app's answer to one HTTP request: (status, headers, body)."""
        response = await self.client.request(method, path, headers=headers, content=body)
        kept = [(k, v) for k, v in response.headers.items() if k not in DROPPED_HEADERS]
        return (
            response.status_code,
            [*kept, ("x-tpuscore-replica", self.replica_id)],
            response.content,
        )


async def with_retries(call: Callable[[], Awaitable[Any]], retries: int = RETRIES):
    """(call()'s result, tries), calling again, up to `retries` more times, when the replica
    under it died or became unreachable (Ray then routes the next try elsewhere); (None, tries)
    when every try failed so. Any other error is the request's own and propagates."""
    for attempt in range(retries + 1):
        try:
            return await call(), attempt + 1
        except (RayActorError, ActorUnavailableError) as e:
            logger.warning("a replica failed under a request (try %d): %r", attempt + 1, e)
    return None, retries + 1


gateway_app = FastAPI(title="tpuscore (Ray Serve)", docs_url=None, redoc_url=None, openapi_url=None)


@serve.deployment
@serve.ingress(gateway_app)
class Gateway:
    """The HTTP ingress: every path is the replicas' (`tpuscore serve`'s API)."""

    def __init__(self, replicas, max_body_bytes: int):
        self.replicas = replicas
        self.max_body_bytes = max_body_bytes

    @gateway_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def forward(self, request: Request, path: str) -> Response:
        from tpuscore.serving import dialects

        # Errors in the dialect of the path the replica's app serves (after the route prefix).
        scope = {"path": f"/{path}"}
        body = await request.body()
        if len(body) > self.max_body_bytes:
            message = f"the body is larger than {self.max_body_bytes} bytes"
            return dialects.error_response(scope, 413, "body_too_large", message)
        key = affinity_key(body) if request.method == "POST" else None
        # `path` is the part after the app's route prefix: the replica's app serves it at its root.
        target = f"/{path}" + (f"?{request.url.query}" if request.url.query else "")
        headers = [(k, v) for k, v in request.headers.items() if k not in ("content-length",)]
        answer, tries = await with_retries(
            lambda: self.replicas.remote(request.method, target, headers, body, affinity_key=key)
        )
        if answer is None:
            return dialects.error_response(
                scope,
                503,
                "replica_unavailable",
                "no replica could answer; retry later",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        status, answer_headers, content = answer
        answer_headers = dict(answer_headers)
        if tries > 1:  # which answers a retry saved, for the logs and the tests
            answer_headers["x-tpuscore-retried"] = str(tries - 1)
        return Response(content, status_code=status, headers=answer_headers)


def build_app(
    model: str | os.PathLike | None = None,
    *,
    num_replicas: int = 2,
    max_replicas: int | None = None,
    target_ongoing_requests: float = 16,
    routing: str = "query",
    imbalance: int = DEFAULT_IMBALANCE,
    max_ongoing_requests: int = 256,
    replica_actor_options: dict[str, Any] | None = None,
    scorer_options: dict[str, Any] | None = None,
    app_options: dict[str, Any] | None = None,
) -> serve.Application:
    """The Ray Serve application: a `Gateway` over `num_replicas` `Replica`s.

    max_replicas: autoscale between num_replicas and max_replicas on ongoing requests per
    replica (target_ongoing_requests) instead of a fixed count. routing: "query"
    (`QueryAffinityRouter`) or "round_robin". replica_actor_options: Ray resources per replica
    (num_cpus, num_gpus, resources={"TPU": 4}). scorer_options: `Scorer.from_pretrained`'s
    (dtype, backend, ...); app_options: `create_app`'s (model_name, rerank_template,
    metrics_names, batcher_options, ...)."""
    if routing not in ROUTERS:
        raise ValueError(f"routing must be one of {sorted(ROUTERS)}, got {routing!r}")
    if num_replicas < 1 or (max_replicas is not None and max_replicas < num_replicas):
        raise ValueError(
            f"num_replicas ({num_replicas}) must be >= 1 and max_replicas ({max_replicas}) "
            "at least num_replicas"
        )
    from tpuscore.serving.app import DEFAULT_MAX_BODY_BYTES

    app_options = dict(app_options or {})
    scaling: dict[str, Any] = {"num_replicas": num_replicas}
    if max_replicas is not None:
        scaling = {
            "autoscaling_config": {
                "min_replicas": num_replicas,
                "max_replicas": max_replicas,
                "target_ongoing_requests": target_ongoing_requests,
            }
        }
    router = RequestRouterConfig(
        request_router_class=ROUTERS[routing],
        request_router_kwargs={"imbalance": imbalance} if routing == "query" else {},
    )
    replicas = Replica.options(
        **scaling,
        max_ongoing_requests=max_ongoing_requests,
        request_router_config=router,
        ray_actor_options=replica_actor_options or {},
    ).bind(None if model is None else str(model), dict(scorer_options or {}), app_options)
    max_body = app_options.get("max_body_bytes", DEFAULT_MAX_BODY_BYTES)
    return Gateway.options(ray_actor_options={"num_cpus": 0}).bind(replicas, max_body)
