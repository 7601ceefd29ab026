"""`/v1/completions` for scoring (docs/completions.md): prompt log-probabilities equal
`Scorer.loglikelihood`'s, prompts sharing a prefix share its computation, generation is refused.
lm-evaluation-harness's own `local-completions` model against the server is tested beside the
in-process model, in tests/test_lm_eval.py."""

import threading
import time

import httpx
import numpy as np
import pytest

from helpers import ServerThread, random_tokens
from tpuscore.api import templates
from tpuscore.api.errors import ValidationError
from tpuscore.backends import registry
from tpuscore.serving import app as server

CASE = "llama_gqa_untied"
# The shipped templates' labels are several tokens in the tests' tokenizer; the server needs one
# that fits for its rerank endpoints.
TEMPLATE = templates.Template(
    name="test", query="{query}\n", item="{item}", item_suffix="?", labels=("y", "n"),
    default_instruction="",
)  # fmt: skip


@pytest.fixture(scope="module")
def scorer(scorers):
    return scorers(CASE)


@pytest.fixture(scope="module")
def client(scorer):
    running = ServerThread(server.create_app(scorer, rerank_template=TEMPLATE))
    with httpx.Client(base_url=running.url, timeout=120) as c:
        yield c
    running.stop()


def complete(client, **body):
    return client.post("/v1/completions", json=body)


def test_echo_returns_every_prompt_tokens_logprob(client, scorer, rng):
    prompt = random_tokens(rng, 12, scorer.config.vocab_size)
    response = complete(client, prompt=prompt, echo=True, logprobs=3, max_tokens=0)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 0
    (choice,) = body["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 12
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = scorer.loglikelihood(prompt[:1], [prompt[1:]])[0].token_logprobs
    np.testing.assert_allclose(lp["token_logprobs"][1:], expected, rtol=1e-5, atol=1e-5)
    for j, top in enumerate(lp["top_logprobs"][1:], 1):
        # The top 3 and the prompt's own token; tokens that decode alike share one entry.
        assert 1 <= len(top) <= 4
        top1 = scorer.prompt_logprobs([prompt])[0].top_logprobs[j - 1, 0]
        assert max(top.values()) == pytest.approx(top1, abs=1e-5)
        assert max(top.values()) >= lp["token_logprobs"][j]
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_an_echoed_answer_holds_at_most_max_scores_logprobs(scorer, rng):
    """echo with logprobs answers (1 + logprobs) entries per prompt token: bounded by
    max_scores, as a score answer is, before anything runs; without echo it is not echoed."""
    from fastapi.testclient import TestClient

    from tpuscore.api.requests import RequestLimits

    prompt = random_tokens(rng, 10, scorer.config.vocab_size)
    limits = RequestLimits(max_scores=40)
    app = server.create_app(scorer, rerank_template=TEMPLATE, limits=limits)
    with TestClient(app) as c:
        within = c.post("/v1/completions", json={"prompt": prompt, "echo": True, "logprobs": 3,
                                                 "max_tokens": 0})  # fmt: skip
        over = c.post("/v1/completions", json={"prompt": prompt, "echo": True, "logprobs": 4,
                                               "max_tokens": 0})  # fmt: skip
        unechoed = c.post("/v1/completions", json={"prompt": prompt, "logprobs": 4,
                                                   "max_tokens": 1})  # fmt: skip
    assert within.status_code == 200, within.text  # 10 tokens x 4 entries
    assert over.status_code == 413, over.text  # 10 x 5
    assert over.headers["X-Error-Code"] == "too_many_scores"
    assert unechoed.status_code == 200, unechoed.text


def test_max_tokens_1_adds_the_greedy_next_token_and_nothing_more(client, scorer, rng):
    prompt = random_tokens(rng, 9, scorer.config.vocab_size)
    body = complete(client, prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0)
    choice = body.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == 10 and body.json()["usage"]["completion_tokens"] == 1
    greedy = scorer.prompt_logprobs([prompt])[0].top_ids[-1, 0]
    alone = scorer.loglikelihood(prompt, [[int(greedy)]])[0]
    assert alone.is_greedy
    assert lp["token_logprobs"][-1] == pytest.approx(alone.logprob, abs=1e-5)
    assert choice["text"].endswith(lp["tokens"][-1])
    # Without echo: the next token only.
    lp = complete(client, prompt=prompt, logprobs=2, max_tokens=1).json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 1 and lp["token_logprobs"][0] == pytest.approx(
        alone.logprob, abs=1e-5
    )


def test_prompts_sharing_a_prefix_share_it_and_equal_each_alone(scorer, rng, monkeypatch):
    vocab = scorer.config.vocab_size
    context = random_tokens(rng, 10, vocab)
    prompts = [context + random_tokens(rng, n, vocab) for n in (1, 4, 2)] + [context[:6]]
    alone = [scorer.prompt_logprobs([p])[0] for p in prompts]
    backend = scorer.engine.backends.get(registry.loglikelihood_backend())
    prefixes = []
    query_prefix = backend.query_prefix
    monkeypatch.setattr(
        backend,
        "query_prefix",
        lambda q, adapter=0: prefixes.append(len(q)) or query_prefix(q, adapter),
    )
    together = scorer.prompt_logprobs(prompts)
    assert sorted(prefixes) == [1, 6]  # the first token once, the common prefix once
    for a, t in zip(alone, together, strict=True):
        np.testing.assert_allclose(t.token_logprobs, a.token_logprobs, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(t.top_logprobs, a.top_logprobs, rtol=1e-5, atol=1e-5)
    # Prompts of one length as the rows of a 2-d array: the same prompts.
    rows = scorer.prompt_logprobs(np.array(prompts[:1] * 2))
    for row in rows:
        np.testing.assert_allclose(
            row.token_logprobs, alone[0].token_logprobs, rtol=1e-5, atol=1e-5
        )


def test_text_prompts_are_tokenized_with_special_tokens(client, scorer):
    body = complete(client, prompt=["The fox ran.", "A mill"], echo=True, logprobs=0, max_tokens=0)
    assert body.status_code == 200, body.text
    choices = body.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1] and choices[0]["text"] == "The fox ran."
    ids = scorer.tokenizer.encode("The fox ran.").ids
    assert body.json()["usage"]["prompt_tokens"] == len(ids) + len(
        scorer.tokenizer.encode("A mill").ids
    )
    assert len(choices[0]["logprobs"]["tokens"]) == len(ids)


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"prompt": [1, 2], "max_tokens": 2}, "generation_unsupported", "max_tokens"),
        ({"prompt": [1, 2]}, "generation_unsupported", "max_tokens"),  # OpenAI's default 16
        ({"prompt": [1, 2], "max_tokens": 1, "temperature": 0.7}, "generation_unsupported",
         "temperature"),
        ({"prompt": [1, 2], "max_tokens": 0, "n": 2}, "unsupported_field", "n"),
        ({"prompt": [1, 2], "max_tokens": 0, "stream": True}, "unsupported_field", "stream"),
        ({"prompt": [], "max_tokens": 0}, "invalid_prompt", "prompt"),
        ({"prompt": [[1], [10**6]], "max_tokens": 0}, "token_id_exceeds_vocab", "prompt[1]"),
        ({"prompt": [1, 2], "max_tokens": 0, "logprobs": 21}, "invalid_argument", "logprobs"),
    ],
)  # fmt: skip
def test_what_needs_generation_or_is_malformed_is_refused(client, body, code, param):
    response = complete(client, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]  # OpenAI's (vLLM's) error shape; tpuscore's code aside
    assert (response.headers["X-Error-Code"], error["param"]) == (code, param)
    assert error["code"] == 400
    if code == "generation_unsupported":
        assert "does not" in error["message"]


@pytest.mark.parametrize(
    "prompts, param",
    [
        ([["a"]], "prompt"),
        ([[1.5]], "prompt"),
        ([[True, 2]], "prompt"),
        ([[1], [2, None]], "prompt[1]"),
        ("abc", "prompt"),
        ([None], "prompt"),
        (5, "prompt"),
    ],
)
def test_the_library_refuses_what_is_not_token_ids_with_a_typed_error(scorer, prompts, param):
    """`Scorer.prompt_logprobs` as the endpoint refuses it: no TypeError, no 1.5 read as 1."""
    with pytest.raises(ValidationError) as e:
        scorer.prompt_logprobs(prompts)
    assert (e.value.code, e.value.param) == ("invalid_prompt", param)


class HeldPrompts:
    """The scorer, its prompt_logprobs calls held while `gate` is clear."""

    def __init__(self, scorer):
        self.scorer, self.gate, self.started = scorer, threading.Event(), threading.Semaphore(0)

    def __getattr__(self, name):
        return getattr(self.scorer, name)

    def prompt_logprobs(self, prompts, *, adapter=None):
        self.started.release()
        assert self.gate.wait(60)
        return self.scorer.prompt_logprobs(prompts, adapter=adapter)


def running(client) -> float:
    text = client.get("/metrics").text
    return float(
        next(
            line for line in text.splitlines() if line.startswith("tpuscore_requests_running")
        ).split()[-1]
    )


def test_deadlines_and_max_pending_bound_completions(scorer):
    """The endpoint keeps the server's bounds as the scoring endpoints do: a bad
    X-Request-Timeout is 400, a request past its deadline 504, and one past --max-pending 503.
    A request past its deadline whose work still runs keeps its place (and counts as running)
    until that work ends: its thread cannot be stopped."""
    held = HeldPrompts(scorer)
    app = server.create_app(held, rerank_template=TEMPLATE, batcher_options={"max_pending": 1})
    running_server = ServerThread(app)
    body = {"prompt": [1, 2, 3], "max_tokens": 0, "echo": True, "logprobs": 1}
    try:
        with httpx.Client(base_url=running_server.url, timeout=60) as c:
            bad = c.post("/v1/completions", json=body, headers={"X-Request-Timeout": "soon"})
            assert bad.status_code == 400, bad.text
            assert bad.json()["error"]["param"] == "X-Request-Timeout"
            late = c.post("/v1/completions", json=body, headers={"X-Request-Timeout": "0.3"})
            assert late.status_code == 504, late.text
            assert late.headers["X-Error-Code"] == "deadline_exceeded"
            assert held.started.acquire(timeout=60)  # its work began: past the deadline regardless
            assert running(c) == 1
            refused = c.post("/v1/completions", json=body)
            assert refused.status_code == 503, refused.text
            assert refused.headers["X-Error-Code"] == "overloaded"
            held.gate.set()  # the late request's work ends, and with it its place
            for _ in range(600):
                if running(c) == 0:
                    break
                time.sleep(0.1)
            assert running(c) == 0
            assert c.post("/v1/completions", json=body).status_code == 200
    finally:
        held.gate.set()
        running_server.stop()


def test_echoed_token_ids_text_is_their_tokens_special_ones_too(client, scorer):
    """A token-id prompt's echoed text is its tokens' strings joined, a special token's too (as
    vLLM decodes a prompt), so that text_offset indexes the text."""
    vocab, tokenizer = scorer.config.vocab_size, scorer.tokenizer
    special = next(
        i
        for i in range(vocab)
        if tokenizer.decode([i]) != tokenizer.decode([i], skip_special_tokens=False)
    )
    prompt = [special, 40, 41, 42]
    response = complete(client, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    tokens, offsets = choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
    assert choice["text"] == "".join(tokens)
    for token, offset in zip(tokens, offsets, strict=True):
        assert choice["text"][offset:].startswith(token)


def test_a_text_prompt_is_tokenized_off_the_event_loop(scorer):
    """While a text prompt is held inside its tokenizer, /health is answered."""
    from test_server_tei import assert_served_while_tokenizing

    body = {"prompt": "the fox", "max_tokens": 0, "echo": True, "logprobs": 1}
    assert_served_while_tokenizing(scorer, "/v1/completions", body, TEMPLATE)
