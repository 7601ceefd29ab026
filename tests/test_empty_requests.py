"""A request with no items, through every door (docs/serving.md#empty-requests): the library and
the score endpoints answer an empty result, checked in full first; the rerank endpoints refuse an
empty document list with `empty_documents` (400), as Cohere's and TEI's APIs do. For a causal LM
and a classification model."""

import httpx
import numpy as np
import pytest

from helpers import ServerThread
from test_server import ERROR_KEYS, TEMPLATE
from tpuscore import ValidationError
from tpuscore.serving import app as server

CASES = ("qwen3_qknorm", "qwen3_seq_cls")


def label_options(case):
    return {} if case.endswith("seq_cls") else {"label_token_ids": [5, 6]}


@pytest.fixture(scope="module", params=CASES)
def served(request, scorers):
    scorer = scorers(request.param)
    running = ServerThread(server.create_app(scorer, rerank_template=TEMPLATE))
    with httpx.Client(base_url=running.url, timeout=60) as client:
        yield request.param, scorer, client
    running.stop()


def test_the_library_answers_an_empty_result_after_checking_the_request(served):
    case, scorer, _ = served
    labels = label_options(case)
    result = scorer.score("q", [], **labels)
    width = scorer.config.num_labels or len(labels["label_token_ids"])
    assert result.logprobs.shape == (0, width) and result.backend == "none"
    assert result.num_tokens == 0 and result.scores.shape == (0, width)
    assert [
        r.logprobs.shape for r in scorer.score_batch([{"query": "q", "items": [], **labels}])
    ] == [(0, width)]
    assert scorer.rank("q", [], **({"labels": ["y", "n"]} if labels else {})) == []
    chunked = scorer.score("q", [], chunking={"window": 8}, **labels)
    assert chunked.scores.shape == (0,) and chunked.spans == []
    with pytest.raises(ValidationError) as e:  # still checked: nothing to score is no excuse
        scorer.score(None, [], **labels)
    assert e.value.code == "invalid_query"


def test_the_score_endpoints_answer_an_empty_result(served):
    case, _, client = served
    answer = client.post("/v1/score", json={"query": "q", "items": [], **label_options(case)})
    assert answer.status_code == 200, answer.text
    assert answer.json()["scores"] == [] and answer.json()["usage"]["prompt_tokens"] == 0
    # vLLM's /score takes a text or a non-empty list as text_2, as vLLM does.
    refused = client.post("/score", json={"text_1": "q", "text_2": []})
    assert refused.status_code == 400 and refused.headers["x-error-code"] == "invalid_argument"


@pytest.mark.parametrize(
    "path, body, dialect, param",
    [
        ("/v1/rerank", {"query": "q", "documents": []}, "vllm", "documents"),
        ("/rerank", {"query": "q", "documents": []}, "vllm", "documents"),
        ("/v2/rerank", {"model": "m", "query": "q", "documents": []}, "cohere", None),
        ("/rerank", {"query": "q", "texts": []}, "tei", None),
        (
            "/v1/rerank",
            {"query": "q", "documents": [], "max_chunks_per_doc": 2},
            "vllm",
            "documents",
        ),
        (
            "/v1/rerank",
            {"query": "q", "documents": [], "return_documents": False},
            "vllm",
            "documents",
        ),
    ],
)
def test_the_rerank_endpoints_refuse_an_empty_document_list(served, path, body, dialect, param):
    _, _, client = served
    answer = client.post(path, json=body)
    assert answer.status_code == 400, answer.text
    assert answer.headers["x-error-code"] == "empty_documents"
    error = answer.json()
    if dialect == "tei":
        assert set(error) == {"error", "error_type"}
        assert error["error"] == "texts: cannot be empty: there is nothing to rerank"
    else:
        assert set(error) == ERROR_KEYS[dialect]
        assert "cannot be empty" in (
            error["error"]["message"] if dialect == "vllm" else error["message"]
        )
    if param is not None:
        assert error["error"]["param"] == param


def test_the_schema_says_a_rerank_needs_a_document(served):
    _, _, client = served
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    needing = [
        name
        for name, s in schemas.items()
        if s.get("properties", {}).get("documents", {}).get("minItems") == 1
    ]
    assert {"RerankRequest", "RerankV2Request"} <= set(needing)
    assert np.any(
        [s.get("properties", {}).get("texts", {}).get("minItems") == 1 for s in schemas.values()]
    )
