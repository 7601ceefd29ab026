"""The peers' shapes over real HTTP: vLLM's /score and /tokenize, /detokenize, Cohere v1's object
documents with rank_fields (through Cohere's own client) and vLLM's /rerank fields. Each answer
is checked against the in-process Scorer; the peers' own request/response assertions are ported
here, each citing the peer file it comes from.
"""

import json

import numpy as np
import pydantic
import pytest

from test_server import DOCS, MODEL_NAME, QUERY, TEMPLATE, client, error_of, post, scorer, url  # noqa: F401

# vLLM's ScoreResponse / ScoreResponseData fields (vllm/entrypoints/pooling/score/protocol.py).
VLLM_SCORE_KEYS = {"id", "object", "created", "model", "data", "usage"}


def relevance(model, query, docs):
    """The reranker score of each (query, doc) pair, as Scorer.rank gives it, in doc order."""
    ranked = model.rank(query, docs, template=TEMPLATE)
    scores = [0.0] * len(docs)
    for r in ranked:
        scores[r.index] = r.score
    return scores


def assert_vllm_scores(response, expected):
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == VLLM_SCORE_KEYS
    assert body["object"] == "list" and body["model"] == MODEL_NAME
    assert body["id"] is not None and isinstance(body["created"], int)
    assert [d["index"] for d in body["data"]] == list(range(len(expected)))
    assert all(d["object"] == "score" for d in body["data"])
    np.testing.assert_allclose([d["score"] for d in body["data"]], expected, rtol=1e-4, atol=1e-7)
    usage = body["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > 0
    return body


# From vLLM's tests/entrypoints/pooling/score/test_online_score.py: test_text_1_str_text_2_list
# (1:N), test_text_1_list_text_2_list (N:N, pairwise) and test_text_1_str_text_2_str (1:1), with
# len(data) and each score against an independent computation of the same pairs.
@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_vllm_text_1_text_2(client, scorer, path):  # noqa: F811
    text_1 = "What is the capital of France?"
    text_2 = ["The capital of Brazil is Brasilia.", "The capital of France is Paris."]
    body = {"model": MODEL_NAME, "text_1": text_1, "text_2": text_2}
    data = assert_vllm_scores(post(client, path, body), relevance(scorer, text_1, text_2))["data"]
    assert len(data) == 2

    text_1s = ["What is the capital of the United States?", "What is the capital of France?"]
    body = {"model": MODEL_NAME, "text_1": text_1s, "text_2": text_2}
    expected = [relevance(scorer, q, [d])[0] for q, d in zip(text_1s, text_2, strict=True)]
    assert len(assert_vllm_scores(post(client, path, body), expected)["data"]) == 2

    body = {"model": MODEL_NAME, "text_1": text_1, "text_2": text_2[1]}
    expected = relevance(scorer, text_1, [text_2[1]])
    assert len(assert_vllm_scores(post(client, path, body), expected)["data"]) == 1


def test_vllm_queries_documents(client, scorer):  # noqa: F811
    # vLLM's ScoreQueriesDocumentsRequest (vllm/entrypoints/pooling/score/protocol.py): the same
    # pairs as text_1/text_2 under the names queries/documents; a one-element list is one query.
    body = {"queries": [QUERY], "documents": DOCS}
    assert_vllm_scores(post(client, "/score", body), relevance(scorer, QUERY, DOCS))
    # ScoreDataRequest's data_1/data_2, the same again.
    data = {"data_1": QUERY, "data_2": DOCS}
    assert_vllm_scores(post(client, "/v1/score", data), relevance(scorer, QUERY, DOCS))
    # The score equals the relevance_score /v1/rerank gives the same pair.
    rerank = post(client, "/v1/rerank", {"query": QUERY, "documents": DOCS}).json()
    by_index = {r["index"]: r["relevance_score"] for r in rerank["results"]}
    scores = post(client, "/score", body).json()["data"]
    np.testing.assert_allclose(
        [d["score"] for d in scores], [by_index[i] for i in range(len(DOCS))], rtol=1e-6
    )


def test_sglang_score_is_unchanged_at_both_paths(client, scorer):  # noqa: F811
    request = {"query": "the fox", "items": [" jumps", " sleeps"], "label_token_ids": [5, 70]}
    expected = scorer.score(**request)
    for path in ("/v1/score", "/score"):
        response = post(client, path, request)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["object"] == "scoring"
        np.testing.assert_allclose(body["scores"], expected.scores, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize(
    ("body", "code", "param", "words"),
    [
        (
            {"query": "x", "items": ["a"], "text_1": "x"},
            "ambiguous_request",
            None,
            ["query", "text_1"],
        ),
        (
            {"queries": "x", "documents": ["a"], "items": ["b"]},
            "ambiguous_request",
            None,
            ["items", "queries", "documents"],
        ),
        ({"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "invalid_argument", "text_1", ["3"]),
        ({"text_1": "a"}, "invalid_argument", "text_2", ["required"]),
        ({"text_1": "a", "text_2": []}, "invalid_argument", "text_2", []),
        ({"text_1": "a", "text_2": ["b"], "foo": 1}, "unknown_field", "foo", []),
        ({"text_1": "a", "text_2": ["b"], "priority": 3}, "unsupported_field", "priority", []),
        ({"queries": "a", "documents": [1]}, "invalid_argument", "documents", []),
        # vLLM's queries/items shares `items` with SGLang's: told apart by no field, refused.
        ({"queries": "a", "items": ["b"]}, "ambiguous_request", None, ["items", "queries"]),
        ({"data_1": "a", "text_2": ["b"]}, "unknown_field", "text_2", []),
    ],
)
def test_vllm_score_errors(client, body, code, param, words):  # noqa: F811
    response = post(client, "/score", body)
    assert response.status_code == 400, response.text
    assert error_of(response) == (code, param), response.text
    assert all(w in response.json()["error"]["message"] for w in words), response.text


def test_library_errors_name_the_vllm_field(client):  # noqa: F811
    content = json.dumps({"text_1": "x", "text_2": ["a", "\ud800 b"]}).encode()
    response = client.post("/score", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert (error_of(response)[0], error_of(response)[1]) == ("invalid_text", "text_2[1]")
    # N:N: the index is the pair's, not its position among its query's documents.
    body = {"text_1": ["x", "y"], "text_2": ["a", "\ud800 b"]}
    content = json.dumps(body).encode()
    response = client.post("/score", content=content, headers={"content-type": "application/json"})
    assert (error_of(response)[0], error_of(response)[1]) == ("invalid_text", "text_2[1]")


# vLLM's /tokenize and /detokenize: tests/entrypoints/openai/test_tokenization.py asserts
# {"tokens": tokens, "count": len(tokens), "max_model_len": ..., "token_strs": None} for a
# prompt with and without add_special_tokens, and {"prompt": prompt} back from the tokens.
@pytest.mark.parametrize("add_special", [True, False])
def test_tokenize_and_detokenize(client, scorer, add_special):  # noqa: F811
    prompt = "vllm1 This is a test prompt."
    tokens = scorer.tokenizer.encode(prompt, add_special_tokens=add_special).ids
    response = post(
        client,
        "/tokenize",
        {"model": MODEL_NAME, "prompt": prompt, "add_special_tokens": add_special},
    )
    assert response.status_code == 200, response.text
    assert response.json() == {
        "tokens": tokens,
        "count": len(tokens),
        "max_model_len": scorer.config.max_position_embeddings,
        "token_strs": None,
    }
    response = post(client, "/detokenize", {"model": MODEL_NAME, "tokens": tokens})
    assert response.status_code == 200, response.text
    assert response.json() == {"prompt": scorer.tokenizer.decode(tokens, skip_special_tokens=False)}
    assert prompt in response.json()["prompt"]


def test_tokenize_token_strs_and_errors(client, scorer):  # noqa: F811
    body = post(client, "/tokenize", {"prompt": "the fox", "return_token_strs": True}).json()
    assert body["token_strs"] == scorer.tokenizer.encode("the fox").tokens
    vocab = scorer.config.vocab_size
    cases = [
        ("/detokenize", {"tokens": [1, vocab]}, "token_id_exceeds_vocab", "tokens"),
        ("/detokenize", {"tokens": [-1]}, "token_id_negative", "tokens"),
        ("/detokenize", {"tokens": "abc"}, "invalid_argument", "tokens"),
        ("/tokenize", {"prompt": 5}, "invalid_argument", "prompt"),
        ("/tokenize", {"messages": []}, "unknown_field", "messages"),
    ]
    for path, request, code, param in cases:
        response = post(client, path, request)
        assert response.status_code == 400, (path, request, response.text)
        assert (error_of(response)[0], error_of(response)[1]) == (code, param)


OBJECT_DOCS = [
    {"title": "Animals", "text": DOCS[0], "id": "a"},
    {"title": "Markets", "text": DOCS[1], "id": "b"},
    {"title": "Models", "text": DOCS[2], "id": "c"},
]


def test_cohere_v1_client_object_documents(url, scorer):  # noqa: F811
    cohere = pytest.importorskip("cohere")
    co = cohere.Client(base_url=url, api_key="unused", timeout=60)
    # Without rank_fields an object is ranked on its `text`, and returned whole.
    response = co.rerank(model=MODEL_NAME, query=QUERY, documents=OBJECT_DOCS, top_n=2)
    expected = scorer.rank(QUERY, [d["text"] for d in OBJECT_DOCS], template=TEMPLATE, top_k=2)
    assert [r.index for r in response.results] == [r.index for r in expected]
    np.testing.assert_allclose(
        [r.relevance_score for r in response.results], [r.score for r in expected], rtol=1e-4
    )
    for result in response.results:
        document = result.document.dict() if hasattr(result.document, "dict") else result.document
        assert {k: document[k] for k in OBJECT_DOCS[0]} == OBJECT_DOCS[result.index]
    # rank_fields: the named fields, in that order, as `name: value` lines.
    response = co.rerank(
        model=MODEL_NAME, query=QUERY, documents=OBJECT_DOCS, rank_fields=["title", "text"]
    )
    texts = [f"title: {d['title']}\ntext: {d['text']}" for d in OBJECT_DOCS]
    expected = scorer.rank(QUERY, texts, template=TEMPLATE)
    assert [r.index for r in response.results] == [r.index for r in expected]
    np.testing.assert_allclose(
        [r.relevance_score for r in response.results], [r.score for r in expected], rtol=1e-4
    )


def test_cohere_v2_client_text_documents(url, scorer):  # noqa: F811
    # v2 takes documents as strings: an object is sent as its YAML text, as Cohere advises.
    cohere = pytest.importorskip("cohere")
    co = cohere.ClientV2(base_url=url, api_key="unused", timeout=60)
    texts = [f"title: {d['title']}\ntext: {d['text']}" for d in OBJECT_DOCS]
    response = co.rerank(model=MODEL_NAME, query=QUERY, documents=texts)
    expected = scorer.rank(QUERY, texts, template=TEMPLATE)
    assert [r.index for r in response.results] == [r.index for r in expected]
    np.testing.assert_allclose(
        [r.relevance_score for r in response.results], [r.score for r in expected], rtol=1e-4
    )


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"query": "x", "documents": [{"title": "t"}]}, "invalid_documents", "documents[0]"),
        (
            {"query": "x", "documents": [{"text": "a"}], "rank_fields": ["title"]},
            "invalid_documents",
            "documents[0]",
        ),
        ({"query": "x", "documents": [{"text": 3}]}, "invalid_documents", "documents[0]"),
        ({"query": "x", "documents": [{}]}, "invalid_documents", "documents[0]"),
        ({"query": "x", "documents": ["a"], "rank_fields": []}, "invalid_argument", "rank_fields"),
    ],
)
def test_object_document_errors(client, body, code, param):  # noqa: F811
    response = post(client, "/v1/rerank", body)
    assert response.status_code == 400, response.text
    assert (error_of(response)[0], error_of(response)[1]) == (code, param)


def test_vllm_rerank_fields(client, scorer):  # noqa: F811
    # vLLM's RerankRequest (vllm/entrypoints/pooling/score/protocol.py) and
    # tests/entrypoints/pooling/score/test_online_rerank.py: query, documents, top_n (0: all),
    # with truncate_prompt_tokens, priority and use_activation at their defaults; each result
    # has index, relevance_score and document.text, sorted by relevance_score.
    body = {
        "model": MODEL_NAME,
        "query": QUERY,
        "documents": DOCS[:2],
        "top_n": 0,
        "truncate_prompt_tokens": None,
        "priority": 0,
        "use_activation": None,
    }
    response = post(client, "/rerank", body)
    assert response.status_code == 200, response.text
    rerank = response.json()
    assert rerank["id"] is not None and rerank["usage"]["total_tokens"] > 0
    assert len(rerank["results"]) == 2
    expected = scorer.rank(QUERY, DOCS[:2], template=TEMPLATE)
    assert [r["index"] for r in rerank["results"]] == [r.index for r in expected]
    assert [r["document"]["text"] for r in rerank["results"]] == [DOCS[r.index] for r in expected]
    scores = [r["relevance_score"] for r in rerank["results"]]
    assert scores == sorted(scores, reverse=True)


# -- errors in each peer's shape ----------------------------------------------------------------


class VllmErrorInfo(pydantic.BaseModel):
    """vLLM's ErrorInfo, as vllm/entrypoints/openai/protocol.py declares it."""

    model_config = pydantic.ConfigDict(extra="forbid", strict=True)
    message: str
    type: str
    param: str | None = None
    code: int


class VllmErrorResponse(pydantic.BaseModel):
    """vLLM's ErrorResponse (vllm/entrypoints/openai/protocol.py): `code` is the status."""

    model_config = pydantic.ConfigDict(extra="forbid", strict=True)
    error: VllmErrorInfo


class SglangErrorResponse(pydantic.BaseModel):
    """SGLang's ErrorResponse (python/sglang/srt/entrypoints/openai/protocol.py)."""

    model_config = pydantic.ConfigDict(extra="forbid", strict=True)
    object: str = "error"
    message: str
    type: str
    param: str | None = None
    code: int


class CohereError(pydantic.BaseModel):
    """Cohere's error body: its message (cohere's Python client raises ApiError(body=...))."""

    model_config = pydantic.ConfigDict(extra="forbid", strict=True)
    message: str


DIALECT_ERRORS = [
    # (path, body, status, peer model, tpuscore code)
    (
        "/v1/score",
        {"query": "x", "items": ["a"], "label_token_ids": [10**6]},
        400,
        SglangErrorResponse,
        "token_id_exceeds_vocab",
    ),
    (
        "/v1/score",
        {"query": "x", "items": ["a"] * 65, "label_token_ids": [1]},
        413,
        SglangErrorResponse,
        "too_many_items",
    ),
    (
        "/v1/score",
        {"query": "x", "items": ["a"], "foo": 1},
        400,
        SglangErrorResponse,
        "unknown_field",
    ),
    (
        "/v1/score",
        {"text_1": "x", "text_2": ["a"], "foo": 1},
        400,
        VllmErrorResponse,
        "unknown_field",
    ),
    ("/score", {"text_1": "x", "text_2": [1]}, 400, VllmErrorResponse, "invalid_argument"),
    ("/score", {"queries": "x", "documents": ["a"] * 65}, 413, VllmErrorResponse, "too_many_items"),
    (
        "/score",
        {"query": "x", "items": ["a"], "label_token_ids": [10**6]},
        400,
        SglangErrorResponse,
        "token_id_exceeds_vocab",
    ),
    ("/tokenize", {"prompt": 1}, 400, VllmErrorResponse, "invalid_argument"),
    ("/detokenize", {"tokens": [10**6]}, 400, VllmErrorResponse, "token_id_exceeds_vocab"),
    ("/rerank", {"query": "x", "documents": ["a", 3]}, 400, VllmErrorResponse, "invalid_documents"),
    (
        "/v1/rerank",
        {"query": "x", "documents": ["a"], "top_n": "x"},
        400,
        VllmErrorResponse,
        "invalid_argument",
    ),
    (
        "/v2/rerank",
        {"query": "x", "documents": ["a"], "top_n": -1},
        400,
        CohereError,
        "invalid_argument",
    ),
    ("/v2/rerank", {"query": "x", "documents": ["a"] * 65}, 413, CohereError, "too_many_items"),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "model", "code"),
    DIALECT_ERRORS,
    ids=[f"{c[0]}-{c[4]}" for c in DIALECT_ERRORS],
)
def test_each_dialect_answers_errors_in_its_shape(client, path, body, status, model, code):  # noqa: F811
    """An error parses as the peer's own error model (declared here from the peer's source,
    strict and closed), its status where the peer has one, tpuscore's code in X-Error-Code."""
    response = post(client, path, body)
    assert response.status_code == status, response.text
    error = model.model_validate(response.json())
    if isinstance(error, VllmErrorResponse):
        assert error.error.code == status and error.error.type and error.error.message
    elif isinstance(error, SglangErrorResponse):
        assert error.code == status and error.object == "error" and error.message
    assert response.headers["x-error-code"] == code
    assert error_of(response)[0] == code


def test_paths_outside_the_dialects_answer_tpuscore_errors(client):  # noqa: F811
    response = client.get("/nowhere")
    assert response.status_code == 404
    assert response.json()["code"] == "not_found" == response.headers["x-error-code"]
