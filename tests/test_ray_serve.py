"""tpuscore on Ray Serve (`tpuscore.integrations.ray_serve`) on a local Ray cluster: two replicas
of a tiny checkpoint behind the gateway on 127.0.0.1. Scores equal the in-process scorer's;
query-affine routing keeps the prefix cache hitting where round robin does not; a replica
killed mid-stream costs no request (each is answered once, or refused with 503).
"""

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from helpers import start_ray
from test_server import TEMPLATE
from tpuscore.serving import guards as server_guards

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
ray_serve = pytest.importorskip("tpuscore.integrations.ray_serve")

CASE = "qwen3_qknorm"
LABELS = [3, 4]
QUERIES = 5  # odd: round robin over two replicas cannot send a query to one replica by chance
REPEATS = 3
QUERY_TOKENS = 24
ITEMS, ITEM_TOKENS = 3, 4
TIMEOUT = httpx.Timeout(120.0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    start_ray(log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def deploy(cluster, checkpoint, routing: str) -> str:
    """The app under `/<routing>`, two replicas; its URL once every replica is up."""
    app_options = {
        "rerank_template": TEMPLATE,
        "model_name": "tiny",
        "allowed_hosts": ["127.0.0.1"],
    }
    app = ray_serve.build_app(
        str(checkpoint),
        num_replicas=2,
        routing=routing,
        # Half a CPU each: the affine app stays up while the round-robin one is measured, and
        # both fit the 2-CPU cluster.
        replica_actor_options={"num_cpus": 0.5},
        scorer_options={"dtype": "float32", "backend": "prefill_extend"},
        app_options=app_options,
    )
    serve.run(app, name=routing, route_prefix=f"/{routing}")
    status = serve.status().applications[routing].deployments["Replica"]
    assert status.replica_states.get("RUNNING") == 2, status
    return f"{cluster}/{routing}"


@pytest.fixture(scope="module")
def affine_app(cluster, checkpoint_dir):
    """The query-affine app, deployed once for the module: the routing test measures it, then
    the failure test kills one of its replicas (a deployment costs two replicas' start-up)."""
    url = deploy(cluster, checkpoint_dir(CASE), "query")
    yield url
    serve.delete("query")


def stream(rng, vocab):
    """QUERIES token-id queries, each REPEATS times with fresh items, interleaved."""
    queries = [rng.integers(5, vocab, QUERY_TOKENS).tolist() for _ in range(QUERIES)]
    return [
        {
            "query": q,
            "items": rng.integers(5, vocab, (ITEMS, ITEM_TOKENS)).tolist(),
            "label_token_ids": LABELS,
        }
        for _ in range(REPEATS)
        for q in queries
    ]


def send(client, request):
    response = client.post("/v1/score", json=request)
    send.retried += int(response.headers.get("x-tpuscore-retried", 0))
    return response.status_code, response.headers.get("x-tpuscore-replica"), response.json()


send.retried = 0


def run_stream(url, requests):
    """(answers, cache hits, replica per request, seconds) over the stream, sent one by one."""
    answers, hits, replicas = [], 0, []
    with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
        start = time.perf_counter()
        for request in requests:
            status, replica, body = send(client, request)
            assert status == 200, body
            answers.append(body["scores"])
            # A hit runs the items only: the query's K/V came from the replica's prefix cache.
            hits += body["usage"]["prompt_tokens"] == ITEMS * ITEM_TOKENS
            replicas.append(replica)
        seconds = time.perf_counter() - start
    return answers, hits, replicas, seconds


@pytest.mark.slow  # a local Ray cluster: its workers start and import JAX
def test_affine_routing_keeps_the_prefix_cache(cluster, affine_app, checkpoint_dir, scorers, rng):
    checkpoint, scorer = checkpoint_dir(CASE), scorers(CASE)
    vocab = scorer.config.vocab_size
    requests = stream(rng, vocab)
    expected = [scorer.score(**request).scores for request in requests]
    # Other queries, each twice, first compile both replicas' cold and cached shapes.
    warmup = [r for r in stream(rng, vocab) + stream(rng, vocab)][: 4 * QUERIES]
    figures, rates = {}, {}
    for routing in ("query", "round_robin"):
        url = affine_app if routing == "query" else deploy(cluster, checkpoint, routing)
        run_stream(url, warmup)
        answers, hits, replicas, seconds = run_stream(url, requests)
        for answer, scores in zip(answers, expected, strict=True):
            np.testing.assert_allclose(answer, scores, rtol=1e-4, atol=1e-7)
        rates[routing] = len(requests) * ITEMS / seconds  # reported, not asserted
        figures[routing] = hits / len(requests)
        by_query = {}
        for request, replica in zip(requests, replicas, strict=True):
            by_query.setdefault(tuple(request["query"]), set()).add(replica)
        if routing == "query":  # one replica per query
            assert all(len(r) == 1 for r in by_query.values()), by_query
        else:  # both replicas serve, each query on both
            assert len(set(replicas)) == 2
            assert all(len(r) == 2 for r in by_query.values()), by_query
            serve.delete(routing)
    print(
        f"prefix-cache hit rate: affine {figures['query']:.2f}, round robin "
        f"{figures['round_robin']:.2f}; items/s (one request at a time, after warmup) "
        f"affine {rates['query']:.1f}, round robin {rates['round_robin']:.1f} "
        f"({QUERIES} queries x {REPEATS}, two replicas)"
    )
    # Affine: every repeat hits. Round robin: a query's first visit to each replica misses.
    assert figures["query"] == (REPEATS - 1) / REPEATS
    assert figures["round_robin"] == (REPEATS - 2) / REPEATS
    assert figures["query"] > figures["round_robin"]


@pytest.mark.slow
def test_a_killed_replica_loses_no_request(affine_app, scorers, rng):
    url, scorer = affine_app, scorers(CASE)
    # Eight clients at once keep requests in flight on the replica when it is killed (the
    # gateway's retry then answers them).
    requests = stream(rng, scorer.config.vocab_size) * 2
    answers: list = [None] * len(requests)
    first_answered = threading.Event()
    killed: list[str] = []

    def one(i):
        with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
            answers[i] = send(client, requests[i])
        first_answered.set()

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(len(requests))]
        assert first_answered.wait(120)
        victim = next(a[1] for a in answers if a is not None and a[0] == 200)
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        killed.append(victim)
        for future in futures:
            future.result(timeout=300)

    statuses = [a[0] for a in answers]
    assert set(statuses) <= {200, 503}, statuses
    for request, (status, _, body) in zip(requests, answers, strict=True):
        if status == 503:
            assert body["code"] == 503 and "no replica" in body["message"]  # SGLang's shape
            continue
        np.testing.assert_allclose(
            body["scores"], scorer.score(**request).scores, rtol=1e-4, atol=1e-7
        )
    answered = statuses.count(200)
    print(
        f"replica killed mid-stream: {answered} of {len(requests)} answered "
        f"({send.retried} after a retry on another replica), {statuses.count(503)} refused "
        "with 503"
    )
    assert answered >= len(requests) // 2
    # After the kill, the survivor (or the controller's replacement) answers.
    with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
        status, replica, _ = send(client, requests[0])
    assert status == 200 and replica != killed[0]
    # The client's Host reaches the replica's app, which refuses a foreign one.
    foreign = httpx.post(f"{url}/v1/score", json=requests[0], headers={"Host": "evil.example"})
    assert foreign.status_code == 400 and foreign.headers["X-Error-Code"] == "invalid_host"


# -- without a cluster ---------------------------------------------------------------------------


def test_affinity_key_reads_every_dialects_query():
    key = ray_serve.affinity_key
    same = key(b'{"query": "what is a fox?", "items": ["a"]}')
    assert same is not None
    assert key(b'{"query": "what is a fox?", "documents": ["b"], "top_n": 1}') == same
    assert key(b'{"query": "what is a fox?", "texts": ["c"]}') == same  # TEI
    assert key(b'{"text_1": "what is a fox?", "text_2": ["d"]}') == same  # vLLM
    assert key(b'{"queries": ["what is a fox?"], "documents": ["d"]}') == same
    assert key(b'{"query": "what is a dog?", "items": ["a"]}') != same
    # Queries equal in their first AFFINITY_PREFIX_CHARS characters share a key.
    long = "x" * ray_serve.AFFINITY_PREFIX_CHARS
    assert key(json.dumps({"query": long + "a"}).encode()) == key(
        json.dumps({"query": long + "b"}).encode()
    )
    assert key(b'{"query": [1, 2, 3], "items": [[4]]}') == key(b'{"query": [1, 2, 3]}')
    for body in (b'{"prompt": "x"}', b"[1]", b"not json", b'{"query": 5}'):
        assert key(body) is None, body


def test_rendezvous_moves_only_a_removed_replicas_keys():
    replicas = [f"r{i}" for i in range(4)]
    keys = [f"k{i}" for i in range(200)]
    before = {k: ray_serve.rendezvous_order(k, replicas)[0] for k in keys}
    assert set(before.values()) == set(replicas)  # every replica wins some keys
    after = {k: ray_serve.rendezvous_order(k, replicas[1:])[0] for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == "r0"}


def test_serve_replicas_builds_the_app(monkeypatch, checkpoint_dir):
    """`tpuscore serve --replicas 2 --max-replicas 4`: the flags reach build_app and Serve."""
    from tpuscore.cli import commands as cli

    calls = {}
    monkeypatch.setattr(ray_serve, "build_app", lambda *a, **kw: calls.setdefault("app", (a, kw)))
    monkeypatch.setattr(ray, "init", lambda **kw: calls.setdefault("init", kw))
    monkeypatch.setattr(serve, "start", lambda **kw: calls.setdefault("start", kw))
    monkeypatch.setattr(serve, "run", lambda app, **kw: calls.setdefault("run", kw))
    model = str(checkpoint_dir(CASE))
    argv = ["serve", "--model", model, "--port", "0", "--replicas", "2", "--max-replicas", "4"]
    flags = ["--metrics-names", "vllm", "--timeout-keep-alive", "90", "--max-labels", "9"]
    assert cli.main([*argv, *flags, "--score-calibration", "cal.json"]) == 0
    (path,), options = calls["app"]
    # Every replica's scorer and app get the flags a one-process server would.
    assert options["scorer_options"]["score_calibration"] == "cal.json"
    assert options["app_options"]["limits"].max_labels == 9
    assert path == model
    assert (options["num_replicas"], options["max_replicas"]) == (2, 4)
    assert options["app_options"]["metrics_names"] == "vllm"
    assert calls["start"]["http_options"]["keep_alive_timeout_s"] == 90
    assert calls["run"]["blocking"] is True
    assert options["app_options"]["allowed_hosts"] == server_guards.default_allowed_hosts(
        "127.0.0.1"
    )
    assert cli.main(["serve", "--model", model, "--port", "0", "--replicas", "0"]) != 0
    assert cli.main([*argv[:-2], "--mesh", "2x1"]) != 0


def test_serve_replicas_that_cannot_load_fail_in_one_line(monkeypatch, capsys):
    """`tpuscore serve --replicas 1 --model MISSING`: Serve gives up on the replica and raises
    RuntimeError; the command says why the replica failed in one line, status 2, as a
    one-process server's load failure (it printed a traceback). The status's shape is what
    Ray 2.60 records for a replica whose constructor raised."""
    from types import SimpleNamespace

    from tpuscore.cli import commands as cli

    monkeypatch.setattr(ray, "init", lambda **kw: None)
    monkeypatch.setattr(serve, "start", lambda **kw: None)

    def deploy_failed(app, **kw):
        raise RuntimeError("Deploying application tpuscore failed: Failed to update the ...")

    traceback = (
        '\nRuntimeError: Traceback (most recent call last):\n  File "replica.py", line 1867\n'
        "FileNotFoundError: model path '/missing' does not exist"
    )
    replica = SimpleNamespace(message=traceback)
    app = SimpleNamespace(deployments={"Replica": replica})
    monkeypatch.setattr(serve, "run", deploy_failed)
    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications={"tpuscore": app}))
    argv = ["serve", "--model", "/missing", "--port", "0", "--replicas", "1"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the 'serving' line
    assert err == (
        "tpuscore: error: the replicas cannot start: "
        "FileNotFoundError: model path '/missing' does not exist"
    )
    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(applications={}))
    assert cli.main(argv) == 2  # no status to read: Serve's own message
    assert "Deploying application tpuscore failed" in capsys.readouterr().err


class Flaky:
    """A replica call that fails `failures` times with `error`, then answers."""

    def __init__(self, failures: int, error: Exception):
        self.failures, self.error, self.calls = failures, error, 0

    async def __call__(self):
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "answer"


@pytest.mark.parametrize(
    "error",
    [ray.exceptions.RayActorError(), ray.exceptions.ActorUnavailableError("gone", None)],
    ids=["died", "unavailable"],
)
def test_a_replica_failure_is_retried_once_then_refused(error):
    import asyncio

    run = asyncio.run
    assert run(ray_serve.with_retries(Flaky(0, error))) == ("answer", 1)
    flaky = Flaky(1, error)
    assert run(ray_serve.with_retries(flaky)) == ("answer", 2) and flaky.calls == 2
    flaky = Flaky(2, error)  # the retry fails too: no answer (the gateway's 503), no third try
    assert run(ray_serve.with_retries(flaky)) == (None, 2) and flaky.calls == 2
    # An error of the request's own is not retried: it would fail again, or score twice.
    flaky = Flaky(1, ValueError("bad"))
    with pytest.raises(ValueError):
        run(ray_serve.with_retries(flaky))
    assert flaky.calls == 1
