"""`tpuscore serve` over real HTTP: a uvicorn server on 127.0.0.1 per module, driven by httpx and
by Cohere's own Python client. Every answer is checked against the in-process Scorer.
"""

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from starlette.routing import Route

from helpers import ServerThread, random_tokens
from tpuscore.api import templates
from tpuscore.serving import app as server

CASE = "qwen3_qknorm"
MODEL_NAME = "tiny-qwen3"
MAX_BODY_BYTES = 32 << 10
MAX_ITEMS = 64
TIMEOUT = httpx.Timeout(60.0)
DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "In the morning the market opens early.",
    "Rotary position embeddings rotate queries and keys.",
    "Children played in the park until the evening.",
    "The river ran past the old mill.",
]
QUERY = "Which passage is about a fox?"
# Each dialect's error keys (tpuscore.serving.dialects).
ERROR_KEYS = {
    "vllm": {"error"},
    "sglang": {"object", "message", "type", "param", "code"},
    "cohere": {"message"},
    "tpuscore": {"object", "message", "type", "param", "code"},
}
# The shipped templates' labels (" yes"/"yes") are several tokens in the tiny test tokenizer;
# this one's are single bytes. The server takes a Template as well as a name.
TEMPLATE = templates.Template(
    name="test",
    query="{instruction}\n\nQuery: {query}\n",
    item="Document: {item}",
    item_suffix="\nRelevant:",
    labels=("y", "n"),
    default_instruction="Judge whether the document is relevant to the query.",
)


async def boom(request):
    raise RuntimeError("a bug")


@pytest.fixture(scope="module")
def scorer(scorers):
    return scorers(CASE)


@pytest.fixture(scope="module")
def url(scorer):
    app = server.create_app(
        scorer,
        model_name=MODEL_NAME,
        rerank_template=TEMPLATE,
        max_body_bytes=MAX_BODY_BYTES,
        max_items=MAX_ITEMS,
    )
    app.router.routes.append(Route("/boom", boom, methods=["POST"]))
    running = ServerThread(app)
    yield running.url
    running.stop()


@pytest.fixture(scope="module")
def client(url):
    with httpx.Client(base_url=url, timeout=TIMEOUT) as c:
        yield c


def error_of(response):
    """(tpuscore's code, param) of an error answer in any dialect: the code from X-Error-Code,
    the param where the dialect's body has one."""
    body = response.json()
    param = body["error"]["param"] if set(body) == {"error"} else body.get("param")
    return response.headers["x-error-code"], param


def post(client, path, body):
    return client.post(path, json=body)


def random_request(rng, vocab, *, query=None):
    items = [random_tokens(rng, int(n), vocab) for n in rng.integers(1, 6, int(rng.integers(1, 4)))]
    return {
        "query": query if query is not None else random_tokens(rng, int(rng.integers(2, 9)), vocab),
        "items": items,
        "label_token_ids": random_tokens(rng, 2, vocab),
        "apply_softmax": bool(rng.integers(0, 2)),
    }


def assert_scores(response, expected):
    assert response.status_code == 200, response.text
    body = response.json()
    np.testing.assert_allclose(body["scores"], expected.scores, rtol=1e-4, atol=1e-7)
    return body


def test_score_equals_the_scorer(client, scorer, rng):
    vocab = scorer.config.vocab_size
    requests = [
        random_request(rng, vocab),
        {"query": "the fox", "items": [" jumps", " sleeps", ""], "label_token_ids": [5, 70, 80]},
        {"query": "the fox", "items": [" jumps"], "labels": ["x", "e"], "apply_softmax": True},
        {**random_request(rng, vocab), "item_first": True},
    ]
    for request in requests:
        body = assert_scores(post(client, "/v1/score", request), scorer.score(**request))
        assert body["object"] == "scoring" and body["model"] == MODEL_NAME
        assert len(body["scores"]) == len(request["items"])
        usage = body["usage"]
        assert usage["completion_tokens"] == 0
        assert usage["prompt_tokens"] == usage["total_tokens"] > 0
    # SGLang accepts one text item as a bare string, and its clients send `model`.
    request = {"query": "the fox", "items": " jumps", "label_token_ids": [5], "model": "default"}
    expected = scorer.score("the fox", [" jumps"], [5])
    assert_scores(post(client, "/v1/score", request), expected)


def expected_ranking(scorer, query, docs, **kwargs):
    return scorer.rank(query, docs, template=TEMPLATE, **kwargs)


def test_rerank_order_top_n_and_documents(client, scorer):
    response = post(client, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 3})
    assert response.status_code == 200, response.text
    body = response.json()
    expected = expected_ranking(scorer, QUERY, DOCS, top_k=3)
    results = body["results"]
    assert [r["index"] for r in results] == [r.index for r in expected]
    assert [r["document"]["text"] for r in results] == [DOCS[r.index] for r in expected]
    scores = [r["relevance_score"] for r in results]
    np.testing.assert_allclose(scores, [r.score for r in expected], rtol=1e-4, atol=1e-7)
    assert scores == sorted(scores, reverse=True)
    assert body["model"] == MODEL_NAME and body["id"] and body["usage"]["total_tokens"] > 0

    # /rerank: {"text": ...} documents, an instruction, no documents back, and top_n 0 (vLLM's
    # default), which returns every document.
    instruction = "Judge whether the passage names an animal."
    request = {
        "query": QUERY,
        "documents": [{"text": d} for d in DOCS],
        "instruction": instruction,
        "return_documents": False,
        "top_n": 0,
    }
    results = post(client, "/rerank", request).json()["results"]
    expected = expected_ranking(scorer, QUERY, DOCS, instruction=instruction)
    assert [r["index"] for r in results] == [r.index for r in expected]
    np.testing.assert_allclose(
        [r["relevance_score"] for r in results], [r.score for r in expected], rtol=1e-4, atol=1e-7
    )
    assert all("document" not in r for r in results)


def test_cohere_v2_client(url, scorer):
    cohere = pytest.importorskip("cohere")
    co = cohere.ClientV2(base_url=url, api_key="unused", timeout=60)
    query = QUERY
    response = co.rerank(model=MODEL_NAME, query=query, documents=DOCS, top_n=2)
    expected = expected_ranking(scorer, query, DOCS, top_k=2)
    assert [r.index for r in response.results] == [r.index for r in expected]
    np.testing.assert_allclose(
        [r.relevance_score for r in response.results], [r.score for r in expected], rtol=1e-4
    )
    assert response.meta.billed_units.input_tokens > 0
    # max_tokens_per_doc cuts each document to its own first 8 tokens.
    long_doc = " ".join(DOCS * 4)
    response = co.rerank(
        model=MODEL_NAME, query=query, documents=[long_doc, DOCS[0]], max_tokens_per_doc=8
    )
    tokenizer = scorer.tokenizer
    cut = [
        tokenizer.decode(tokenizer.encode(d, add_special_tokens=False).ids[:8])
        for d in (long_doc, DOCS[0])
    ]
    expected = expected_ranking(scorer, query, cut)
    np.testing.assert_allclose(
        sorted(r.relevance_score for r in response.results),
        sorted(r.score for r in expected),
        rtol=1e-4,
    )


def test_cohere_v1_client(url, scorer):
    cohere = pytest.importorskip("cohere")
    co = cohere.Client(base_url=url, api_key="unused", timeout=60)
    query = QUERY
    response = co.rerank(
        model=MODEL_NAME, query=query, documents=DOCS, top_n=3, return_documents=True
    )
    expected = expected_ranking(scorer, query, DOCS, top_k=3)
    assert [r.index for r in response.results] == [r.index for r in expected]
    assert [r.document.text for r in response.results] == [DOCS[r.index] for r in expected]


BAD_REQUESTS = [
    # (path, body or raw bytes, content type, status, code, param)
    ("/v1/score", b'{"query": "x", "items": [', "application/json", 400, "invalid_json", None),
    (
        "/v1/score",
        b"query=x",
        "application/x-www-form-urlencoded",
        400,
        "invalid_content_type",
        None,
    ),
    ("/v1/score", b"[1, 2]", "application/json", 400, "invalid_request", None),
    (
        "/v1/score",
        {"query": "x", "items": ["a"], "label_token_ids": [1], "foo": 1},
        None,
        400,
        "unknown_field",
        "foo",
    ),
    (
        "/v1/score",
        {"query": "x", "items": ["a"], "label_token_ids": [1], "return_pooled_hidden_states": True},
        None,
        400,
        "unsupported_field",
        "return_pooled_hidden_states",
    ),
    (
        "/v1/score",
        {"query": 5, "items": ["a"], "label_token_ids": [1]},
        None,
        400,
        "invalid_query",
        "query",
    ),
    (
        "/v1/score",
        {"query": "x", "items": {"a": 1}, "label_token_ids": [1]},
        None,
        400,
        "invalid_items",
        "items",
    ),
    (
        "/v1/score",
        {"query": "x", "items": ["a"], "label_token_ids": "1"},
        None,
        400,
        "invalid_label_token_ids",
        "label_token_ids",
    ),
    (
        "/v1/score",
        {"query": "x", "items": ["a"], "label_token_ids": [1], "apply_softmax": "yes"},
        None,
        400,
        "invalid_argument",
        "apply_softmax",
    ),
    (
        "/v1/score",
        {"query": "x", "items": ["a"], "label_token_ids": [10**6]},
        None,
        400,
        "token_id_exceeds_vocab",
        "label_token_ids",
    ),
    (
        "/v1/score",
        {"query": "x", "items": ["a"], "label_token_ids": []},
        None,
        400,
        "empty_label_token_ids",
        "label_token_ids",
    ),
    (
        "/v1/score",
        {"query": "\ud800 x", "items": ["a"], "label_token_ids": [1]},
        None,
        400,
        None,
        "query",
    ),
    (
        "/v1/score",
        {"query": "x", "items": ["a"] * (MAX_ITEMS + 1), "label_token_ids": [1]},
        None,
        413,
        "too_many_items",
        "items",
    ),
    (
        "/v1/rerank",
        {"query": "x", "documents": ["a", 3]},
        None,
        400,
        "invalid_documents",
        "documents[1]",
    ),
    (
        "/v1/rerank",
        {"query": "x", "documents": ["a"], "top_n": -1},
        None,
        400,
        "invalid_argument",
        "top_n",
    ),
    ("/v1/rerank", {"query": ["x"], "documents": ["a"]}, None, 400, "invalid_query", "query"),
    (
        "/v1/rerank",
        {"query": "x", "documents": ["a"], "return_documents": "no"},
        None,
        400,
        "invalid_argument",
        "return_documents",
    ),
    (
        "/v2/rerank",
        {"query": "x", "documents": ["a"], "return_documents": True},
        None,
        400,
        "unknown_field",
        "return_documents",
    ),
    (
        "/v2/rerank",
        {"query": "x", "documents": ["a"], "max_tokens_per_doc": 0},
        None,
        400,
        "invalid_argument",
        "max_tokens_per_doc",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "content_type", "status", "code", "param"),
    BAD_REQUESTS,
    ids=[f"{case[0]}-{case[4]}-{case[5]}" for case in BAD_REQUESTS],
)
def test_bad_requests_get_json_errors(client, path, body, content_type, status, code, param):
    if isinstance(body, bytes):
        response = client.post(path, content=body, headers={"content-type": content_type})
    else:  # ensure_ascii keeps a lone surrogate as its JSON escape
        content = json.dumps(body).encode()
        response = client.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()
    dialect = "vllm" if path in ("/score", "/v1/rerank", "/rerank", "/tokenize") else "sglang"
    dialect = "cohere" if path == "/v2/rerank" else dialect
    assert set(error) == ERROR_KEYS[dialect], (dialect, error)
    got_code, got_param = error_of(response)
    if dialect != "cohere":
        assert got_param == param
    if code is not None:
        assert got_code == code


def test_oversized_body_gets_413(client):
    big = {"query": "x" * MAX_BODY_BYTES, "items": ["a"], "label_token_ids": [1]}
    response = post(client, "/v1/score", big)
    assert response.status_code == 413
    assert error_of(response)[0] == "body_too_large"


def test_unknown_path_and_method_get_json_errors(client):
    response = client.get("/v2/score")
    assert response.status_code == 404 and error_of(response)[0] == "not_found"
    response = client.get("/v1/score")
    assert response.status_code == 405 and error_of(response)[0] == "method_not_allowed"


def test_concurrent_requests_equal_their_sequential_results(url, client, scorer, rng):
    vocab = scorer.config.vocab_size
    shared = random_tokens(rng, 10, vocab)
    requests = [random_request(rng, vocab, query=shared if i % 2 else None) for i in range(64)]
    expected = [scorer.score(**r) for r in requests]

    async def send_all():
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as c:
            return await asyncio.gather(*(c.post("/v1/score", json=r) for r in requests))

    responses = asyncio.run(asyncio.wait_for(send_all(), timeout=120))
    for response, want in zip(responses, expected, strict=True):
        assert_scores(response, want)
    assert client.get("/health").json()["status"] == "ok"


def test_a_template_that_does_not_fit_the_model_is_refused_at_start(scorer):
    # " yes" is three tokens in the tiny tokenizer: every rerank would fail, so no app.
    with pytest.raises(ValueError, match="multi_token_label|single tokens"):
        server.create_app(scorer, rerank_template="plain")
    with pytest.raises(ValueError, match="unknown"):
        server.create_app(scorer, rerank_template="nope")


def test_an_app_without_a_model_name_reports_the_scorers_model(scorer, checkpoint_dir):
    """An embedded app named the default model whatever it served (and, with adapters loaded,
    answered 404 to a request naming the model it had loaded); it is now the scorer's name, its
    `from_pretrained` model's."""
    name = checkpoint_dir(CASE).resolve().name
    assert scorer.model_name == name
    with TestClient(server.create_app(scorer, rerank_template=TEMPLATE)) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == name
        body = {"query": "x", "items": ["a"], "label_token_ids": [1], "model": name}
        response = client.post("/v1/score", json=body)
        assert response.status_code == 200 and response.json()["model"] == name


def test_a_bug_answers_500_and_the_server_stays_up(client):
    response = client.post("/boom", json={})
    assert response.status_code == 500
    assert error_of(response)[0] == "internal_error"
    assert client.get("/health").status_code == 200


def test_models_and_metrics(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL_NAME
    post(client, "/v1/score", {"query": "x", "items": ["a", "b"], "label_token_ids": [1]})
    post(client, "/v1/score", {"query": "x", "items": ["a"], "label_token_ids": [10**6]})
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/")
    text = response.text
    count = r'tpuscore_requests_total{endpoint="/v1/score",status="400"}'
    assert count in text
    assert 'tpuscore_requests_total{endpoint="/v1/score",status="200"}' in text
    assert 'tpuscore_request_seconds_bucket{endpoint="/v1/score",le="0.005"}' in text
    assert 'tpuscore_items_total{endpoint="/v1/score"}' in text
    assert "tpuscore_backend_picks_total{backend=" in text
    for series in ("executables_built_total", "executables_dropped_total", "memory_maps"):
        (value,) = [
            line.split()[1] for line in text.splitlines() if line.startswith(f"tpuscore_{series} ")
        ]
        assert float(value) >= (1 if series != "executables_dropped_total" else 0), series


def test_overload_gives_503_with_retry_after(scorer, rng):
    app = server.create_app(scorer, rerank_template=TEMPLATE, batcher_options={"max_pending": 1})
    running = ServerThread(app)
    try:
        vocab = scorer.config.vocab_size
        requests = [random_request(rng, vocab) for _ in range(48)]

        async def send_all():
            async with httpx.AsyncClient(base_url=running.url, timeout=TIMEOUT) as c:
                return await asyncio.gather(*(c.post("/v1/score", json=r) for r in requests))

        responses = asyncio.run(asyncio.wait_for(send_all(), timeout=120))
        statuses = [r.status_code for r in responses]
        assert set(statuses) <= {200, 503} and 503 in statuses, statuses
        for request, response in zip(requests, responses, strict=True):
            if response.status_code == 503:
                assert error_of(response)[0] == "overloaded"
                assert int(response.headers["retry-after"]) >= 1
            else:
                assert_scores(response, scorer.score(**request))
        with httpx.Client(base_url=running.url, timeout=TIMEOUT) as c:
            assert c.get("/health").status_code == 200
    finally:
        running.stop()


# -- deadlines, disconnects, hosts, nesting, truncation, drain (issue 25) -----------------------


class Held:
    """The scorer, its runs held while `gate` is clear and their queries recorded."""

    def __init__(self, scorer):
        self.scorer, self.gate, self.queries = scorer, threading.Event(), []
        self.running = threading.Event()

    def __getattr__(self, name):
        return getattr(self.scorer, name)

    def run(self, requests, *, backend=None):
        if requests:
            self.queries += [tuple(r.query) for r in requests]
            self.running.set()
            assert self.gate.wait(60)
        return self.scorer.run(requests, backend=backend)


def requests_counted(text: str, status: str) -> float:
    line = f'tpuscore_requests_total{{endpoint="/v1/score",status="{status}"}} '
    return sum(float(row[len(line) :]) for row in text.splitlines() if row.startswith(line))


def test_deadlines_and_disconnects_are_never_scored(scorer, rng):
    """A request past its X-Request-Timeout answers 504 and one whose client left is counted
    499 (never 500); neither is scored, though both waited behind a running batch."""
    held = Held(scorer)
    app = server.create_app(held, rerank_template=TEMPLATE, batcher_options={"max_wait_ms": 0})
    metrics, counted = app.state.service.metrics, {}
    answered, gone = metrics.answered, threading.Event()

    def answered_and_noted(path, status, seconds):  # the middleware counts an answer here
        answered(path, status, seconds)
        counted[status] = counted.get(status, 0) + 1
        if status == 499:
            gone.set()

    metrics.answered = answered_and_noted
    running = ServerThread(app)
    vocab = scorer.config.vocab_size
    first, late, left, bad = (random_request(rng, vocab) for _ in range(4))
    try:
        with httpx.Client(base_url=running.url, timeout=TIMEOUT) as c:
            bad_header = c.post("/v1/score", json=bad, headers={"X-Request-Timeout": "soon"})
            assert bad_header.status_code == 400, bad_header.text
            assert error_of(bad_header)[1] == "X-Request-Timeout"
            pool = ThreadPoolExecutor(4)
            blocker = pool.submit(c.post, "/v1/score", json=first)
            assert held.running.wait(60)
            expired = c.post("/v1/score", json=late, headers={"X-Request-Timeout": "0.3"})
            assert expired.status_code == 504 and error_of(expired)[0] == "deadline_exceeded"
            assert not blocker.done()  # answered while the batch it waited behind still ran
            with pytest.raises(httpx.TimeoutException):
                c.post("/v1/score", json=left, timeout=0.3)
            assert gone.wait(60), "the disconnect was not counted"
            assert not blocker.done()
            held.gate.set()
            assert_scores(blocker.result(60), scorer.score(**first))
            metrics = c.get("/metrics").text
    finally:
        held.gate.set()
        running.stop()
    assert tuple(late["query"]) not in held.queries and tuple(left["query"]) not in held.queries
    assert requests_counted(metrics, "500") == 0 and requests_counted(metrics, "504") == 1


def test_deep_nesting_is_invalid_json_not_a_500(client):
    deep = b"[" * 16_000 + b"]" * 16_000  # within the module server's 32 KiB
    nested = {"query": [[[1]]], "items": [[1]], "label_token_ids": [1]}
    for _ in range(40):
        nested = {"query": [nested]}
    for body in (deep, b'{"query": ' + b"[" * 5000, json.dumps(nested).encode()):
        response = client.post(
            "/v1/score", content=body, headers={"content-type": "application/json"}
        )
        assert response.status_code == 400, response.text[:200]
        assert error_of(response)[0] == "invalid_json"
    assert client.get("/health").status_code == 200


def test_v2_rerank_cuts_documents_to_fit_beside_the_query(client, scorer):
    """Cohere's v2 truncates each document to the room the query leaves; v1 without
    max_tokens_per_doc still refuses a document that cannot fit."""
    long_doc = "the fox " * 200  # 1,600 bytes: past the tiny model's 512 positions
    docs = [long_doc, DOCS[0]]
    v2 = post(client, "/v2/rerank", {"query": QUERY, "documents": docs})
    assert v2.status_code == 200, v2.text
    t = TEMPLATE
    room = (
        scorer.config.max_position_embeddings
        - len(scorer.tokenizer.encode(t.render_query(QUERY)).ids)
        - len(scorer.tokenizer.encode(t.item_suffix, add_special_tokens=False).ids)
    )
    expected = expected_ranking(scorer, QUERY, docs, max_item_tokens=room)
    got = {r["index"]: r["relevance_score"] for r in v2.json()["results"]}
    np.testing.assert_allclose(
        [got[r.index] for r in expected], [r.score for r in expected], rtol=1e-4, atol=1e-7
    )
    v1 = post(client, "/v1/rerank", {"query": QUERY, "documents": docs})
    assert v1.status_code == 400 and error_of(v1)[0] == "sequence_too_long"


def test_allowed_hosts_refuse_a_foreign_host_header(scorer):
    from tpuscore.serving import guards

    assert guards.default_allowed_hosts("127.0.0.1") == list(guards.LOOPBACK_HOSTS)
    assert guards.default_allowed_hosts("::1") == list(guards.LOOPBACK_HOSTS)
    assert guards.default_allowed_hosts("127.0.0.2") == [*guards.LOOPBACK_HOSTS, "127.0.0.2"]
    assert guards.default_allowed_hosts("0.0.0.0") is None
    assert (
        guards.host_name("[::1]:8000") == "::1" and guards.host_name("LocalHost:80") == "localhost"
    )
    foreign = ("evil.example", "evil.example:80", "127.0.0.1.evil.example")
    # (allowed_hosts, bind address, hosts answered, hosts refused). The default applies to
    # create_app used directly (it had no guard), and a server answers to the address it is
    # bound to (on 127.0.0.2 it refused its own Host header).
    cases = [
        (None, "127.0.0.1", ("localhost", "127.0.0.1", "[::1]:1"), foreign),
        (None, "127.0.0.2", ("127.0.0.2", "localhost"), (*foreign, "127.0.0.3")),
        (["scorer.internal"], "127.0.0.2", ("scorer.internal", "127.0.0.2"), ("localhost",)),
        (["*"], "127.0.0.1", foreign, ()),
    ]
    for allowed, bind, answered, refused in cases:
        app = server.create_app(scorer, rerank_template=TEMPLATE, allowed_hosts=allowed)
        running = ServerThread(app, host=bind)
        try:
            with httpx.Client(base_url=running.url, timeout=TIMEOUT) as c:
                assert c.get("/health").status_code == 200  # Host: the bind address and port
                for host in answered:
                    assert c.get("/health", headers={"host": host}).status_code == 200, host
                for host in refused:
                    response = c.post(
                        "/v1/score",
                        json={"query": [1], "items": [[2]], "label_token_ids": [3]},
                        headers={"host": host},
                    )
                    assert response.status_code == 400, (allowed, bind, host)
                    assert error_of(response)[0] == "invalid_host"
        finally:
            running.stop()


class PreparedBehindAGate:
    """The scorer, its requests' preparation (validation and tokenization, the Batcher's
    `prepare_request`) waiting for `gate`."""

    def __init__(self, scorer):
        self.scorer, self.entered, self.gate = scorer, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.scorer, name)

    def prepare_request(self, *args, **kwargs):
        self.entered.set()
        assert self.gate.wait(60)
        return self.scorer.prepare_request(*args, **kwargs)


def test_the_event_loop_serves_while_a_request_is_tokenized(scorer):
    """A request is validated and tokenized off the event loop: while one is held inside its
    tokenization, /health and another client's bad request are answered, in that order, before
    it; released, it gets its scores."""
    gated = PreparedBehindAGate(scorer)
    app = server.create_app(gated, rerank_template=TEMPLATE)
    running = ServerThread(app)
    body = {"query": "the fox", "items": [" jumps", " sleeps"], "label_token_ids": [5, 70]}
    try:
        with (
            httpx.Client(base_url=running.url, timeout=TIMEOUT) as c,
            ThreadPoolExecutor(1) as pool,
        ):
            held = pool.submit(c.post, "/v1/score", json=body)
            assert gated.entered.wait(60)
            assert c.get("/health").status_code == 200
            bad = c.post("/v1/score", content=b"{", headers={"content-type": "application/json"})
            assert error_of(bad)[0] == "invalid_json"
            assert not held.done()
            gated.gate.set()
            assert_scores(held.result(60), scorer.score(**body))
    finally:
        gated.gate.set()
        running.stop()


SERVE_SLOW = """
import asyncio, socket, sys, time
import uvicorn
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from tpuscore import Scorer
from tpuscore.api import templates
from tpuscore.serving import app as server

class Slow:  # each scoring run takes 1 s: requests are in flight when SIGTERM comes
    def __init__(self, scorer):
        self.scorer = scorer
    def __getattr__(self, name):
        return getattr(self.scorer, name)
    def run(self, requests, **kw):
        time.sleep(1.0)
        return self.scorer.run(requests, **kw)

template = templates.Template(
    name="t", query="{query}", item="{item}", item_suffix="", labels=("y", "n"),
    default_instruction="",
)
scorer = Scorer.from_pretrained(sys.argv[1], dtype="float32")
app = server.create_app(Slow(scorer), rerank_template=template, batcher_options={"max_wait_ms": 0})

async def pending(request):  # answers once the batcher holds at_least requests
    while app.state.service.batcher.pending < int(request.query_params["at_least"]):
        await asyncio.sleep(0.01)
    return PlainTextResponse(str(app.state.service.batcher.pending))

app.router.routes.append(Route("/pending", pending))
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen(64)  # connections wait in the backlog until uvicorn accepts them
print(sock.getsockname()[1], flush=True)
uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
"""


@pytest.mark.slow
def test_sigterm_drains_accepted_requests(checkpoint_dir, scorer, rng):
    """SIGTERM with four requests accepted (one running, three queued, 1 s a batch): each gets
    its exact answer, and the process exits."""
    import os
    import signal
    import subprocess
    import sys

    src = str(Path(__file__).resolve().parents[1] / "src")  # this checkout's tpuscore
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [sys.executable, "-c", SERVE_SLOW, str(checkpoint_dir(CASE))],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    vocab = scorer.config.vocab_size
    requests = [random_request(rng, vocab) for _ in range(4)]
    try:
        port = process.stdout.readline().strip()  # printed once the socket listens
        assert port.isdigit(), "no server"
        with (
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=TIMEOUT) as c,
            ThreadPoolExecutor(4) as pool,
        ):
            futures = [pool.submit(c.post, "/v1/score", json=r) for r in requests]
            # All four accepted: one batch running, the rest queued.
            assert c.get("/pending", params={"at_least": 4}).text == "4"
            process.send_signal(signal.SIGTERM)
            for future, request in zip(futures, requests, strict=True):
                assert_scores(future.result(60), scorer.score(**request))
        assert process.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.default_model
def test_serve_flags_set_the_deadline_and_the_allowed_hosts(default_model_path, monkeypatch):
    from tpuscore.cli import commands as cli
    from tpuscore.serving import guards

    served = []
    monkeypatch.setattr(server, "run", lambda app, **kwargs: served.append((app, kwargs)))
    for flags, hosts in (
        ([], None),  # AllowedHosts' default: the loopback names on a loopback address
        (["--allowed-hosts", "scorer.internal, 10.0.0.5"], ["scorer.internal", "10.0.0.5"]),
        (["--host", "0.0.0.0"], None),
    ):
        assert cli.main(["serve", "--request-timeout", "2.5", "--port", "0", *flags]) == 0
        app, _ = served.pop()
        batcher = app.state.service.batcher
        try:
            assert batcher.request_timeout_s == 2.5
            (guard,) = [m for m in app.user_middleware if m.cls is guards.AllowedHosts]
            assert guard.kwargs["hosts"] == hosts
        finally:
            batcher.close()


def test_max_tokens_per_doc_counts_the_documents_own_tokens(client, scorer):
    """Each document is cut to its own first max_tokens_per_doc tokens: at small values the
    template's words ("Document: ") were counted, and different documents scored the same."""
    docs = ["foxes jump over dogs", "rivers run past mills", "foxes jump under logs"]
    tokenizer = scorer.tokenizer
    for n in (1, 2, 3):
        cut = [
            tokenizer.decode(tokenizer.encode(d, add_special_tokens=False).ids[:n]) for d in docs
        ]
        assert all(d.startswith(c) for d, c in zip(docs, cut, strict=True))
        expected = {r.index: r.score for r in expected_ranking(scorer, QUERY, cut)}
        for path in ("/v1/rerank", "/v2/rerank"):
            body = {"query": QUERY, "documents": docs, "max_tokens_per_doc": n}
            response = post(client, path, body)
            assert response.status_code == 200, response.text
            got = {r["index"]: r["relevance_score"] for r in response.json()["results"]}
            np.testing.assert_allclose(
                [got[i] for i in range(3)], [expected[i] for i in range(3)], rtol=1e-4, atol=1e-7
            )
