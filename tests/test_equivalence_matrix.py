"""One request, every door: the same scores from `Scorer.score`, `score_batch`, `rank`, the
Batcher (split over steps and not; a chunked request against `score(chunking=)`), every HTTP
endpoint that scores, a job (Parquet and JSON Lines) and Ray Data, for a causal LM, a one-logit
and a three-class classification model.

Within the default mode's documented alone-against-batched bound; bit-identical in
batch-invariant mode. Hypothesis draws the requests: item counts and lengths on both sides of
each door's split threshold (the Batcher's per-step cap, rank's progress pages, a job's shard),
labels, softmax or not. Each door is its own test, so a broken door fails on its own."""

import json
import os
from unittest import mock

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import ALONE_VS_BATCHED, start_ray
from test_server import TEMPLATE
from tpuscore import Batcher, Scorer
from tpuscore.tasks import ranking

CAUSAL, ONE_LOGIT, THREE_CLASSES = "llama_gqa_untied", "llama_seq_cls", "qwen2_seq_cls"
CASES = (CAUSAL, ONE_LOGIT, THREE_CLASSES)
MODES = ("default", "batch_invariant")
LABELS = ("a", "b", "x", "e")  # single tokens in the tests' tokenizer
CHARS = "abcdefghij klmnop"
STEP_TOKENS = 24  # the split Batcher's per-step cap: drawn requests fall on both sides
PAGE_ITEMS = 2  # rank's progress pages, and a job's shard rows, around the drawn item counts
QUICK = hypothesis.settings(
    max_examples=int(os.environ.get("TPUSCORE_MATRIX_EXAMPLES", 3)),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(hypothesis.HealthCheck),
)


class Doors:
    """A scorer in one mode, with its Batchers (one splitting every request over its cap) and
    the FastAPI app in process (its own Batcher splitting too)."""

    def __init__(self, scorer: Scorer):
        from fastapi.testclient import TestClient

        from tpuscore.serving import app as server

        self.scorer = scorer
        self.classification = scorer.config.num_labels > 0
        self.whole = Batcher(scorer, max_wait_ms=0)
        self.split = Batcher(scorer, max_wait_ms=0, max_request_step_tokens=STEP_TOKENS)
        app = server.create_app(
            scorer,
            rerank_template=TEMPLATE,
            batcher_options={"max_wait_ms": 0, "max_request_step_tokens": STEP_TOKENS},
        )
        self.client = TestClient(app)
        self.client.__enter__()

    def close(self):
        self.client.__exit__(None, None, None)
        self.whole.close()
        self.split.close()


@pytest.fixture(scope="module")
def doors(checkpoint_dir, scorers):
    built: dict[tuple[str, str], Doors] = {}

    def get(case: str, mode: str) -> Doors:
        if (case, mode) not in built:
            scorer = (
                scorers(case)
                if mode == "default"
                else Scorer.from_pretrained(
                    checkpoint_dir(case), dtype="float32", batch_invariant=True
                )
            )
            built[case, mode] = Doors(scorer)
        return built[case, mode]

    yield get
    for opened in built.values():
        opened.close()


@st.composite
def score_requests(draw, classification: bool, min_items: int = 0) -> dict:
    """score()'s keyword arguments: text, few tokens, sizes around STEP_TOKENS and PAGE_ITEMS."""
    text = st.text(CHARS, min_size=1, max_size=12)
    request = {
        "query": draw(st.text(CHARS, min_size=1, max_size=16)),
        "items": draw(st.lists(text, min_size=min_items, max_size=5)),
        "apply_softmax": draw(st.booleans()),
    }
    if not classification:
        labels = st.lists(st.sampled_from(LABELS), min_size=1, max_size=3, unique=True)
        request["labels"] = draw(labels)
    return request


def check(got: np.ndarray, expected: np.ndarray, mode: str, what: str) -> None:
    got, expected = np.asarray(got, np.float32), np.asarray(expected, np.float32)
    assert got.shape == expected.shape, what
    if mode == "batch_invariant":
        np.testing.assert_array_equal(got, expected, err_msg=what)
    else:
        np.testing.assert_allclose(got, expected, **ALONE_VS_BATCHED, err_msg=what)


def check_result(result, reference, mode: str, what: str) -> None:
    assert (result.classification, result.apply_softmax) == (
        reference.classification,
        reference.apply_softmax,
    ), what
    check(result.logprobs, reference.logprobs, mode, f"{what}: logprobs")
    check(result.scores, reference.scores, mode, f"{what}: scores")


def check_ranked(ranked, relevance: np.ndarray, mode: str, what: str) -> None:
    """Ranked (index, score) pairs against every item's expected relevance: each score is its
    item's, every item once, in non-increasing order of the door's own scores."""
    indexes = [int(i) for i, _ in ranked]
    scores = np.array([s for _, s in ranked], np.float32)
    assert sorted(indexes) == list(range(len(relevance))), what
    assert np.all(np.diff(scores) <= 0), what
    check(scores, np.asarray(relevance)[indexes], mode, what)


def relevance_of(doors: Doors, request: dict) -> np.ndarray:
    """What the server's rerank endpoints give each item: `Scorer.rank` under the server's
    template (the relevant class of a classifier, else the template's positive label)."""
    ranked = doors.scorer.rank(request["query"], request["items"], template=TEMPLATE)
    relevance = np.zeros(len(request["items"]), np.float32)
    for r in ranked:
        relevance[r.index] = r.score
    return relevance


CASE_MODES = [(c, m) for c in CASES for m in MODES]
IDS = [f"{c}-{m}" for c, m in CASE_MODES]


@pytest.mark.parametrize("case, mode", CASE_MODES, ids=IDS)
def test_score_batch_and_rank_equal_score(doors, case, mode):
    d = doors(case, mode)

    @QUICK
    @hypothesis.given(
        request=score_requests(d.classification), other=score_requests(d.classification)
    )
    def run(request, other):
        reference = d.scorer.score(**request)
        alone, among = d.scorer.score_batch([request]), d.scorer.score_batch([other, request])
        check_result(alone[0], reference, mode, "score_batch alone")
        check_result(among[1], reference, mode, "score_batch among others")
        num_labels = reference.logprobs.shape[1]
        if num_labels < 2 and not d.classification:
            return  # rank refuses a single label (tests/test_rank.py)
        options = {k: v for k, v in request.items() if k not in ("query", "items")}
        positive = ranking.default_positive(num_labels, d.classification)
        relevance = reference.label_probs[:, positive]
        for paged in (False, True):
            with mock.patch.object(ranking, "PROGRESS_PAGE_ITEMS", PAGE_ITEMS):
                ranked = d.scorer.rank(
                    request["query"], request["items"], show_progress=paged, **options
                )
            pairs = [(r.index, r.score) for r in ranked]
            check_ranked(pairs, relevance, mode, f"rank (paged {paged})")

    run()


@pytest.mark.parametrize("case, mode", CASE_MODES, ids=IDS)
def test_the_batcher_split_or_not_equals_score(doors, case, mode):
    d = doors(case, mode)

    @QUICK
    @hypothesis.given(request=score_requests(d.classification), window=st.integers(1, 4))
    def run(request, window):
        reference = d.scorer.score(**request)
        check_result(d.whole.score(**request), reference, mode, "Batcher")
        check_result(d.split.score(**request), reference, mode, "Batcher, split over steps")
        if not d.classification and len(request["labels"]) < 2:
            return  # a causal LM's chunk scores by a label within the labels: two at least
        chunked = {**request, "chunking": {"window": window, "stride": max(window - 1, 1)}}
        expected = d.scorer.score(**chunked)
        for batcher, what in ((d.whole, "chunked Batcher"), (d.split, "chunked, split Batcher")):
            got = batcher.score(**chunked)
            check(got.scores, expected.scores, mode, f"{what}: documents' scores")
            check_result(got.chunks, expected.chunks, mode, f"{what}: chunks")

    run()


# Its longest case, the three-class model in batch-invariant mode, runs with the slow tests: CI
# keeps that mode on the other two models and the three-class model in the default mode.
HTTP_CASE_MODES = [
    pytest.param(c, m, id=f"{c}-{m}",
                 marks=[pytest.mark.slow] if (c, m) == (THREE_CLASSES, "batch_invariant") else [])
    for c, m in CASE_MODES
]  # fmt: skip


@pytest.mark.parametrize("case, mode", HTTP_CASE_MODES)
def test_every_http_endpoint_that_scores_equals_the_library(doors, case, mode):
    d = doors(case, mode)

    @QUICK
    @hypothesis.given(request=score_requests(d.classification, min_items=1))
    def run(request):
        post = d.client.post
        reference = d.scorer.score(**request)
        sglang = post("/v1/score", json=request)
        assert sglang.status_code == 200, sglang.text
        check(sglang.json()["scores"], reference.scores, mode, "SGLang /v1/score")

        relevance = relevance_of(d, request)
        query, docs = request["query"], request["items"]
        for path in ("/score", "/v1/score"):  # vLLM's score: one query, its documents
            got = post(path, json={"text_1": query, "text_2": docs})
            assert got.status_code == 200, (path, got.text)
            pairs = sorted((x["index"], x["score"]) for x in got.json()["data"])
            check([s for _, s in pairs], relevance, mode, f"vLLM {path}")
        # vLLM /rerank, Cohere and Jina /v1/rerank (one shape), Cohere /v2/rerank
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            got = post(path, json={"query": query, "documents": docs})
            assert got.status_code == 200, (path, got.text)
            ranked = [(x["index"], x["relevance_score"]) for x in got.json()["results"]]
            check_ranked(ranked, relevance, mode, path)
        got = post("/rerank", json={"query": query, "texts": docs})  # TEI's body
        assert got.status_code == 200, got.text
        check_ranked([(x["index"], x["score"]) for x in got.json()], relevance, mode, "TEI")

    run()


def job_columns(doors: Doors, labels: list[str] | None) -> tuple[list[str], list[str]]:
    """The job's score columns: a causal LM's logprob_<label> and score_<label> (the softmax
    over the labels); a classifier's logit_<class> and score_<class> (its class probabilities),
    logits not being log-probabilities."""
    from tpuscore.jobs.spec import label_names

    if doors.classification:
        config = doors.scorer.config
        names = label_names(config.id2label or [str(i) for i in range(config.num_labels)])
        return [f"logit_{n}" for n in names], [f"score_{n}" for n in names]
    names = label_names(labels)
    return [f"logprob_{n}" for n in names], [f"score_{n}" for n in names]


def job_params(fmt: str):
    return [
        pytest.param(
            c,
            m,
            fmt,
            id=f"{c}-{m}-{fmt}",
        )
        for c, m in CASE_MODES
    ]


@pytest.mark.parametrize("case, mode, fmt", job_params("parquet") + job_params("jsonl"))
def test_a_job_equals_the_library(doors, case, mode, fmt, tmp_path_factory):
    from tpuscore.jobs import score_table

    d = doors(case, mode)

    @QUICK
    @hypothesis.given(
        request=score_requests(d.classification, min_items=1),
        shard_rows=st.integers(1, PAGE_ITEMS + 1),
    )
    def run(request, shard_rows):
        reference = d.scorer.score(**request)
        folder = tmp_path_factory.mktemp("job")
        n = len(request["items"])
        table = pa.table(
            {"i": list(range(n)), "query": [request["query"]] * n, "item": request["items"]}
        )
        source = folder / f"pairs.{fmt}"
        if fmt == "parquet":
            pq.write_table(table, source)
        else:
            source.write_text("".join(json.dumps(row) + "\n" for row in table.to_pylist()))
        output = folder / f"scores.{fmt}"
        labels = request.get("labels")
        score_table(
            source, output, scorer=d.scorer, labels=labels, id_columns=["i"],
            shard_rows=shard_rows, on_error="fail",
        )  # fmt: skip
        out = read_output(output, fmt).sort_by("i")
        assert out.column("i").to_pylist() == list(range(n))
        logit_columns, score_columns = job_columns(d, labels)
        got = np.stack([out.column(c).to_numpy() for c in logit_columns], 1)
        check(got, reference.logprobs, mode, f"job ({fmt}) {logit_columns}")
        got = np.stack([out.column(c).to_numpy() for c in score_columns], 1)
        check(got, reference.label_probs, mode, f"job ({fmt}) {score_columns}")

    run()


def read_output(output, fmt: str) -> pa.Table:
    parts = sorted(p for p in os.listdir(output) if p.endswith(f".{fmt}"))
    if fmt == "parquet":
        return pa.concat_tables(pq.read_table(os.path.join(output, p)) for p in parts)
    rows = []
    for part in parts:
        with open(os.path.join(output, part)) as lines:
            rows += [json.loads(line) for line in lines]
    return pa.Table.from_pylist(rows)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for the module (as tests/test_ray.py starts one)."""
    import ray

    start_ray()
    yield
    ray.shutdown()


# Ray Data runs the library's own calls in its workers (each starts, imports JAX and compiles:
# ~15-40 s a row), so each model meets it in one mode, both modes among them.
RAY_CASE_MODES = [
    (CAUSAL, "batch_invariant"),
    (ONE_LOGIT, "default"),
    (THREE_CLASSES, "batch_invariant"),
]


def ray_params():
    # Each case starts a Ray Data pipeline whose worker loads and compiles (~9 s): CI crosses
    # the door with a causal LM; the classifiers run with the slow tests (test_jobs_scores
    # checks ScoreRows, the function each worker runs, on both in every CI run).
    slow = {(ONE_LOGIT, "default"), (THREE_CLASSES, "batch_invariant")}
    return [
        pytest.param(c, m, id=f"{c}-{m}", marks=[pytest.mark.slow] if (c, m) in slow else [])
        for c, m in RAY_CASE_MODES
    ]


@pytest.mark.parametrize("case, mode", ray_params())
def test_ray_data_equals_the_library(doors, ray_cluster, checkpoint_dir, case, mode):
    import ray

    from tpuscore.integrations.ray import score_dataset

    d = doors(case, mode)

    # One draw a row: each draw is a Ray Data pipeline whose worker starts and compiles.
    @hypothesis.settings(QUICK, max_examples=1)
    @hypothesis.given(
        request=score_requests(d.classification, min_items=1),
        batch_size=st.integers(1, PAGE_ITEMS + 1),
    )
    def run(request, batch_size):
        reference = d.scorer.score(**request)
        n = len(request["items"])
        table = pa.table(
            {"i": list(range(n)), "query": [request["query"]] * n, "item": request["items"]}
        )
        labels = request.get("labels")
        scored = score_dataset(
            ray.data.from_arrow(table),
            model=str(checkpoint_dir(case)),
            dtype="float32",
            scorer_options={"batch_invariant": mode == "batch_invariant"},
            labels=labels,
            id_columns=["i"],
            batch_size=batch_size,
            concurrency=1,
            num_cpus=1,
        )
        out = pa.concat_tables(ray.get(scored.to_arrow_refs())).sort_by("i")
        assert out.column("i").to_pylist() == list(range(n))
        assert out.column("error_code").to_pylist() == [None] * n
        logit_columns, score_columns = job_columns(d, labels)
        got = np.stack([out.column(c).to_numpy() for c in logit_columns], 1)
        check(got, reference.logprobs, mode, f"Ray Data {logit_columns}")
        got = np.stack([out.column(c).to_numpy() for c in score_columns], 1)
        check(got, reference.label_probs, mode, f"Ray Data {score_columns}")

    run()


@pytest.mark.slow  # the bigger profile: the matrix above runs in CI with the default one
@pytest.mark.parametrize("case", CASES)
def test_more_draws_through_the_library_and_the_batcher(doors, case):
    d = doors(case, "default")

    @hypothesis.settings(QUICK, max_examples=15)
    @hypothesis.given(
        request=score_requests(d.classification), other=score_requests(d.classification)
    )
    def run(request, other):
        reference = d.scorer.score(**request)
        check_result(d.scorer.score_batch([other, request])[1], reference, "default", "score_batch")
        check_result(d.split.score(**request), reference, "default", "Batcher, split")
        check_result(d.whole.score(**request), reference, "default", "Batcher")

    run()
