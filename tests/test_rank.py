"""rank(): items sorted by P(positive) within the labels, ties in input order, top_k; templates
applied; progress bars off by default."""

import attrs
import numpy as np
import pytest

from helpers import random_tokens
from tpuscore import ScoreResult, ValidationError
from tpuscore.api import templates
from tpuscore.tasks import ranking
from tpuscore.tasks.ranking import rank_result

CASE = "llama3_rope_tied"
VOCAB = 313
QUERY_LEN = 12  # the geometry of test_score_options.py, so the steps compile once per session


def test_rank_result_sorts_by_positive_probability_and_keeps_ties_in_input_order():
    p_yes = np.array([0.5, 0.9, 0.5, 0.1, 0.9, 0.7])
    logprobs = np.log(np.stack([p_yes, 1 - p_yes], axis=1)) - 3.0  # not normalized over labels
    result = ScoreResult(logprobs, backend="x", num_tokens=0)
    items = ["a", "b", "c", "d", "e", "f"]
    ranked = rank_result(result, items)
    assert [r.index for r in ranked] == [1, 4, 5, 0, 2, 3]
    assert [r.item for r in ranked] == ["b", "e", "f", "a", "c", "d"]
    np.testing.assert_allclose([r.score for r in ranked], p_yes[[1, 4, 5, 0, 2, 3]], rtol=1e-6)
    assert all(isinstance(r.score, float) and isinstance(r.index, int) for r in ranked)
    assert [r.index for r in rank_result(result, items, positive=1)] == [3, 0, 2, 5, 1, 4]
    assert rank_result(result, items, top_k=2) == ranked[:2]
    assert rank_result(result, items, top_k=100) == ranked


def test_rank_equals_sorting_score_label_probs(scorers, rng):
    scorer = scorers(CASE)
    query = random_tokens(rng, QUERY_LEN, VOCAB)
    items = [random_tokens(rng, n, VOCAB) for n in (5, 12, 16, 9)]
    labels = [3, 7, 11]
    ranked = scorer.rank(query, items, label_token_ids=labels, positive=1, top_k=3)
    logprobs = scorer.score(query, items, labels).logprobs.astype(np.float64)
    p = np.exp(logprobs[:, 1]) / np.exp(logprobs).sum(axis=1)  # P(positive) within the labels
    expected = np.argsort(-p, kind="stable")[:3]
    assert [r.index for r in ranked] == expected.tolist()
    np.testing.assert_allclose([r.score for r in ranked], p[expected], atol=1e-5, rtol=0)
    assert [r.item for r in ranked] == [items[i] for i in expected]


def test_rank_with_a_template_equals_scoring_the_rendered_prompt(scorers):
    scorer = scorers(CASE)
    # The tests' tokenizer has no single-token " yes": the plain template with one-byte labels.
    template = attrs.evolve(templates.get("plain"), labels=("x", "e"))
    query, instruction = "Which passage is about a fox?", "Is it about a fox?"
    docs = ["The quick brown fox.", "The market opens early.", "A lazy dog.", ""]
    ranked = scorer.rank(query, docs, template=template, instruction=instruction)
    result = scorer.score(
        f"{instruction}\n\nQuery: {query}\n",
        [f"Document: {d}" for d in docs],
        labels=["x", "e"],
        item_suffix="\nRelevant:",
    )
    expected = np.argsort(-result.label_probs[:, 0], kind="stable")
    assert [r.index for r in ranked] == expected.tolist()
    assert [r.item for r in ranked] == [docs[i] for i in expected]  # as given, not rendered
    np.testing.assert_allclose(
        [r.score for r in ranked], result.label_probs[expected, 0], atol=1e-5, rtol=0
    )


BAD = [
    # (code, param, kwargs)
    ("invalid_argument", "labels", {"template": "plain", "labels": ["x", "e"]}),
    ("invalid_argument", "label_token_ids", {"template": "plain", "label_token_ids": [1, 2]}),
    ("invalid_argument", "item_suffix", {"template": "plain", "item_suffix": "x"}),
    ("invalid_argument", "instruction", {"label_token_ids": [1, 2], "instruction": "x"}),
    ("invalid_argument", "instruction", {"template": "plain", "instruction": 5}),
    ("invalid_text", "instruction", {"template": "plain", "instruction": "\ud800"}),
    ("unknown_template", "template", {"template": "nope"}),
    ("invalid_query", "query", {"template": "plain", "query": [1, 2]}),
    ("invalid_items", "items[1]", {"template": "plain", "items": ["a", [1]]}),
    ("invalid_argument", "labels", {"label_token_ids": [1]}),
    ("invalid_argument", "positive", {"label_token_ids": [1, 2], "positive": 2}),
    ("invalid_argument", "positive", {"label_token_ids": [1, 2], "positive": -1}),
    ("invalid_argument", "positive", {"label_token_ids": [1, 2], "positive": True}),
    ("invalid_argument", "top_k", {"label_token_ids": [1, 2], "top_k": 0}),
    ("invalid_argument", "top_k", {"label_token_ids": [1, 2], "top_k": 2.0}),
    ("no_classification_head", "label_token_ids", {}),
]


@pytest.mark.parametrize("code, param, kwargs", BAD, ids=[f"{b[1]}-{b[0]}" for b in BAD])
def test_bad_rank_arguments_raise_their_code(scorers, code, param, kwargs):
    kwargs = {"query": "q", "items": ["a", "b"], **kwargs}
    with pytest.raises(ValidationError) as raised:
        scorers(CASE).rank(**kwargs, backend="no_such_backend")  # validation comes first
    assert (raised.value.code, raised.value.param) == (code, param)


def test_rank_with_progress_pages_the_items_and_equals_without(scorers, rng, capfd, monkeypatch):
    scorer = scorers(CASE)
    query = random_tokens(rng, QUERY_LEN, VOCAB)
    lens = [16, *rng.integers(1, 17, size=3), 16, *rng.integers(1, 17, size=3)]
    items = [random_tokens(rng, int(n), VOCAB) for n in lens]
    plain = scorer.rank(query, items, label_token_ids=[5, 6])
    assert capfd.readouterr().err == ""  # off by default
    monkeypatch.setattr(ranking, "PROGRESS_PAGE_ITEMS", 4)
    paged = scorer.rank(query, items, label_token_ids=[5, 6], show_progress=True)
    assert "8/8" in capfd.readouterr().err
    assert [r.index for r in paged] == [r.index for r in plain]
    np.testing.assert_allclose([r.score for r in paged], [r.score for r in plain], atol=1e-6)


def test_score_batch_progress_counts_requests(scorers, rng, capfd):
    scorer = scorers(CASE)
    query = random_tokens(rng, QUERY_LEN, VOCAB)
    requests = [
        {"query": query, "items": [random_tokens(rng, 16, VOCAB)] * 4, "label_token_ids": [1]},
        {"query": query[:5], "items": [random_tokens(rng, 16, VOCAB)] * 4, "label_token_ids": [1]},
        {"query": query, "items": [], "label_token_ids": [1]},
    ]
    quiet = scorer.score_batch(requests)
    assert capfd.readouterr().err == ""
    shown = scorer.score_batch(requests, show_progress=True)
    assert "3/3" in capfd.readouterr().err
    for a, b in zip(quiet, shown, strict=True):
        np.testing.assert_array_equal(a.logprobs, b.logprobs)


def test_rank_takes_every_score_option(scorers, rng):
    scorer = scorers(CASE)
    query = random_tokens(rng, QUERY_LEN, VOCAB)
    items = [random_tokens(rng, n, VOCAB) for n in (5, 12, 16, 9)]
    options = {"item_first": True, "max_item_tokens": 8, "truncate": "left", "item_suffix": [9]}
    ranked = scorer.rank(query, items, label_token_ids=[3, 7], backend="serial", **options)
    result = scorer.score(query, [i[-8:] + [9] for i in items], [3, 7], item_first=True)
    expected = rank_result(result, items)
    assert [r.index for r in ranked] == [r.index for r in expected]
    np.testing.assert_allclose(
        [r.score for r in ranked], [r.score for r in expected], atol=1e-5, rtol=0
    )


def test_concat_joins_parts_of_one_kind_and_reads_them_as_each_part():
    logits = np.array([[0.3], [-1.2], [2.0]], np.float32)
    parts = [
        ScoreResult(logits[:1], "serial", 5, apply_softmax=False, classification=True),
        ScoreResult(logits[1:], "packed_dense", 7, apply_softmax=False, classification=True),
    ]
    joined = ScoreResult.concat(parts)
    assert joined.classification and joined.backend == "serial+packed_dense"
    assert joined.num_tokens == 12
    np.testing.assert_array_equal(joined.scores, logits)  # logits, not exp(logits)
    assert [r.index for r in rank_result(joined, ["a", "b", "c"])] == [2, 0, 1]
    assert ScoreResult.concat(parts[:1]) is parts[0]
    with pytest.raises(ValueError, match="different kinds"):
        ScoreResult.concat([parts[0], ScoreResult(logits[1:], "serial", 1)])
    with pytest.raises(ValueError, match="at least one part"):
        ScoreResult.concat([])
