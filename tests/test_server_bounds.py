"""Every dimension of a request is bounded (`RequestLimits`), and a request past a bound is
refused with 413 and its code before any tokenization or batcher work: the server's tokenizer
and its batcher are watched, and a refused request touches neither.
"""

import json
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import ServerThread
from test_server import TEMPLATE, Held, error_of
from tpuscore.api import bounds, tokenization
from tpuscore.api.errors import ValidationError
from tpuscore.api.requests import RequestLimits
from tpuscore.serving import app as server
from tpuscore.serving.batcher import Batcher

CASE = "qwen3_qknorm"
LIMITS = RequestLimits(
    max_items=4, max_labels=3, max_scores=8, max_length=40, max_total_length=100, max_queries=2
)
LONG = "x" * (LIMITS.max_length + 1)
MID = "y" * 30  # within max_length; four of them pass max_total_length


class CountingTokenizer:
    """The scorer's tokenizer, its calls counted."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0

    def __getattr__(self, name):
        attribute = getattr(self.tokenizer, name)
        if name.startswith(("encode", "decode")):

            def counted(*args, **kwargs):
                self.calls += 1
                return attribute(*args, **kwargs)

            return counted
        return attribute


class Watched:
    """The scorer, its tokenizer counted once the app is built."""

    def __init__(self, scorer):
        self.scorer, self.tokenizer = scorer, scorer.tokenizer

    def __getattr__(self, name):
        return getattr(self.scorer, name)


class RecordingBatcher(Batcher):
    """A Batcher that records each request handed to it."""

    def __init__(self, scorer, **options):
        super().__init__(scorer, **options)
        self.requests = []

    async def score_async(self, **kwargs):
        self.requests.append(kwargs)
        return await super().score_async(**kwargs)


@pytest.fixture(scope="module")
def watched(scorers):
    return Watched(scorers(CASE))


@pytest.fixture(scope="module")
def batcher(watched):
    with RecordingBatcher(watched.scorer, max_pending=3) as b:
        yield b


@pytest.fixture(scope="module")
def client(watched, batcher):
    app = server.create_app(watched, rerank_template=TEMPLATE, limits=LIMITS, batcher=batcher)
    watched.tokenizer = CountingTokenizer(watched.scorer.tokenizer)
    running = ServerThread(app)
    with httpx.Client(base_url=running.url, timeout=60) as c:
        yield c
    running.stop()


SCORE = {"query": "q", "label_token_ids": [1]}


def cohere_less(path, param):
    """The param an error body names: Cohere's error is a message alone."""
    return None if path == "/v2/rerank" else param


BLOCKER = {"query": [1, 2, 3], "items": [[4]], "label_token_ids": [5]}
REFUSED = [
    # (path, body, code, param)
    ("/v1/score", {**SCORE, "items": ["a"] * 5}, "too_many_items", "items"),
    ("/v1/score", {**SCORE, "items": [[1]] * 5}, "too_many_items", "items"),
    (
        "/v1/score",
        {**SCORE, "items": ["a"], "label_token_ids": [1] * 4},
        "too_many_labels",
        "labels",
    ),
    ("/v1/score", {**SCORE, "items": ["a"], "labels": ["a"] * 4}, "too_many_labels", "labels"),
    # Labels repeated count each time: each is a column of the answer.
    (
        "/v1/score",
        {**SCORE, "items": ["a"] * 3, "label_token_ids": [1, 1, 1]},
        "too_many_scores",
        "items",
    ),
    ("/v1/score", {**SCORE, "items": ["a", LONG]}, "input_too_long", "items[1]"),
    ("/v1/score", {**SCORE, "items": [[1], [2] * 41]}, "input_too_long", "items[1]"),
    ("/v1/score", {**SCORE, "items": "a", "query": LONG}, "input_too_long", "query"),
    ("/v1/score", {**SCORE, "items": "a", "query": [1] * 41}, "input_too_long", "query"),
    (
        "/v1/score",
        {"query": "q", "items": ["a"], "labels": ["a", LONG]},
        "input_too_long",
        "labels[1]",
    ),
    ("/v1/score", {**SCORE, "items": [MID] * 4}, "request_too_large", None),
    ("/v1/rerank", {"query": "q", "documents": ["a"] * 5}, "too_many_items", "documents"),
    (
        "/v1/rerank",
        {"query": "q", "documents": ["a", {"text": LONG}]},
        "input_too_long",
        "documents[1]",
    ),
    (
        "/v1/rerank",
        {"query": "q", "documents": ["a"], "instruction": LONG},
        "input_too_long",
        "instruction",
    ),
    ("/rerank", {"query": LONG, "documents": ["a"]}, "input_too_long", "query"),
    ("/v2/rerank", {"query": "q", "documents": [MID] * 4}, "request_too_large", None),
    ("/v2/rerank", {"query": "q", "documents": ["a", LONG]}, "input_too_long", "documents[1]"),
    ("/score", {"text_1": "q", "text_2": ["a"] * 5}, "too_many_items", "text_2"),
    ("/score", {"queries": ["q", LONG], "documents": ["a", "b"]}, "input_too_long", "queries[1]"),
    ("/score", {"data_1": "q", "data_2": ["a", LONG]}, "input_too_long", "data_2[1]"),
    ("/tokenize", {"prompt": LONG}, "input_too_long", "prompt"),
    ("/detokenize", {"tokens": [1] * 41}, "input_too_long", "tokens"),
]


@pytest.mark.parametrize(("path", "body", "code", "param"), REFUSED, ids=lambda v: str(v)[:20])
def test_a_request_past_a_bound_is_refused_before_any_work(
    client, watched, batcher, path, body, code, param
):
    calls, handed = watched.tokenizer.calls, len(batcher.requests)
    response = client.post(path, json=body)
    assert response.status_code == 413, response.text
    assert error_of(response) == (code, cohere_less(path, param)), response.text
    assert watched.tokenizer.calls == calls and len(batcher.requests) == handed


def test_a_request_at_every_bound_is_served(client, batcher):
    """The bounds are inclusive: a request at each of them is scored."""
    handed = len(batcher.requests)
    at_bounds = {"query": "q", "items": ["a", "b"], "labels": ["a", "b", "c"]}
    assert client.post("/v1/score", json=at_bounds).status_code == 200
    ids = {"query": [1] * 40, "items": [[2] * 15] * 4, "label_token_ids": [1, 2]}
    assert client.post("/v1/score", json=ids).status_code == 200
    docs = {"query": "q", "documents": ["d" * 40, "e"]}
    assert client.post("/v2/rerank", json=docs).status_code == 200
    assert len(batcher.requests) == handed + 3


def test_the_reported_request_is_refused_cheaply(client):
    """The issue's 100 KB request of 32 items x 50,000 label ids answered 33.6 MB and took
    505 MiB; at the default limits it is refused by its label count, and the answer is short."""
    labels = [3] * 50_000
    with pytest.raises(ValidationError) as refused:
        bounds.check_size(
            RequestLimits(),
            items=("items", [[2]] * 32),
            values={"query": [1], "label_token_ids": labels},
            num_labels=bounds.label_count(None, labels),
        )
    assert refused.value.code == "too_many_labels"
    body = {"query": [1], "items": [[2]] * 2, "label_token_ids": labels}
    response = client.post("/v1/score", json=body)
    assert response.status_code == 413 and error_of(response)[0] == "too_many_labels"
    assert len(response.content) < 1024


HUGE = "z" * 20_000
ECHOED = [
    # (path, body, headers): each refused, each carrying HUGE where the message could echo it
    ("/v1/score", {**SCORE, "items": {"a": HUGE}}, {}),
    ("/v1/score", {**SCORE, "items": ["a"], "label_token_ids": HUGE}, {}),
    ("/v1/score", {**SCORE, "items": ["a"], "labels": {"a": HUGE}}, {}),
    ("/v1/score", {**SCORE, "items": ["a"], "apply_softmax": HUGE}, {}),
    ("/v1/score", {**SCORE, "items": ["a"], HUGE: 1}, {}),
    ("/v1/score", {**SCORE, "items": ["a"], "model": [HUGE]}, {}),
    ("/v1/score", {**SCORE, "items": ["a"]}, {"X-Request-Timeout": HUGE}),
    ("/v1/score", {**SCORE, "items": ["a"]}, {"Content-Type": "text/" + HUGE}),
    ("/v1/rerank", {"query": "q", "documents": [{"text": 1, "x": HUGE}]}, {}),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": HUGE}, {}),
    ("/score", {"text_1": [HUGE, 1], "text_2": ["a", "b"]}, {}),
    ("/detokenize", {"tokens": [HUGE]}, {}),
]


@pytest.mark.parametrize(("path", "body", "headers"), ECHOED, ids=lambda v: str(v)[:30])
def test_an_error_cuts_the_values_it_shows(client, path, body, headers):
    """An error names the refused value cut (`short`): its body stays small whatever was sent."""
    response = client.post(path, json=body, headers=headers)
    assert 400 <= response.status_code < 500, response.text[:300]
    assert len(response.content) < 1500, response.text[:300]


def test_short_bounds_any_value():
    import numpy as np

    from tpuscore.api.messages import short

    nested: list = [HUGE]
    for _ in range(500):
        nested = [nested, HUGE]
    for value in (HUGE, [HUGE] * 1000, {HUGE: HUGE}, nested, np.arange(10**6), 10**4000 - 1):
        assert len(short(value)) <= 1500
    assert short("abc") == "'abc'" and short([1, 2]) == "[1, 2]"


LONE = "a\ud800b"  # a lone surrogate: JSON and Python carry it, UTF-8 cannot
INVALID_TEXT = [
    # (path, body, param): every text field of every endpoint
    ("/v1/score", {**SCORE, "query": LONE, "items": ["a"]}, "query"),
    ("/v1/score", {**SCORE, "items": ["a", LONE]}, "items[1]"),
    ("/v1/score", {"query": "q", "items": ["a"], "labels": ["a", LONE]}, "labels[1]"),
    ("/v1/rerank", {"query": LONE, "documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": ["a", {"text": LONE}]}, "documents[1]"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "instruction": LONE}, "instruction"),
    (
        "/v1/rerank",
        {"query": "q", "documents": [{"t": LONE}], "rank_fields": ["t"]},
        "documents[0]",
    ),
    ("/rerank", {"query": LONE, "documents": ["a"]}, "query"),
    ("/v2/rerank", {"query": LONE, "documents": ["a"]}, "query"),
    ("/v2/rerank", {"query": "q", "documents": [LONE]}, "documents[0]"),
    ("/v2/rerank", {"query": "q", "documents": ["a"], "instruction": LONE}, "instruction"),
    ("/score", {"text_1": LONE, "text_2": ["a"]}, "text_1"),
    ("/score", {"queries": ["q", "r"], "documents": ["a", LONE]}, "documents[1]"),
    ("/v1/score", {"data_1": ["q", LONE], "data_2": ["a", "b"]}, "data_1[1]"),
    ("/tokenize", {"prompt": LONE}, "prompt"),
]


@pytest.mark.parametrize(("path", "body", "param"), INVALID_TEXT, ids=lambda v: str(v)[:24])
def test_invalid_text_is_refused_before_it_is_tokenized(client, watched, path, body, param):
    """A lone surrogate in any text field is 400 invalid_text naming it, never a 500 from the
    tokenizer (/v2/rerank tokenized its query first and answered 500)."""
    calls = watched.tokenizer.calls
    response = client.post(
        path, content=json.dumps(body), headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assert error_of(response) == ("invalid_text", cohere_less(path, param)), response.text
    assert watched.tokenizer.calls == calls


def test_an_nn_score_is_admitted_whole_or_refused_once(scorers):
    """vLLM's N:N /score runs a batcher request per distinct query. More distinct queries than
    max_pending is 413 too_many_queries, once (it was 503, retried forever on an idle server);
    when the queue has room for only some, the request is 503 and the admitted ones are
    dropped, never scored for nobody."""
    scorer = scorers(CASE)
    held = Held(scorer)
    app = server.create_app(
        held, rerank_template=TEMPLATE, batcher_options={"max_pending": 2, "max_wait_ms": 0}
    )
    running = ServerThread(app)
    queries = ["first query", "second query", "third query"]
    rendered = {
        tuple(tokenization.encode_query(scorer.tokenizer, TEMPLATE.render_query(q)))
        for q in queries
    }
    try:
        with httpx.Client(base_url=running.url, timeout=60) as c:
            three = {"queries": queries, "documents": ["a", "b", "c"]}
            refused = c.post("/score", json=three)
            assert refused.status_code == 413, refused.text
            assert (error_of(refused)[0], error_of(refused)[1]) == (
                "too_many_queries",
                "queries",
            )
            assert held.queries == []
            with ThreadPoolExecutor(1) as pool:
                blocker = pool.submit(c.post, "/v1/score", json=BLOCKER)
                assert held.running.wait(60)  # one request running: room for one more
                two = {"queries": queries[:2], "documents": ["a", "b"]}
                overloaded = c.post("/score", json=two)
                assert overloaded.status_code == 503, overloaded.text
                # Dropped before the answer, not when uvicorn reports the connection done.
                assert app.state.service.batcher.pending == 1
                held.gate.set()
                assert blocker.result(60).status_code == 200
            # A request after: the worker has passed anything the N:N request left queued.
            assert c.post("/v1/score", json=BLOCKER).status_code == 200
    finally:
        held.gate.set()
        running.stop()
    assert held.queries and not rendered & set(held.queries), held.queries


def test_the_servers_queue_is_bounded_in_tokens_unless_told_otherwise(scorers):
    """--max-pending alone let 1024 bodies of 16 MiB queue: the server's batcher also bounds
    the tokens it holds queued, by default and as given."""
    bounded = server.create_app(scorers(CASE), rerank_template=TEMPLATE)
    given = server.create_app(
        scorers(CASE), rerank_template=TEMPLATE, batcher_options={"max_queued_tokens": 5}
    )
    batchers = [app.state.service.batcher for app in (bounded, given)]
    for batcher in batchers:
        batcher.close()
    assert [b.max_queued_tokens for b in batchers] == [server.DEFAULT_MAX_QUEUED_TOKENS, 5]


# -- a property: answers and memory bounded by the request's size ------------------------------

# The stated bounds (docs/serving.md, "Request size bounds"): an answer is at most
# ANSWER_BASE + ANSWER_PER_SCORE bytes per score it holds, and an error at most ERROR_BYTES,
# whatever the request; the Python memory a request takes to answer is at most
# MEMORY_BASE + MEMORY_PER_BYTE per byte of its body.
ANSWER_BASE, ANSWER_PER_SCORE, ERROR_BYTES = 512, 32, 1500
MEMORY_BASE, MEMORY_PER_BYTE = 4 << 20, 64


@st.composite
def score_requests(draw):
    """/v1/score bodies inside and past LIMITS: items, labels and lengths drawn on both sides of
    every bound (token ids, so the model's shapes stay few)."""
    ids = st.integers(1, 60)
    n_items = draw(st.sampled_from([1, 2, LIMITS.max_items, LIMITS.max_items + 1, 200]))
    n_labels = draw(st.sampled_from([1, 2, LIMITS.max_labels, LIMITS.max_labels + 1, 20_000]))
    length = draw(st.sampled_from([1, 3, LIMITS.max_length + 1]))
    return {
        "query": draw(st.lists(ids, min_size=1, max_size=4)),
        "items": [[draw(ids)] * length for _ in range(n_items)],
        "label_token_ids": [draw(ids)] * n_labels,
        "apply_softmax": draw(st.booleans()),
    }


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=score_requests())
def test_answers_and_memory_are_bounded_by_the_request(client, body):
    content = json.dumps(body).encode()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        response = client.post(
            "/v1/score", content=content, headers={"content-type": "application/json"}
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    scores = len(body["items"]) * len(body["label_token_ids"])
    if response.status_code == 200:
        assert scores <= LIMITS.max_scores
        assert len(response.content) <= ANSWER_BASE + ANSWER_PER_SCORE * scores
    else:
        assert response.status_code in (400, 413), response.text
        assert len(response.content) <= ERROR_BYTES
    assert peak <= MEMORY_BASE + MEMORY_PER_BYTE * len(content), (peak, len(content))
