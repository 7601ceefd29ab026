"""Classification-head checkpoints (`*ForSequenceClassification`): class logits at the pooled
token, equal to transformers' `AutoModelForSequenceClassification` in every backend."""

import numpy as np
import pytest
import scipy.special

from helpers import random_tokens
from hf_reference import hf_class_logits
from tpuscore import ValidationError
from tpuscore.api import templates

TEMPLATE_PLAIN = templates.get("plain")

# The backbones are test_parity_hf's; the head is one matmul shared by all, so the quick run
# takes one logit (llama), pad pooling (qwen3) and Gemma 1, and `slow` adds three classes.
SEQ_CLS_CASES = (
    "llama_seq_cls",
    "qwen3_seq_cls",
    "gemma_seq_cls",
    pytest.param("qwen2_seq_cls", marks=pytest.mark.slow),
)
BACKENDS = ("serial", "prefill_extend", "packed_dense", "packed_segment", "reference")
ATOL = 1e-4  # float32
PAD = 1  # qwen3_seq_cls's pad_token_id


@pytest.mark.parametrize("case", SEQ_CLS_CASES)
def test_class_logits_match_transformers(case, checkpoint_dir, scorers, rng):
    scorer = scorers(case)
    vocab, classes = scorer.config.vocab_size, scorer.config.num_labels
    query = random_tokens(rng, int(rng.integers(1, 40)), vocab)
    if query[-1] == PAD:  # with the empty item, a query ending in padding is refused (ambiguous)
        query[-1] = PAD + 1
    items = [random_tokens(rng, n, vocab) for n in (0, 1, 6, 17)]
    items[2][-2:] = [PAD, PAD]  # trailing padding: transformers pools the token before it
    expected = hf_class_logits(checkpoint_dir(case), [query + item for item in items])
    assert expected.shape == (4, classes)
    for backend in BACKENDS:
        result = scorer.score(query, items, backend=backend)
        assert result.classification
        np.testing.assert_allclose(result.logprobs, expected, atol=ATOL, rtol=0, err_msg=backend)


def test_scores_are_logits_or_class_probabilities(scorers):
    two, one = scorers("qwen3_seq_cls"), scorers("llama_seq_cls")
    logits = two.score([5, 6, 7], [[8], [9, 10]]).logprobs
    assert np.array_equal(two.score([5, 6, 7], [[8], [9, 10]]).scores, logits)
    softmax = two.score([5, 6, 7], [[8], [9, 10]], apply_softmax=True).scores
    np.testing.assert_allclose(softmax, scipy.special.softmax(logits, axis=1), rtol=1e-6)
    single = one.score([5, 6, 7], [[8], [9, 10]], apply_softmax=True)
    assert single.scores.shape == (2, 1)
    np.testing.assert_allclose(single.scores, scipy.special.expit(single.logprobs), rtol=1e-6)
    assert two.score([5], []).logprobs.shape == (0, 2)


def test_class_names_come_from_id2label(scorers):
    assert scorers("qwen2_seq_cls").config.id2label == ("negative", "neutral", "positive")
    assert scorers("qwen3_seq_cls").config.num_labels == 2  # from the head: no id2label written


@pytest.mark.parametrize(
    "kwargs, query, items, code, param",
    [
        (
            {"label_token_ids": [1, 2]},
            [5],
            [[6]],
            "labels_on_classification_model",
            "label_token_ids",
        ),
        ({"labels": ["a"]}, "q", ["x"], "labels_on_classification_model", "labels"),
        ({}, [5, PAD], [[PAD, PAD]], "padding_only_item", "items"),
    ],
)
def test_classification_requests_refused(scorers, kwargs, query, items, code, param):
    with pytest.raises(ValidationError) as raised:
        scorers("qwen3_seq_cls").score(query, items, **kwargs)
    assert (raised.value.code, raised.value.param) == (code, param)


def test_token_log_probabilities_are_refused_with_one_code(scorers):
    scorer = scorers("qwen3_seq_cls")
    for ask in (lambda: scorer.loglikelihood([5], [[6]]), lambda: scorer.prompt_logprobs([[5]])):
        with pytest.raises(ValidationError) as raised:
            ask()
        assert raised.value.code == "no_language_model_head"


def test_server_scores_and_reranks_a_classification_model(scorers):
    """SGLang's /v1/score without label_token_ids answers the class logits (their softmax with
    apply_softmax); /v1/rerank ranks by the relevant class (the last) through the template."""
    import httpx

    from test_server import TEMPLATE, ServerThread
    from tpuscore.serving import app as server

    scorer = scorers("qwen3_seq_cls")
    running = ServerThread(server.create_app(scorer, rerank_template=TEMPLATE))
    try:
        with httpx.Client(base_url=running.url, timeout=60) as client:
            body = {"query": [5, 6, 7], "items": [[8], [9, 10]]}
            for softmax in (False, True):
                got = client.post("/v1/score", json=body | {"apply_softmax": softmax})
                assert got.status_code == 200, got.text
                expected = scorer.score(**body, apply_softmax=softmax).scores
                np.testing.assert_allclose(got.json()["scores"], expected, rtol=1e-5, atol=1e-6)
            refused = client.post("/v1/score", json=body | {"label_token_ids": [1]})
            assert refused.status_code == 400
            assert refused.headers["x-error-code"] == "labels_on_classification_model"
            # No next-token distribution: the completions door says so as loglikelihood does.
            prompt = {"prompt": [5, 6, 7], "echo": True, "logprobs": 1, "max_tokens": 0}
            refused = client.post("/v1/completions", json=prompt)
            assert refused.status_code == 400
            assert refused.headers["x-error-code"] == "no_language_model_head"
            docs = ["a fox", "the market", "a river", "rotary embeddings"]
            ranked = client.post("/v1/rerank", json={"query": "fox?", "documents": docs})
            assert ranked.status_code == 200, ranked.text
            expected = scorer.rank(
                TEMPLATE.render_query("fox?"),
                [TEMPLATE.render_item(d) for d in docs],
                item_suffix=TEMPLATE.item_suffix,
                positive=1,
            )
            results = ranked.json()["results"]
            assert [r["index"] for r in results] == [r.index for r in expected]
            np.testing.assert_allclose(
                [r["relevance_score"] for r in results], [r.score for r in expected], rtol=1e-5
            )
    finally:
        running.stop()


def test_warmup_runs_on_a_classification_model(scorers):
    from helpers import fresh

    warmed = fresh(scorers("llama_seq_cls")).warmup([(5, 2, 3)], backends=["serial"])
    assert [w.backend for w in warmed] == ["serial"]


def test_orbax_round_trip_keeps_the_head(scorers, tmp_path):
    from tpuscore import Scorer

    scorer = scorers("qwen2_seq_cls")
    scorer.save(tmp_path / "ckpt")
    restored = Scorer.from_pretrained(tmp_path / "ckpt", dtype="float32")
    assert restored.config == scorer.config  # id2label and the rest through tpuscore.json
    query, items = [5, 6, 7], [[8], [9, 10]]
    np.testing.assert_array_equal(
        restored.score(query, items, backend="serial").logprobs,
        scorer.score(query, items, backend="serial").logprobs,
    )


# -- one result through every door (issue 39) ----------------------------------------------------


class Counted:
    """The scorer, counting its `run` calls."""

    def __init__(self, scorer):
        self.scorer, self.runs = scorer, 0

    def __getattr__(self, name):
        return getattr(self.scorer, name)

    def run(self, requests, **kwargs):
        self.runs += 1
        return self.scorer.run(requests, **kwargs)


@pytest.mark.parametrize("case", ["llama_seq_cls", "qwen2_seq_cls"])
def test_a_request_the_batcher_splits_scores_as_scored_alone(scorers, rng, case):
    """Split over steps by a small per-step cap, a classification request keeps its class
    logits: scores are the logits (or class probabilities), not exp(logits)."""
    from tpuscore import Batcher

    scorer = scorers(case)
    vocab = scorer.config.vocab_size
    query = random_tokens(rng, 6, vocab)
    items = [random_tokens(rng, int(n), vocab) for n in rng.integers(1, 9, size=6)]
    counted = Counted(scorer)
    with Batcher(counted, max_request_step_tokens=len(query) + 8, max_wait_ms=0) as batcher:
        for softmax in (False, True):
            alone = scorer.score(query, items, apply_softmax=softmax)
            before = counted.runs
            split = batcher.score(query=query, items=items, apply_softmax=softmax)
            assert counted.runs - before > 1  # it was split over steps
            assert split.classification and split.apply_softmax == softmax
            np.testing.assert_allclose(split.scores, alone.scores, atol=1e-5, rtol=1e-5)


def test_a_split_rerank_on_a_one_logit_model_ranks_as_scorer_rank(scorers):
    """Every rerank dialect on a one-logit reranker, over requests the Batcher splits, ranks as
    `Scorer.rank` with the server's template does (the sigmoid of the logit)."""
    from fastapi.testclient import TestClient

    from test_server import TEMPLATE
    from tpuscore.serving import app as server

    scorer = scorers("llama_seq_cls")
    docs = ["a fox", "the market opens", "a river", "rotary embeddings", "x"]
    expected = scorer.rank("fox?", docs, template=TEMPLATE)
    app = server.create_app(
        scorer, rerank_template=TEMPLATE, batcher_options={"max_request_step_tokens": 30}
    )
    with TestClient(app) as client:
        for path in ("/v1/rerank", "/v2/rerank", "/rerank"):
            got = client.post(path, json={"query": "fox?", "documents": docs})
            assert got.status_code == 200, (path, got.text)
            results = got.json()["results"]
            assert [r["index"] for r in results] == [r.index for r in expected], path
            np.testing.assert_allclose(
                [r["relevance_score"] for r in results],
                [r.score for r in expected],
                atol=1e-6,
                rtol=1e-5,
            )
    assert all(0 < r.score < 1 for r in expected)


def test_rank_with_a_template_on_a_classifier_ranks_by_the_relevant_class(scorers):
    scorer = scorers("qwen2_seq_cls")  # three classes: the relevant one is the last
    docs = ["a fox", "the market", "a lazy dog"]
    ranked = scorer.rank("fox?", docs, template=TEMPLATE_PLAIN, instruction="Is it a fox?")
    result = scorer.score(
        TEMPLATE_PLAIN.render_query("fox?", "Is it a fox?"),
        [TEMPLATE_PLAIN.render_item(d) for d in docs],
        item_suffix=TEMPLATE_PLAIN.item_suffix,
    )
    probs = scipy.special.softmax(result.logprobs, axis=1)[:, 2]
    assert [r.index for r in ranked] == np.argsort(-probs, kind="stable").tolist()
    np.testing.assert_allclose([r.score for r in ranked], np.sort(probs)[::-1], rtol=1e-5)
    with pytest.raises(ValidationError) as raised:
        scorer.rank("fox?", docs, template=TEMPLATE_PLAIN, labels=["a", "b"])
    assert (raised.value.code, raised.value.param) == ("invalid_argument", "labels")
