"""`tpuscore serve` over real HTTP: a uvicorn server on 127.0.0.1 per module, driven by httpx and
by Cohere's own Python client. Every answer is checked against the in-process Scorer.
"""

import asyncio
import json
import socket
import threading
import time

import httpx
import numpy as np
import pytest
import uvicorn
from starlette.routing import Route

from helpers import random_tokens
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
ERROR_KEYS = {"object", "message", "type", "param", "code"}
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


class ServerThread:
    """uvicorn serving `app` from a thread, on a port the OS picked; stopped by `stop()`."""

    def __init__(self, app):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_keep_alive=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start within 30 s")
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the test server did not stop within 30 s"


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
    # max_tokens_per_doc truncates each document, as Scorer's max_item_tokens does.
    long_doc = " ".join(DOCS * 4)
    response = co.rerank(
        model=MODEL_NAME, query=query, documents=[long_doc, DOCS[0]], max_tokens_per_doc=8
    )
    expected = expected_ranking(scorer, query, [long_doc, DOCS[0]], max_item_tokens=8)
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
        400,
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
    assert set(error) == ERROR_KEYS and error["object"] == "error"
    assert error["param"] == param and error["message"]
    if code is not None:
        assert error["code"] == code


def test_oversized_body_gets_413(client):
    big = {"query": "x" * MAX_BODY_BYTES, "items": ["a"], "label_token_ids": [1]}
    response = post(client, "/v1/score", big)
    assert response.status_code == 413
    assert response.json()["code"] == "body_too_large"


def test_unknown_path_and_method_get_json_errors(client):
    response = client.get("/v2/score")
    assert response.status_code == 404 and response.json()["code"] == "not_found"
    response = client.get("/v1/score")
    assert response.status_code == 405 and response.json()["code"] == "method_not_allowed"


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


def test_a_bug_answers_500_and_the_server_stays_up(client):
    response = client.post("/boom", json={})
    assert response.status_code == 500
    assert response.json()["code"] == "internal_error"
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
                assert response.json()["code"] == "overloaded"
                assert int(response.headers["retry-after"]) >= 1
            else:
                assert_scores(response, scorer.score(**request))
        with httpx.Client(base_url=running.url, timeout=TIMEOUT) as c:
            assert c.get("/health").status_code == 200
    finally:
        running.stop()
