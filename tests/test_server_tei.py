"""TEI's (text-embeddings-inference's) /rerank and /tokenize over real HTTP, beside the other
peers' bodies on the same paths. Each answer is checked against the in-process Scorer; TEI's own
request/response assertions are ported here, each citing the TEI file it comes from
(github.com/huggingface/text-embeddings-inference).
"""

import itertools
import json
import threading

import numpy as np
import pytest
import scipy.special

import hf_reference
from test_server import DOCS, QUERY, TEMPLATE, client, post, scorer, url  # noqa: F401
from tpuscore.serving import tei

# TEI's Rank (router/src/http/types.rs): index, score, and text only with return_text.
RANK_KEYS = {"index", "score"}
# TEI's SimpleToken (router/src/http/types.rs).
TOKEN_KEYS = {"id", "text", "special", "start", "stop"}


def log_odds(model, query, texts, **kwargs):
    """log P(yes) - log P(no) per text under the template: the logit TEI's raw_scores gives,
    from the scorer's label log-probabilities (not from the server's code)."""
    t = TEMPLATE
    result = model.score(
        t.render_query(query),
        [t.render_item(text) for text in texts],
        labels=list(t.labels),
        item_suffix=t.item_suffix,
        **kwargs,
    )
    return result.logprobs[:, 0].astype(np.float64) - result.logprobs[:, 1]


def relevance(model, query, texts, **kwargs):
    scores = [0.0] * len(texts)
    for r in model.rank(query, texts, template=TEMPLATE, **kwargs):
        scores[r.index] = r.score
    return np.array(scores)


def test_tei_rerank_ties_and_return_text(client, scorer):  # noqa: F811
    # router/tests/test_http_rerank.rs (test_rerank): texts ["test", "other", "test"] with
    # return_text; the two equal texts come first, the later one first, with equal scores.
    request = {"query": "test", "texts": ["test", "other", "test"], "return_text": True}
    response = post(client, "/rerank", request)
    assert response.status_code == 200, response.text
    ranks = response.json()
    assert isinstance(ranks, list) and len(ranks) == 3
    assert all(set(r) == RANK_KEYS | {"text"} for r in ranks)
    expected = relevance(scorer, "test", request["texts"])
    order = [r["index"] for r in ranks]
    # The tie: index 2 right before index 0, equal scores (TEI sorts stably, then reverses).
    first = order.index(2)
    assert order[first + 1] == 0
    assert ranks[first]["score"] == ranks[first + 1]["score"]
    if expected[0] > expected[1]:
        assert order == [2, 0, 1]
    else:
        assert order == [1, 2, 0]
    assert [r["text"] for r in ranks] == [request["texts"][r["index"]] for r in ranks]
    np.testing.assert_allclose(
        [r["score"] for r in ranks], expected[[r["index"] for r in ranks]], rtol=1e-4, atol=1e-7
    )


def test_tei_rerank_scores_and_raw_scores(client, scorer):  # noqa: F811
    # docs/source/en/quick_tour.md (Re-rankers): query, texts and raw_scores false.
    response = post(client, "/rerank", {"query": QUERY, "texts": DOCS, "raw_scores": False})
    assert response.status_code == 200, response.text
    ranks = response.json()
    assert all(set(r) == RANK_KEYS for r in ranks)  # no text unless return_text
    assert sorted(r["index"] for r in ranks) == list(range(len(DOCS)))
    scores = [r["score"] for r in ranks]
    assert scores == sorted(scores, reverse=True)
    expected = relevance(scorer, QUERY, DOCS)
    np.testing.assert_allclose(scores, expected[[r["index"] for r in ranks]], rtol=1e-4, atol=1e-7)
    # raw_scores: the logits, whose sigmoid is the score, in the same order.
    raw = post(client, "/rerank", {"query": QUERY, "texts": DOCS, "raw_scores": True}).json()
    assert [r["index"] for r in raw] == [r["index"] for r in ranks]
    logits = log_odds(scorer, QUERY, DOCS)
    np.testing.assert_allclose(
        [r["score"] for r in raw], logits[[r["index"] for r in raw]], rtol=1e-4, atol=1e-5
    )
    np.testing.assert_allclose(scipy.special.expit([r["score"] for r in raw]), scores, rtol=1e-4)


@pytest.mark.parametrize("direction", ["right", "Left"])
def test_tei_rerank_truncate(client, scorer, direction):  # noqa: F811
    max_len = scorer.config.max_position_embeddings
    long_text = " ".join(DOCS * 40)  # past the model's positions beside the query
    texts = [long_text, DOCS[0]]
    refused = post(client, "/rerank", {"query": QUERY, "texts": texts})
    assert refused.status_code == 400, refused.text
    # TEI's error shape (router/src/http/types.rs ErrorResponse); tpuscore's code in the header.
    assert refused.headers["X-Error-Code"] == "sequence_too_long"
    assert refused.json()["error_type"] == "validation"
    assert refused.json()["error"].startswith("texts")
    request = {
        "query": QUERY,
        "texts": texts,
        "truncate": True,
        "truncation_direction": direction,
        "raw_scores": True,
    }
    response = post(client, "/rerank", request)
    assert response.status_code == 200, response.text
    # The room beside the query: the positions less the rendered query's and the suffix's.
    tokenizer = scorer.tokenizer
    query_tokens = len(tokenizer.encode(TEMPLATE.render_query(QUERY)).ids)
    suffix_tokens = len(tokenizer.encode(TEMPLATE.item_suffix, add_special_tokens=False).ids)
    room = max_len - query_tokens - suffix_tokens
    logits = log_odds(scorer, QUERY, texts, max_item_tokens=room, truncate=direction.lower())
    by_index = {r["index"]: r["score"] for r in response.json()}
    np.testing.assert_allclose([by_index[0], by_index[1]], logits, rtol=1e-4, atol=1e-5)


def test_tei_tokenize(client, scorer):  # noqa: F811
    # router/src/http/types.rs (TokenizeResponse's example): one input gives a list holding
    # one list of tokens {"id", "text", "special", "start", "stop"}.
    text = "test héllo wörld"
    response = post(client, "/tokenize", {"inputs": text})
    assert response.status_code == 200, response.text
    body = response.json()
    assert isinstance(body, list) and len(body) == 1
    tokens = body[0]
    assert all(set(t) == TOKEN_KEYS for t in tokens)
    assert [t["id"] for t in tokens] == scorer.tokenizer.encode(text).ids
    # Byte offsets (core/src/tokenization.rs into_tokens): each token's text is the input's
    # UTF-8 bytes it spans; the spans tile the input, a character split over byte tokens
    # repeating its span ("é" is two bytes, two tokens here, each spanning both bytes).
    data = text.encode()
    assert all(t["special"] is False for t in tokens)
    spans = list(dict.fromkeys((t["start"], t["stop"]) for t in tokens))
    assert spans[0][0] == 0 and spans[-1][1] == len(data)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert all(t["text"] == data[t["start"] : t["stop"]].decode() for t in tokens)
    accented = [t for t in tokens if t["text"] in ("é", "ö")]
    assert accented and all(t["stop"] - t["start"] == 2 for t in accented)
    # A batch.
    texts = ["the fox", "a dog"]
    body = post(client, "/tokenize", {"inputs": texts, "add_special_tokens": False}).json()
    assert [[t["id"] for t in ts] for ts in body] == [
        scorer.tokenizer.encode(t, add_special_tokens=False).ids for t in texts
    ]


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_tei_tokens_special(tmp_path, add_special_tokens):
    # A token the tokenizer adds (its special_tokens_mask, as TEI reads it) has its own text and
    # no offsets; the others span the input's bytes.
    tokenizer = hf_reference.train_tokenizer(tmp_path, add_bos=True)
    encoding = tokenizer.encode("the fox", add_special_tokens=add_special_tokens)
    tokens = tei.tokens_of(encoding, "the fox")
    assert tokens == [tei.TeiToken(**t).model_dump() for t in tokens]  # TEI's token, as declared
    bos = {"id": 0, "text": hf_reference.BOS, "special": True, "start": None, "stop": None}
    assert (tokens[0] == bos) is add_special_tokens
    rest = tokens[1:] if add_special_tokens else tokens
    assert [t["special"] for t in rest] == [False] * len(rest)
    assert "".join(t["text"] for t in rest) == "the fox"


def test_tei_and_other_shapes_told_apart(client, scorer):  # noqa: F811
    # The Cohere/Jina body still works on /rerank, vLLM's on /tokenize.
    cohere = post(client, "/rerank", {"query": QUERY, "documents": DOCS})
    assert cohere.status_code == 200 and "results" in cohere.json()
    vllm = post(client, "/tokenize", {"prompt": "the fox"})
    assert (
        vllm.status_code == 200 and vllm.json()["tokens"] == scorer.tokenizer.encode("the fox").ids
    )
    cases = [
        (
            "/rerank",
            {"query": "q", "texts": ["a"], "documents": ["a"]},
            "ambiguous_request",
            "texts",
        ),
        ("/tokenize", {"inputs": "a", "prompt": "a"}, "ambiguous_request", "inputs"),
        ("/rerank", {"query": "q", "texts": []}, "empty_documents", "texts"),
        ("/rerank", {"query": "q", "texts": "a"}, "invalid_argument", "texts"),
        ("/rerank", {"query": "q", "texts": ["a"], "top_n": 1}, "unknown_field", "top_n"),
        (
            "/rerank",
            {"query": "q", "texts": ["a"], "truncation_direction": "up"},
            "invalid_argument",
            "truncation_direction",
        ),
        (
            "/rerank",
            {"query": "q", "texts": ["a"], "raw_scores": "yes"},
            "invalid_argument",
            "raw_scores",
        ),
        ("/tokenize", {"inputs": []}, "invalid_argument", "inputs"),
        ("/tokenize", {"inputs": "a", "prompt_name": "query"}, "unsupported_field", "prompt_name"),
        ("/tokenize", {"inputs": ["a", "\ud800"]}, None, "inputs[1]"),
    ]
    for path, request, code, param in cases:
        content = json.dumps(request)  # ASCII escapes: the lone surrogate survives
        headers = {"content-type": "application/json"}
        response = client.post(path, content=content, headers=headers)
        assert response.status_code == 400, (path, request, response.text)
        body = response.json()
        if code == "ambiguous_request":  # neither shape: the path's own (vLLM's) error
            assert body["error"]["param"] == param, (request, body)
        else:  # TEI's error shape (router/src/http/types.rs ErrorResponse)
            assert set(body) == {"error", "error_type"}, (request, body)
            assert body["error_type"] == "validation" and param in body["error"], (request, body)
        if code is not None:
            assert response.headers["X-Error-Code"] == code, (request, body)


def test_tei_tokenize_counts_each_input_once_in_the_total_length(scorer):  # noqa: F811
    """RequestLimits' max_total_length bounds a TEI tokenize's inputs as sent, each counted once."""
    from fastapi.testclient import TestClient

    from tpuscore.api.requests import RequestLimits
    from tpuscore.serving import app as server

    limits = RequestLimits(max_length=8, max_total_length=10)
    with TestClient(server.create_app(scorer, rerank_template=TEMPLATE, limits=limits)) as c:
        within = c.post("/tokenize", json={"inputs": ["abcdef"]})
        assert within.status_code == 200, within.text
        over = c.post("/tokenize", json={"inputs": ["abcdef", "ghijk"]})
        assert over.status_code == 413 and over.headers["x-error-code"] == "request_too_large"


def test_tei_tokenize_answers_at_most_max_scores_tokens(scorer):  # noqa: F811
    """A TEI tokenize answer holds a JSON object per token: a body within the length bounds
    could make millions. Its tokens are bounded as a score answer's scores are (max_scores)."""
    from fastapi.testclient import TestClient

    from tpuscore.api.requests import RequestLimits
    from tpuscore.serving import app as server

    text = "the quick brown fox"
    count = len(scorer.tokenizer.encode(text).ids)
    limits = RequestLimits(max_scores=2 * count)
    with TestClient(server.create_app(scorer, rerank_template=TEMPLATE, limits=limits)) as c:
        within = c.post("/tokenize", json={"inputs": [text, text]})
        over = c.post("/tokenize", json={"inputs": [text, text, text]})
    assert within.status_code == 200 and sum(map(len, within.json())) == 2 * count
    assert over.status_code == 413 and over.headers["x-error-code"] == "request_too_large"
    assert "--max-scores" in over.json()["error"], over.text


class TokenizerBehindAGate:
    """A tokenizer whose encode waits for `gate` (having set `entered`)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.gate, self.entered = tokenizer, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def encode(self, *args, **kwargs):
        self.entered.set()
        assert self.gate.wait(60)
        return self.tokenizer.encode(*args, **kwargs)

    def encode_batch(self, *args, **kwargs):
        self.entered.set()
        assert self.gate.wait(60)
        return self.tokenizer.encode_batch(*args, **kwargs)


class GatedTokenizer:
    """The scorer, its `tokenizer` behind a gate."""

    def __init__(self, served):
        self.scorer, self.tokenizer = served, TokenizerBehindAGate(served.tokenizer)

    def __getattr__(self, name):
        return getattr(self.scorer, name)


def assert_served_while_tokenizing(served, path, body, template):
    """POST body to path on a server whose tokenizer is held: /health is answered meanwhile
    (the tokenizing runs off the event loop), then the request once released."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from helpers import ServerThread
    from tpuscore.serving import app as server

    gated = GatedTokenizer(served)
    running = ServerThread(server.create_app(gated, rerank_template=template))
    try:
        with httpx.Client(base_url=running.url, timeout=60) as c, ThreadPoolExecutor(1) as pool:
            held = pool.submit(c.post, path, json=body)
            assert gated.tokenizer.entered.wait(60)
            assert c.get("/health", timeout=10).status_code == 200
            assert not held.done()
            gated.tokenizer.gate.set()
            assert held.result(60).status_code == 200
    finally:
        gated.tokenizer.gate.set()
        running.stop()


@pytest.mark.parametrize("body", [{"inputs": ["a long text"]}, {"prompt": "a long text"}])
def test_tokenize_runs_off_the_event_loop(scorer, body):  # noqa: F811
    """TEI's and vLLM's /tokenize tokenize in a worker thread: while one is held inside its
    tokenizer, /health is answered (a large tokenize takes seconds of CPU)."""
    assert_served_while_tokenizing(scorer, "/tokenize", body, TEMPLATE)
