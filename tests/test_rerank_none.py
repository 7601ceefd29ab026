"""`tpuscore serve --rerank-template none` (create_app(rerank_template=None)): a server for
/v1/score alone, on a model whose tokenizer does not make any shipped template's labels single
tokens; the rerank endpoints and vLLM's /score, which rerank under the template, answer 404
`rerank_not_configured` in their dialect's shape, whatever the body."""

import httpx
import numpy as np
import pytest

from helpers import ServerThread
from test_server import ERROR_KEYS
from tpuscore.serving import app as server

CASES = ("qwen3_qknorm", "qwen3_seq_cls")


@pytest.fixture(scope="module", params=CASES)
def served(request, scorers):
    scorer = scorers(request.param)
    running = ServerThread(server.create_app(scorer, rerank_template="none"))
    with httpx.Client(base_url=running.url, timeout=60) as client:
        yield request.param, scorer, client
    running.stop()


def test_a_template_that_does_not_fit_says_how_to_serve_without_one(scorers):
    # The shipped templates' labels are several tokens in the tiny test tokenizer.
    with pytest.raises(ValueError, match="--rerank-template none to serve /v1/score"):
        server.create_app(scorers("qwen3_qknorm"), rerank_template="plain")


def test_v1_score_is_served(served):
    case, scorer, client = served
    labels = {} if case.endswith("seq_cls") else {"label_token_ids": [5, 6]}
    body = {"query": [5, 6, 7], "items": [[8], [9, 10]], **labels}
    answer = client.post("/v1/score", json=body)
    assert answer.status_code == 200, answer.text
    expected = scorer.score(**body).scores
    np.testing.assert_allclose(answer.json()["scores"], expected, rtol=1e-5, atol=1e-6)
    sglang_on_score = client.post("/score", json=body)
    assert sglang_on_score.status_code == 200, sglang_on_score.text


@pytest.mark.parametrize(
    "path, body, dialect",
    [
        ("/v1/rerank", {"query": "q", "documents": ["a"]}, "vllm"),
        ("/v1/rerank", {"query": 5}, "vllm"),  # refused before its body is read
        ("/rerank", {"query": "q", "documents": ["a"]}, "vllm"),
        ("/rerank", {"query": "q", "texts": ["a"]}, "vllm"),
        ("/v2/rerank", {"model": "m", "query": "q", "documents": ["a"]}, "cohere"),
        ("/score", {"text_1": "q", "text_2": ["a", "b"]}, "vllm"),
    ],
)
def test_the_rerank_endpoints_say_rerank_is_not_configured(served, path, body, dialect):
    _, _, client = served
    answer = client.post(path, json=body)
    assert answer.status_code == 404, answer.text
    assert answer.headers["x-error-code"] == "rerank_not_configured"
    assert set(answer.json()) == ERROR_KEYS[dialect]
    assert "--rerank-template none" in answer.text


def test_the_models_and_health_are_served(served):
    _, _, client = served
    assert client.get("/health").status_code == 200
    assert client.get("/v1/models").status_code == 200
