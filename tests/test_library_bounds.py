"""A library call is bounded as a server request is (docs/api.md#size-bounds): `Scorer(limits=)`
(default `LIBRARY_LIMITS`, finite) refuses, before anything is tokenized, a request past any
bound with the server's size codes, through every door: score, prepare, score_batch, rank,
chunked score and rank, loglikelihood, prompt_logprobs, the Batcher; a server over such a scorer
answers 413; a job scores a query's pair rows in parts that fit."""

import argparse
import collections.abc

import attrs
import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import ServerThread
from test_jobs import CASE, LABELS, pairs_table, read, reference
from test_server import TEMPLATE
from tpuscore import Batcher, Scorer, ValidationError
from tpuscore.api.requests import LIBRARY_LIMITS, RequestLimits
from tpuscore.jobs import load_scorer, score_table

SMALL = {"max_items": 3, "max_labels": 2, "max_scores": 4, "max_length": 40, "max_total_length": 60}


@pytest.fixture(scope="module")
def small(checkpoint_dir):
    return Scorer.from_pretrained(checkpoint_dir(CASE), dtype="float32", limits=SMALL)


def refused(call, code, param):
    with pytest.raises(ValidationError) as e:
        call()
    assert (e.value.code, e.value.param) == (code, param), e.value
    assert "Scorer(limits=...)" in str(e.value)


def test_every_door_refuses_a_request_past_the_scorers_bounds(small, monkeypatch):
    assert small.limits == attrs.evolve(LIBRARY_LIMITS, **SMALL)
    ids = [5, 6]
    four = ["a", "b", "c", "d"]
    refused(lambda: small.score("q", four, ids), "too_many_items", "items")
    refused(lambda: small.score("q", ["a"], [5, 6, 7]), "too_many_labels", "labels")
    refused(lambda: small.score("q", ["a", "b", "c"], ids), "too_many_scores", "items")
    refused(lambda: small.score("q" * 41, ["a"], ids), "input_too_long", "query")
    refused(lambda: small.score("q", ["a" * 35, "b" * 30], ids), "request_too_large", None)
    refused(lambda: small.prepare("q", four, ids), "too_many_items", "items")
    refused(lambda: small.rank("q", four, labels=LABELS), "too_many_items", "items")
    with pytest.raises(ValidationError) as e:
        small.score_batch([{"query": "q", "items": ["a"], "label_token_ids": ids},
                           {"query": "q", "items": four, "label_token_ids": ids}])  # fmt: skip
    assert e.value.code == "too_many_items" and e.value.loc == ("requests", 1, "items")
    with Batcher(small) as batcher:
        submit = lambda: batcher.submit(query="q", items=four, label_token_ids=ids)  # noqa: E731
        refused(submit, "too_many_items", "items")
    refused(lambda: small.loglikelihood([1, 2], [[3]] * 4), "too_many_items", "continuations")
    refused(lambda: small.prompt_logprobs([[1, 2]] * 4), "too_many_items", "prompt")
    # Chunked: a document past max_length is refused before it is tokenized ...
    from tpuscore.tasks import chunking

    monkeypatch.setattr(chunking, "split", lambda *a, **k: pytest.fail("tokenized first"))
    long, window = ["w " * 21], {"window": 2}
    refused(lambda: small.score("q", long, ids, chunking=window), "input_too_long", "items[0]")
    ranked = lambda: small.rank("q", long, labels=LABELS, chunking=window)  # noqa: E731
    refused(ranked, "input_too_long", "items[0]")
    monkeypatch.undo()
    # ... and a document cut into more chunks than a request may hold, before it is cut.
    cut = lambda: small.score("q", ["the river ran past the old mill"], ids, chunking=window)  # noqa: E731
    refused(cut, "too_many_items", "items")
    # Items in any sequence validation takes are counted.
    refused(lambda: small.score("q", Items(four), ids), "too_many_items", "items")


class Items(collections.abc.Sequence):
    """A sequence of items that is neither a list nor a tuple."""

    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def test_a_zero_dimensional_array_is_refused_as_a_number_is_at_every_door(scorers):
    """np.array(5) has no length: the size check's len() raised a raw TypeError at every door
    (score, loglikelihood, prompt_logprobs, chunked score, the Batcher)."""
    scorer, z = scorers(CASE), np.array(5)
    calls = {
        ("invalid_query", "query"): lambda: scorer.score(z, [[2]], [3]),
        ("invalid_items", "items"): lambda: scorer.score([1], [z], [3]),
        ("invalid_label_token_ids", "label_token_ids"): lambda: scorer.score([1], [[2]], z),
        ("invalid_argument", "item_suffix"): lambda: scorer.score([1], [[2]], [3], item_suffix=z),
        ("invalid_query", "context"): lambda: scorer.loglikelihood(z, [[2]]),
        ("invalid_prompt", "prompt"): lambda: scorer.prompt_logprobs([z]),
        ("invalid_items", "items[0]"): lambda: scorer.score(
            [1], [z], [3, 4], chunking={"window": 2}
        ),
    }
    for (code, param), call in calls.items():
        with pytest.raises(ValidationError) as e:
            call()
        assert (e.value.code, e.value.param) == (code, param)
    with Batcher(scorer) as batcher, pytest.raises(ValidationError) as e:
        batcher.submit(query=z, items=[[2]], label_token_ids=[3])
    assert e.value.code == "invalid_query"


def test_a_classification_models_classes_count_as_its_labels(checkpoint_dir):
    classifier = Scorer.from_pretrained(checkpoint_dir("qwen3_seq_cls"), limits={"max_scores": 5})
    assert classifier.score("q", ["a", "b"]).logprobs.shape == (2, 2)  # 4 scores
    refused(lambda: classifier.score("q", ["a", "b", "c"]), "too_many_scores", "items")


def test_the_default_bounds_are_finite_and_checked_before_tokenizing(scorers):
    scorer = scorers(CASE)
    assert scorer.limits == LIBRARY_LIMITS
    assert all(0 < getattr(LIBRARY_LIMITS, n) < 1 << 27 for n in RequestLimits.names())
    refused(lambda: scorer.score("q", ["a"], [5] * 50_000), "too_many_labels", "labels")
    huge = ["x"] * (LIBRARY_LIMITS.max_items + 1)
    refused(lambda: scorer.score("q", huge, [5]), "too_many_items", "items")


@pytest.mark.parametrize("requests", [None, 3, {"query": "q", "items": ["a"], "labels": LABELS}])
def test_requests_that_are_not_a_sequence_of_requests_are_refused(scorers, requests):
    """score_batch, prepare_batch and validate_batch take a list of requests: anything else is
    a ValidationError naming `requests` (not a TypeError, nor one request's keys as requests)."""
    scorer = scorers(CASE)
    for call in (scorer.score_batch, scorer.prepare_batch, scorer.validate_batch):
        with pytest.raises(ValidationError) as e:
            call(requests)
        assert (e.value.code, e.value.param) == ("invalid_argument", "requests"), e.value


@pytest.mark.parametrize(
    "limits, why",
    [
        ({"max_items": 0}, "max_items must be an int >= 1"),
        ({"nope": 1}, "no field 'nope'"),
        (5, "a RequestLimits"),
    ],
)
def test_bad_limits_are_refused(checkpoint_dir, limits, why):
    with pytest.raises(ValidationError) as e:
        Scorer.from_pretrained(checkpoint_dir(CASE), limits=limits)
    assert (e.value.code, e.value.param) == ("invalid_argument", "limits") and why in str(e.value)


def test_a_server_over_a_smaller_scorer_answers_413(checkpoint_dir):
    from tpuscore.serving import app as server

    small = Scorer.from_pretrained(checkpoint_dir(CASE), limits={"max_items": 3})
    running = ServerThread(server.create_app(small, rerank_template=TEMPLATE))
    with httpx.Client(base_url=running.url, timeout=60) as client:
        answer = client.post(
            "/v1/score", json={"query": "q", "items": list("abcd"), "label_token_ids": [5]}
        )
        ranked = client.post("/v1/rerank", json={"query": "q", "documents": list("abcd")})
    running.stop()
    assert answer.status_code == 413 and answer.headers["x-error-code"] == "too_many_items"
    assert ranked.status_code == 413 and ranked.headers["x-error-code"] == "too_many_items"


def test_serves_flags_raise_the_scorers_bounds():
    from tpuscore.cli.common import scorer_limits

    flags = {n: getattr(RequestLimits(), n) for n in RequestLimits.names()}
    args = argparse.Namespace(**{**flags, "max_items": 1 << 20})
    assert scorer_limits(args) == attrs.evolve(LIBRARY_LIMITS, max_items=1 << 20)
    assert scorer_limits(argparse.Namespace()) is None  # a command without the flags


def test_a_job_scores_a_querys_pair_rows_in_parts_that_fit(checkpoint_dir, rng, tmp_path):
    table = pairs_table(rng, 7, users=1)
    pq.write_table(table, tmp_path / "pairs.parquet")
    scorer = load_scorer(checkpoint_dir(CASE), dtype="float32", limits={"max_items": 3})
    summary = score_table(
        tmp_path / "pairs.parquet", tmp_path / "out", scorer=scorer, labels=LABELS,
        query_column="user_text", item_column="item_text",
    )  # fmt: skip
    assert summary.errors == 0
    out = read(tmp_path / "out")
    expected = reference(scorer, table["user_text"].to_pylist(), table["item_text"].to_pylist())
    got = np.stack([out.column(f"logprob_{label}").to_numpy() for label in LABELS], 1)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    assert pa.compute.max(out.column("row")).as_py() == 6
