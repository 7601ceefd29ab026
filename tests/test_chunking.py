"""Chunked documents (docs/chunking.md): spans, exactness (each chunk's score equals scoring that
chunk alone, each document's score the aggregate of those), one request for every chunk of every
document, and the rerank endpoints' chunking and Cohere's max_chunks_per_doc."""

import httpx
import numpy as np
import pytest

from helpers import ServerThread
from tpuscore.api import templates
from tpuscore.api.chunking import Chunking
from tpuscore.api.errors import ValidationError
from tpuscore.tasks import chunking as chunked

CASE = "qwen2_bias"
LABELS = ["y", "n"]  # single bytes in the tests' tokenizer
TEMPLATE = templates.Template(
    name="test", query="{instruction}\nQuery: {query}\n", item="Document: {item}",
    item_suffix="\nRelevant:", labels=("y", "n"), default_instruction="Judge relevance.",
)  # fmt: skip
WORDS = ["the", "fox", "river", "mill", "park", "rope", "key", "moon", "salt", "ran", "past"]


def documents(rng, count, low, high):
    return [" ".join(rng.choice(WORDS, int(rng.integers(low, high)))) for _ in range(count)]


@pytest.fixture(scope="module")
def scorer(scorers):
    return scorers(CASE)


# -- spans and aggregation: no model ------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "options", "spans"),
    [
        (10, {"window": 4}, [(0, 4), (4, 8), (8, 10)]),
        (10, {"window": 4, "stride": 3}, [(0, 4), (3, 7), (6, 10)]),  # no chunk inside (6, 10)
        (8, {"window": 4, "stride": 2}, [(0, 4), (2, 6), (4, 8)]),
        (3, {"window": 4}, [(0, 3)]),
        (0, {"window": 4}, [(0, 0)]),
        (100, {"window": 10, "max_chunks": 2}, [(0, 10), (10, 20)]),
    ],
)
def test_spans(n, options, spans):
    assert Chunking.of(options).spans(n) == spans


def test_count_is_the_number_of_spans():
    for window in (1, 2, 5):
        for stride in range(1, window + 1):
            for max_chunks in (None, 1, 3):
                plan = Chunking(window=window, stride=stride, max_chunks=max_chunks)
                assert [plan.count(n) for n in range(30)] == [len(plan.spans(n)) for n in range(30)]


def test_tokens_bounds_the_chunks_tokens_and_is_exact_without_a_short_last_chunk():
    for window in (1, 2, 5):
        for stride in range(1, window + 1):
            for max_chunks in (None, 1, 3):
                plan = Chunking(window=window, stride=stride, max_chunks=max_chunks)
                for n in range(30):
                    held = sum(max(stop - start, 1) for start, stop in plan.spans(n))
                    assert plan.tokens(n) >= held
                    if (n - window) % stride == 0 or max_chunks == 1:
                        assert plan.tokens(n) == held, (window, stride, max_chunks, n)


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({}, "chunking.window"),
        ({"window": 0}, "chunking.window"),
        ({"window": 4, "stride": 5}, "chunking.stride"),
        ({"window": 4, "max_chunks": 0}, "chunking.max_chunks"),
        ({"window": 4, "aggregate": "median"}, "chunking.aggregate"),
        ({"window": 4, "overlap": 1}, "chunking.overlap"),
        ({"window": True}, "chunking.window"),
    ],
)
def test_bad_chunking_is_refused(options, param):
    with pytest.raises(ValidationError) as e:
        Chunking.of(options)
    assert (e.value.code, e.value.param) == ("invalid_chunking", param)


@pytest.mark.parametrize(("aggregate", "expected"), [("max", 0.9), ("mean", 0.5), ("first", 0.2)])
def test_reduce(aggregate, expected):
    score, best = Chunking(window=1, aggregate=aggregate).reduce(np.array([0.2, 0.9, 0.4]))
    assert score == pytest.approx(expected) and best == 1


def test_text_chunks_re_encode_to_the_documents_tokens(scorer, rng):
    doc = documents(rng, 1, 30, 40)[0]
    ids = scorer.tokenizer.encode(doc, add_special_tokens=False).ids
    chunks = chunked.split(
        scorer.tokenizer, [doc], Chunking(window=9, stride=6), limits=scorer.limits
    )
    assert chunks.spans == Chunking(window=9, stride=6).spans(len(ids))
    for text, (start, end) in zip(chunks.items, chunks.spans, strict=True):
        assert scorer.tokenizer.encode(text, add_special_tokens=False).ids == ids[start:end]
    # Without overlap the chunks are the document, cut.
    assert (
        "".join(
            chunked.split(scorer.tokenizer, [doc], Chunking(window=7), limits=scorer.limits).items
        )
        == doc
    )
    # A numpy column of documents is cut as its list is.
    column = chunked.split(
        scorer.tokenizer, np.array([doc]), Chunking(window=7), limits=scorer.limits
    )
    assert "".join(column.items) == doc


# -- exactness ------------------------------------------------------------------------------------


@pytest.mark.parametrize("aggregate", ["max", "mean", "first"])
def test_each_chunk_scores_as_alone_and_documents_aggregate_them(scorer, rng, aggregate):
    docs = documents(rng, 3, 5, 40)
    options = {"window": 11, "stride": 7, "max_chunks": 4, "aggregate": aggregate}
    query = "which passage is about a fox?"
    result = scorer.score(query, docs, labels=LABELS, chunking=options)
    chunks = chunked.split(scorer.tokenizer, docs, Chunking.of(options), limits=scorer.limits)
    assert len(result.chunks.logprobs) == len(chunks.items) > len(docs)
    for d in range(len(docs)):
        mine = [c for c, owner in zip(chunks.items, chunks.document, strict=True) if owner == d]
        alone = np.array([scorer.score(query, [c], labels=LABELS).label_probs[0, 0] for c in mine])
        np.testing.assert_allclose(result.chunk_scores[d], alone, rtol=1e-5, atol=1e-6)
        expected = {"max": alone.max(), "mean": alone.mean(), "first": alone[0]}[aggregate]
        assert result.scores[d] == pytest.approx(expected, rel=1e-5, abs=1e-6)
        assert result.best_chunk[d] == int(np.argmax(result.chunk_scores[d]))


def test_every_chunk_is_an_item_of_one_request(scorer, rng, monkeypatch):
    docs = documents(rng, 4, 20, 40)
    calls = []
    run = scorer.engine.run
    monkeypatch.setattr(
        scorer.engine, "run", lambda requests, **kw: calls.append(requests) or run(requests, **kw)
    )
    result = scorer.score("a query", docs, labels=LABELS, chunking={"window": 8})
    assert len(calls) == 1 and len(calls[0]) == 1  # one run, one request: the query once
    assert len(calls[0][0].items) == len(result.document) > 2 * len(docs)


def test_score_batch_takes_chunking_per_request_and_runs_them_together(scorer, rng, monkeypatch):
    """A `score_batch` request with `chunking` gets `score(chunking=)`'s result, one without
    gets `score`'s, in one engine run; an error in a chunk names its request and document."""
    docs = documents(rng, 2, 8, 30)
    options = {"window": 6, "stride": 4, "aggregate": "mean"}
    requests = [
        {"query": "a fox?", "items": docs, "labels": LABELS, "chunking": options},
        {"query": "salt", "items": docs[:1], "labels": LABELS},
        {"query": "the moon", "items": docs[::-1], "labels": LABELS, "chunking": None},
    ]
    runs = []
    run = scorer.engine.run
    monkeypatch.setattr(
        scorer.engine, "run", lambda requests, **kw: runs.append(requests) or run(requests, **kw)
    )
    chunked_result, plain, unchunked = scorer.score_batch(requests)
    assert len(runs) == 1 and len(runs[0]) == 3
    monkeypatch.undo()
    alone = scorer.score("a fox?", docs, labels=LABELS, chunking=options)
    np.testing.assert_allclose(chunked_result.scores, alone.scores, rtol=1e-5, atol=1e-6)
    assert chunked_result.best_chunk.tolist() == alone.best_chunk.tolist()
    assert chunked_result.best_span == alone.best_span
    for got, request in ((plain, requests[1]), (unchunked, requests[2])):
        expected = scorer.score(request["query"], request["items"], labels=LABELS)
        np.testing.assert_allclose(got.logprobs, expected.logprobs, rtol=1e-5, atol=1e-5)
    vocab = scorer.config.vocab_size
    bad = {"query": [9], "items": [[1, 2], [4, 5, 6, vocab]], "label_token_ids": [3, 4],
           "chunking": {"window": 2}}  # fmt: skip
    with pytest.raises(ValidationError) as e:
        scorer.score_batch([requests[1], bad])
    assert e.value.request_index == 1 and "chunk 1, tokens [2, 4] of items[1]" in str(e.value)
    bad_window = {**requests[0], "chunking": {"window": 0}}
    with pytest.raises(ValidationError) as e:
        scorer.score_batch([requests[1], bad_window])
    assert e.value.code == "invalid_chunking"
    assert e.value.loc == ("requests", 1, "chunking", "window")
    checked = scorer.validate_batch([requests[0], bad_window, bad])
    assert checked[0] is None and [e.request_index for e in checked[1:]] == [1, 2]
    # score's two halves take it too: prepare_request (or prepare_batch), then run
    halves = scorer.run([scorer.prepare_request(r) for r in requests])
    halves_batch = scorer.run(scorer.prepare_batch(requests))
    for result in (halves[0], halves_batch[0]):
        np.testing.assert_array_equal(result.scores, chunked_result.scores)
    for got, expected in zip(halves[1:], (plain, unchunked), strict=True):
        np.testing.assert_array_equal(got.logprobs, expected.logprobs)


def test_prepare_and_plan_take_chunking_as_score_does(scorer, rng):
    """`prepare(chunking=)` is the request of the documents' chunks, which `run` returns as
    `score(chunking=)` does; `plan(chunking=)` prices that request (it was refused as an
    unknown argument)."""
    docs = documents(rng, 3, 4, 25)
    options = {"window": 5, "stride": 3, "aggregate": "mean"}
    prepared = scorer.prepare("a fox?", docs, labels=LABELS, chunking=options)
    result = scorer.run([prepared])[0]
    alone = scorer.score("a fox?", docs, labels=LABELS, chunking=options)
    np.testing.assert_array_equal(result.scores, alone.scores)
    assert result.spans == alone.spans and len(prepared.request.items) == len(alone.spans)
    planned = scorer.plan("a fox?", docs, labels=LABELS, chunking=options)
    assert planned == scorer.plan("a fox?", prepared.chunks.items, labels=LABELS)
    assert planned != scorer.plan("a fox?", docs, labels=LABELS)


def test_an_error_in_a_chunk_names_its_document(scorer, rng):
    vocab = scorer.config.vocab_size
    docs = [[1, 2, 3], [4, 5, 6, 7, 8, vocab + 5]]  # the bad id is in chunk 1 of items[1]
    with pytest.raises(ValidationError) as e:
        scorer.score([9, 9], docs, label_token_ids=[3, 4], chunking={"window": 4})
    assert e.value.param == "items[1]" and "chunk 1, tokens [4, 6] of items[1]" in str(e.value)


def test_chunked_score_with_one_label_is_refused_as_rank_refuses_it(scorer, monkeypatch):
    """A chunk's score is the label's probability within the labels: with one label it is 1
    for every document, so it is refused (as `rank` refuses it) before anything runs."""
    monkeypatch.setattr(scorer.engine, "run", lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(ValidationError) as e:
        scorer.score(
            "a query", ["the fox ran past the mill"], labels=LABELS[:1], chunking={"window": 3}
        )
    assert (e.value.code, e.value.param) == ("invalid_argument", "labels")


def test_token_id_documents_are_cut_as_given(scorer, rng):
    vocab = scorer.config.vocab_size
    docs = [rng.integers(0, vocab, int(n)).tolist() for n in (5, 23)]
    query = rng.integers(0, vocab, 6).tolist()
    result = scorer.score(query, docs, label_token_ids=[3, 4], chunking={"window": 10})
    assert [tuple(s) for s in result.spans] == [(0, 5), (0, 10), (10, 20), (20, 23)]
    alone = scorer.score(query, [docs[1][10:20]], label_token_ids=[3, 4])
    np.testing.assert_allclose(result.chunks.logprobs[2], alone.logprobs[0], rtol=1e-5, atol=1e-6)


def test_token_id_documents_are_what_an_unchunked_item_takes(scorer):
    """A document is token ids where an item would be: an int array is (it was refused), bytes
    or a range are not (they were cut and scored as token ids, which score() refuses)."""
    options = {"label_token_ids": [3, 4], "chunking": {"window": 4}}
    as_list = scorer.score([9, 9], [[5, 6, 7, 8, 10]], **options)
    as_array = scorer.score([9, 9], [np.array([5, 6, 7, 8, 10])], **options)
    np.testing.assert_array_equal(as_array.scores, as_list.scores)
    for document in (b"\x05\x06\x07\x08\x0a", range(5, 10)):
        with pytest.raises(ValidationError) as e:
            scorer.score([9, 9], [document], **options)
        assert (e.value.code, e.value.param) == ("invalid_items", "items[0]"), document


def test_rank_with_a_template_ranks_documents_by_their_chunks(scorer, rng):
    docs = documents(rng, 4, 10, 40)
    query = "a fox by the river"
    options = {"window": 12, "aggregate": "max"}
    ranked = scorer.rank(query, docs, template=TEMPLATE, chunking=options, top_k=3)
    chunks = chunked.split(scorer.tokenizer, docs, Chunking.of(options), limits=scorer.limits)
    alone = scorer.rank(query, chunks.items, template=TEMPLATE)
    by_chunk = {r.index: r.score for r in alone}
    best = [
        max(by_chunk[i] for i in np.flatnonzero(chunks.document == d)) for d in range(len(docs))
    ]
    assert [r.index for r in ranked] == list(np.argsort(-np.array(best), kind="stable")[:3])
    for r in ranked:
        assert r.score == pytest.approx(best[r.index], rel=1e-5)
        assert r.item == docs[r.index]
        first = int(np.flatnonzero(chunks.document == r.index)[0])
        assert by_chunk[first + r.best_chunk] == pytest.approx(r.score, rel=1e-5)


# -- the rerank endpoints -----------------------------------------------------------------------


def test_rerank_endpoints_chunk_and_honour_max_chunks_per_doc(scorer, rng):
    from tpuscore.serving import app as server

    docs = documents(rng, 3, 15, 40)
    query = "about a fox"
    running = ServerThread(server.create_app(scorer, rerank_template=TEMPLATE))
    try:
        with httpx.Client(base_url=running.url, timeout=120) as client:
            chunking = {"window": 10, "stride": 8, "aggregate": "mean"}
            v1 = client.post("/v1/rerank", json={"query": query, "documents": docs,
                                                 "chunking": chunking})  # fmt: skip
            cohere = client.post("/v1/rerank", json={"query": query, "documents": docs,
                                 "max_tokens_per_doc": 6, "max_chunks_per_doc": 2})  # fmt: skip
            v2 = client.post("/v2/rerank", json={"query": query, "documents": docs,
                                                 "chunking": chunking})  # fmt: skip
            bad = client.post("/v1/rerank", json={"query": query, "documents": docs,
                              "chunking": {"window": 4, "stride": 9}})  # fmt: skip
    finally:
        running.stop()
    expected = scorer.rank(query, docs, template=TEMPLATE, chunking=chunking)
    for response in (v1, v2):
        assert response.status_code == 200, response.text
        results = response.json()["results"]
        assert [r["index"] for r in results] == [r.index for r in expected]
        for got, want in zip(results, expected, strict=True):
            assert got["relevance_score"] == pytest.approx(want.score, rel=1e-5)
            assert got["chunk"] == {
                "index": want.best_chunk, "start": want.best_span[0], "end": want.best_span[1]
            }  # fmt: skip
    want = scorer.rank(query, docs, template=TEMPLATE, chunking={"window": 6, "max_chunks": 2})
    assert cohere.status_code == 200, cohere.text
    got = cohere.json()["results"]
    assert [(r["index"], r["chunk"]["index"]) for r in got] == [
        (w.index, w.best_chunk) for w in want
    ]
    assert all(r["chunk"]["end"] <= 12 for r in got)  # two chunks of 6 tokens at most
    assert (bad.status_code, bad.headers["X-Error-Code"], bad.json()["error"]["param"]) == (
        400,
        "invalid_chunking",
        "chunking.stride",
    )


def test_max_chunks_per_doc_beside_a_query_that_fills_the_model_is_sequence_too_long(scorer):
    """Chunks sized to what fits beside the query: a query that leaves no room is refused as the
    request's own error (sequence_too_long), not as a negative chunking.window it never sent."""
    from fastapi.testclient import TestClient

    from tpuscore.serving import app as server

    query = "q" * scorer.config.max_position_embeddings
    with TestClient(server.create_app(scorer, rerank_template=TEMPLATE)) as client:
        answer = client.post(
            "/v1/rerank", json={"query": query, "documents": ["a b c"], "max_chunks_per_doc": 2}
        )
    assert answer.status_code == 400, answer.text
    assert answer.headers["X-Error-Code"] == "sequence_too_long", answer.text


def test_chunks_past_the_servers_max_items_are_refused(scorer):
    """Each chunk is an item: a one-token window over a long document is bounded by the server's
    max_items as that many documents would be, before anything is scored."""
    from fastapi.testclient import TestClient

    from tpuscore.api.requests import RequestLimits
    from tpuscore.serving import app as server

    limits = RequestLimits(max_items=8)
    app = server.create_app(scorer, rerank_template=TEMPLATE, limits=limits)
    body = {"query": "q", "documents": ["one two three four five six seven eight nine ten"]}
    with TestClient(app) as client:
        narrow = client.post("/v1/rerank", json={**body, "chunking": {"window": 1}})
        wide = client.post("/v1/rerank", json={**body, "chunking": {"window": 64}})
    assert narrow.status_code == 413, narrow.text
    assert narrow.headers["X-Error-Code"] == "too_many_items", narrow.text
    assert "chunks" in narrow.json()["error"]["message"]
    assert wide.status_code == 200, wide.text


def test_chunks_past_the_scorers_max_items_are_refused_before_they_are_built(scorer):
    """The library bounds chunks as the server does, from their count: a one-token window over a
    long text would build one piece per token only for the item count to refuse them."""
    from tpuscore import Scorer

    bounded = Scorer(scorer.config, scorer.params, scorer.tokenizer, limits={"max_items": 8})
    text = "one two three four five six seven eight nine ten"
    for call in (bounded.score, bounded.rank):
        with pytest.raises(ValidationError) as refused:
            call("q", [text], labels=LABELS, chunking={"window": 1})
        assert (refused.value.code, refused.value.param) == ("too_many_items", "items")
        assert "chunks, each an item; this scorer (Scorer(limits=...)" in str(refused.value)


def test_max_item_tokens_below_the_window_is_refused(scorer):
    """It would cut each chunk while best_span named the whole window; at or past the window it
    cuts nothing and is accepted."""
    text = "one two three four five six seven eight nine ten"
    for call in (scorer.score, scorer.rank):
        with pytest.raises(ValidationError) as refused:
            call("q", [text], labels=LABELS, chunking={"window": 8}, max_item_tokens=2)
        assert (refused.value.code, refused.value.param) == ("invalid_argument", "max_item_tokens")
    capped = scorer.score("q", [text], labels=LABELS, chunking={"window": 8}, max_item_tokens=8)
    plain = scorer.score("q", [text], labels=LABELS, chunking={"window": 8})
    np.testing.assert_array_equal(capped.scores, plain.scores)
