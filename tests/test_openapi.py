"""The server's published schema: `GET /openapi.json` describes every endpoint, and schemathesis,
reading it, fuzzes the live server (uvicorn on 127.0.0.1, a tiny checkpoint): every answer is a
documented status with a JSON body, never a 500, and the server stays healthy.
"""

import json

import attrs
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance

from test_server import TEMPLATE, ServerThread, error_of
from tpuscore.api.requests import ScoreOptions
from tpuscore.serving import app as server
from tpuscore.serving import score_protocol

CASE = "qwen3_qknorm"
# Small limits bound what the fuzzer can send, and so the shapes the model compiles for it.
MAX_BODY_BYTES = 128 << 10
MAX_ITEMS = 8
EXAMPLES_PER_OPERATION = 12
STATEFUL_EXAMPLES = 8
REQUEST_TIMEOUT_S = 60
ENDPOINTS = {
    ("/v1/score", "post"),
    ("/score", "post"),
    ("/tokenize", "post"),
    ("/detokenize", "post"),
    ("/v1/rerank", "post"),
    ("/rerank", "post"),
    ("/v2/rerank", "post"),
    ("/v1/completions", "post"),
    ("/health", "get"),
    ("/v1/models", "get"),
    ("/metrics", "get"),
}


@pytest.fixture(scope="module")
def url(scorers):
    app = server.create_app(
        scorers(CASE),
        model_name="tiny-qwen3",
        rerank_template=TEMPLATE,
        max_body_bytes=MAX_BODY_BYTES,
        max_items=MAX_ITEMS,
    )
    running = ServerThread(app)
    yield running.url
    running.stop()


@pytest.fixture(scope="module")
def client(url):
    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) as c:
        yield c


def test_openapi_describes_every_endpoint(client):
    document = client.get("/openapi.json").json()
    served = {(path, method) for path, ops in document["paths"].items() for method in ops}
    assert served == ENDPOINTS
    for path, method in ENDPOINTS:
        responses = document["paths"][path][method]["responses"]
        expected = {"200", "400", "413", "503", "504"} if method == "post" else {"200"}
        assert set(responses) == expected, (path, responses)
    assert "text/plain" in document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    docs = client.get("/docs")
    assert docs.status_code == 200 and "openapi.json" in docs.text


def test_score_options_come_from_score_options(client):
    """/v1/score's option fields carry ScoreOptions' names and defaults, less the ones it does
    not serve."""
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    fields = schemas["ScoreRequest"]["properties"]
    served = [
        f
        for f in attrs.fields(ScoreOptions)
        if f.name not in score_protocol.SCORE_OPTIONS_NOT_SERVED
    ]
    assert served
    for option in served:
        assert option.name in fields
        assert fields[option.name].get("default") == option.default  # FastAPI omits null
        assert fields[option.name]["description"]
    assert not set(score_protocol.SCORE_OPTIONS_NOT_SERVED) & set(fields)
    assert schemas["ScoreRequest"]["required"] == ["query", "items"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/score", b"[" * 100_000),
        ("/v1/score", b'{"query": ' + b"[" * 5_000 + b"1" + b"]" * 5_000 + b"}"),
        ("/v1/rerank", b'{"query": "x", "documents": ' + b"[" * 900 + b"]" * 900 + b"}"),
        ("/v1/score", b'{"query": "x", "items": ' + b"[" * 900 + b"]" * 900 + b"}"),
        (
            "/v2/rerank",
            b'{"query": "x", "documents": [], "top_n": ' + b'{"a": ' * 400 + b"1" + b"}" * 401,
        ),
    ],
    ids=["array", "query", "documents", "items", "objects"],
)
def test_deeply_nested_json_is_a_400(client, path, body):
    response = client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert error_of(response)[0] == "invalid_json"
    assert client.get("/health").status_code == 200


def test_library_errors_name_the_rerank_field(client):
    """The library calls a rerank's documents `items`; its errors name the wire's field."""
    content = json.dumps({"query": "x", "documents": ["a", "\ud800 b"]}).encode()
    response = client.post(
        "/v1/rerank", content=content, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assert error_of(response) == ("invalid_text", "documents[1]")


@pytest.fixture(scope="module")
def api_schema(url):
    return schemathesis.openapi.from_url(f"{url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.mark.slow
@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_schemathesis_finds_no_undocumented_answer(case, url, client):
    """Every answer is a documented status, content type and schema, never a 500; a JSON body
    except /metrics' text. positive_data_acceptance is off: data the schema allows may still
    be refused by the library (a token id past the vocabulary, a multi-token label). Every
    example drawn is sent: the run is bounded by EXAMPLES_PER_OPERATION, not by a clock."""
    # negative_data_rejection is off too: it counts a 413 as accepting schema-violating data,
    # and a body both malformed and past a size bound is refused 413 (the bounds come first).
    response = case.call_and_validate(
        base_url=url,
        timeout=REQUEST_TIMEOUT_S,
        excluded_checks=[positive_data_acceptance, negative_data_rejection],
    )
    assert response.status_code < 500, response.text
    if case.path != "/metrics":  # TEI's /rerank and /tokenize answer a JSON list
        assert isinstance(response.json(), dict | list)
    assert client.get("/health").json()["status"] == "ok"


@pytest.mark.slow
def test_schemathesis_stateful_over_the_whole_schema(api_schema, url, client):
    """schemathesis' state machine over every operation of the schema (sequences of calls, not
    one at a time): every answer is a documented status with a conforming body, never a 500,
    and the server stays healthy after the run."""
    machine = api_schema.as_state_machine()
    answered = []

    class Bounded(machine):
        def validate_response(self, response, case, **kwargs):
            answered.append((case.path, response.status_code))
            assert response.status_code < 500, response.text
            case.validate_response(response, excluded_checks=[positive_data_acceptance])

    Bounded.run(
        settings=settings(
            max_examples=STATEFUL_EXAMPLES,
            stateful_step_count=4,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )
    )
    assert client.get("/health").json()["status"] == "ok"
    paths = {path for path, _ in answered}
    assert len(answered) >= STATEFUL_EXAMPLES and {"/tokenize", "/detokenize"} <= paths, answered
