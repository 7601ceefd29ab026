"""Scorer.score_batch: many requests in one call, each result as if scored alone."""

import numpy as np
import pytest

from helpers import ALONE_VS_BATCHED, random_tokens
from tpuscore import Scorer, ValidationError, backends


def test_results_equal_scoring_each_request_alone(scorers, rng):
    scorer = scorers("llama3_rope_tied")
    vocab = scorer.config.vocab_size
    user = random_tokens(rng, 30, vocab)
    pages = [[random_tokens(rng, int(n), vocab) for n in rng.integers(0, 12, 5)] for _ in range(3)]
    requests = [
        {"query": user, "items": pages[0], "label_token_ids": [1, 2]},
        {"query": random_tokens(rng, 9, vocab), "items": pages[1], "label_token_ids": [1, 2]},
        {"query": user, "items": pages[2], "label_token_ids": [1, 2], "apply_softmax": True},
        {"query": user, "items": [], "label_token_ids": [1, 2, 3]},
        {"query": user, "items": pages[1], "label_token_ids": [5]},  # other labels
        {"query": user, "items": pages[0], "label_token_ids": [1, 2], "item_first": True},
        {"query": "the fox", "items": [" jumps", ""], "labels": [" the", "x"]},
    ]
    results = scorer.score_batch(requests)
    assert len(results) == len(requests)
    for request, result in zip(requests, results, strict=True):
        alone = scorer.score(**request)
        np.testing.assert_allclose(result.logprobs, alone.logprobs, **ALONE_VS_BATCHED)
        assert result.apply_softmax == request.get("apply_softmax", False)
        assert not result.logprobs.flags.writeable
    assert results[3].logprobs.shape == (0, 3) and results[3].backend == "none"
    assert results[5].backend == "serial"  # item_first goes to serial under auto
    # auto picks once for all of a call's query-first groups (`planning.plan`), which may differ
    # from a request's pick alone: together they share steps and a query's prefill.
    assert len({r.backend for i, r in enumerate(results) if i not in (3, 5)}) == 1


def test_requests_sharing_a_query_run_it_once(scorers, rng):
    base = scorers("qwen2_bias")
    scorer = Scorer(base.config, base.params, base.tokenizer)
    vocab = scorer.config.vocab_size
    query = random_tokens(rng, 40, vocab)
    pages = [[random_tokens(rng, int(n), vocab) for n in rng.integers(1, 9, 4)] for _ in range(5)]
    results = scorer.score_batch(
        [{"query": query, "items": p, "label_token_ids": [3]} for p in pages],
        backend="prefill_extend",
    )
    cache = scorer.get_backend("prefill_extend").cache
    assert (cache.misses, cache.hits) == (1, 0)  # one backend call for all five pages
    item_tokens = [sum(map(len, page)) for page in pages]
    assert sum(r.num_tokens for r in results) == len(query) + sum(item_tokens)
    for result, tokens in zip(results, item_tokens, strict=True):
        assert result.num_tokens >= tokens  # its own items, plus its share of the query


def test_serial_token_counts_split_exactly(scorers, rng):
    scorer = scorers("qwen3_qknorm")
    query = random_tokens(rng, 11, scorer.config.vocab_size)
    pages = [[[1, 2, 3]], [[4], [5, 6]]]
    requests = [{"query": query, "items": p, "label_token_ids": [1]} for p in pages]
    results = scorer.score_batch(requests, backend="serial")
    assert [r.num_tokens for r in results] == [11 + 3, 2 * 11 + 3]


@pytest.mark.parametrize(
    "bad, code, param",
    [
        (
            {"query": [1], "items": [[2]], "label_token_ids": []},
            "empty_label_token_ids",
            "requests[1].label_token_ids",
        ),
        (
            {"query": [1], "items": [[10**6]], "label_token_ids": [1]},
            "token_id_exceeds_vocab",
            "requests[1].items[0]",
        ),
        ({"query": [1], "items": [[2]]}, "no_classification_head", "requests[1].label_token_ids"),
        ({"query": [1], "label_token_ids": [1]}, "invalid_argument", "requests[1].items"),
        (
            {"query": [1], "items": [[2]], "label_token_ids": [1], "colour": 1},
            "invalid_argument",
            "requests[1].colour",
        ),
        (([1], [[2]], [1]), "invalid_argument", "requests[1]"),
    ],
)
def test_a_bad_request_fails_the_call_before_anything_runs(scorers, bad, code, param):
    scorer = scorers("qwen3_qknorm")
    good = {"query": [1, 2], "items": [[3]], "label_token_ids": [4]}
    with pytest.raises(ValidationError) as err:
        scorer.score_batch([good, bad])
    assert err.value.code == code and err.value.param == param
    assert "requests[1]" in str(err.value)


def test_an_unknown_backend_is_refused(scorers):
    with pytest.raises(ValidationError) as err:
        scorers("qwen3_qknorm").score_batch([], backend="nope")
    assert err.value.code == "unknown_backend"
    assert scorers("qwen3_qknorm").score_batch([]) == []


def test_an_internal_type_error_is_not_relabelled(scorers):
    class Broken(backends.PerGroupBackend):
        def __init__(self, model, options):
            pass

        def score(self, batch):
            raise TypeError("a bug inside a backend")

    backends.register("broken", Broken)
    with pytest.raises(TypeError, match="a bug inside a backend"):
        scorers("qwen3_qknorm").score_batch(
            [{"query": [1], "items": [[2]], "label_token_ids": [3]}], backend="broken"
        )


def test_validate_batch_gives_an_error_per_request_located_as_data(scorers):
    scorer = scorers("qwen3_qknorm")
    good = {"query": [1, 2], "items": [[3]], "label_token_ids": [4]}
    requests = [
        good,
        {"query": [1], "items": [[2], [10**6]], "label_token_ids": [1]},
        good,
        {"query": [1], "items": [[2]]},
        "not a mapping",
        {**good, "item_first": True},
    ]
    errors = scorer.validate_batch(requests)
    assert [e and e.code for e in errors] == [
        None, "token_id_exceeds_vocab", None, "no_classification_head", "invalid_argument", None
    ]  # fmt: skip
    assert errors[1].loc == ("requests", 1, "items", 1) and errors[1].request_index == 1
    assert errors[1].param == "requests[1].items[1]"
    assert errors[1].message.startswith("items[1][0] is 1000000")  # without the location
    assert str(errors[1]) == f"requests[1]: {errors[1].message}"
    assert errors[4].loc == ("requests", 4)
    # A backend that cannot run a request refuses it here, not mid-batch.
    refused = scorer.validate_batch(requests[5:], backend="prefill_extend")
    assert refused[0].code == "unsupported_option" and refused[0].request_index == 0
    prepared = scorer.prepare_batch(requests, errors="return")
    assert [type(p).__name__ for p in prepared[:2]] == ["ScoreRequest", "ValidationError"]
    results = scorer.run([prepared[0], prepared[2]])
    np.testing.assert_array_equal(results[0].logprobs, scorer.score(**good).logprobs)


def test_prepare_request_takes_a_mapping_as_score_batch_does(scorers):
    scorer = scorers("qwen3_qknorm")
    request = {"query": [1, 2], "items": [[3], [4, 5]], "label_token_ids": [4], "truncate": "left"}
    assert scorer.prepare_request(request) == scorer.prepare(**request)
    with pytest.raises(ValidationError) as raised:
        scorer.prepare_request({**request, "colour": 1})
    assert raised.value.loc == ("colour",) and raised.value.code == "invalid_argument"
    with pytest.raises(ValidationError) as raised:
        scorer.prepare_request(request, backend="nope")
    assert raised.value.code == "unknown_backend"


def test_a_located_error_keeps_its_location_through_pickling():
    import pickle

    error = ValidationError("c", "bad", "items[2]").at("requests", 3)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.code, copy.loc, copy.message, str(copy)) == (
        "c", ("requests", 3, "items", 2), "bad", "requests[3]: bad"
    )  # fmt: skip
    assert error.within("requests[3]").loc == ("requests", 3, "requests", 3, "items", 2)


def test_run_refuses_what_prepare_did_not_make(scorers):
    """A mapping of score's arguments (score_batch's input) is refused by position, not met as
    an AttributeError inside the planner."""
    scorer = scorers("llama_gqa_untied")
    good = scorer.prepare([1, 2], [[3]], [4, 5])
    for requests, param in [
        ([good, {"query": [1], "items": [[2]]}], "requests[1]"),
        ("q", "requests"),
    ]:
        with pytest.raises(ValidationError) as refused:
            scorer.run(requests)
        assert (refused.value.code, refused.value.param) == ("invalid_argument", param)
