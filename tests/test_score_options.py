"""score()'s item_suffix, max_item_tokens and truncate, and text that is not valid Unicode: each
equals serial scoring of the tokens built by hand, and each bad value has its own code."""

import numpy as np
import pytest

from helpers import SpyBackend, fresh, random_tokens
from tpuscore import ScoreOptions, ValidationError, backends

CASE = "llama3_rope_tied"  # its tokenizer adds a BOS: the suffix must not get one
VOCAB = 313  # tokenizer vocabulary (the model's is 331)
ATOL = 1e-4


@pytest.fixture
def scorer(scorers):
    backends.register("spy", SpyBackend)
    SpyBackend.calls = 0
    return fresh(scorers(CASE))  # an empty prefix cache: token counts are exact


def encode(scorer, text, special=False):
    return scorer.tokenizer.encode(text, add_special_tokens=special).ids


# One geometry for every run here, so the jitted steps compile once: a 12-token query, 4 items
# of at most 12 tokens plus a 4-token suffix (item bucket 16, serial sequences bucket 32).
QUERY_LEN, ITEM_LENS, SUFFIX_LEN = 12, (5, 12, 0, 9), 4


def test_item_suffix_text_equals_serial_on_the_concatenated_tokens(scorer):
    query = "Is this about a fox?"
    items = [" The quick fox.", "", " A dog.", " The lazy dog."]
    suffix, labels = "\nA: ", ["x", "e"]
    got = scorer.score(query, items, labels=labels, item_suffix=suffix)
    suffix_ids = encode(scorer, suffix)
    assert suffix_ids and suffix_ids[0] != encode(scorer, "", special=True)[0]  # no BOS
    by_hand = [encode(scorer, item) + suffix_ids for item in items]
    query_ids = encode(scorer, query, special=True)
    expected = scorer.score(query_ids, by_hand, labels=labels, backend="serial")
    np.testing.assert_allclose(got.logprobs, expected.logprobs, atol=ATOL, rtol=0)
    assert got.num_tokens == expected.num_tokens - 3 * len(query_ids)  # the query runs once


def test_item_suffix_ids_equal_serial_on_the_concatenated_tokens(scorer, rng):
    query = random_tokens(rng, QUERY_LEN, VOCAB)
    items = [random_tokens(rng, n, VOCAB) for n in ITEM_LENS]
    suffix = random_tokens(rng, SUFFIX_LEN, VOCAB)
    got = scorer.score(query, items, [3, 7, 11], item_suffix=suffix, backend="prefill_extend")
    expected = scorer.score(query, [i + suffix for i in items], [3, 7, 11], backend="serial")
    np.testing.assert_allclose(got.logprobs, expected.logprobs, atol=ATOL, rtol=0)


def test_item_suffix_comes_before_the_query_with_item_first(scorer, rng):
    query = random_tokens(rng, QUERY_LEN, VOCAB)
    items = [random_tokens(rng, n, VOCAB) for n in ITEM_LENS]
    suffix = random_tokens(rng, SUFFIX_LEN, VOCAB)
    got = scorer.score(query, items, [4, 5], item_suffix=suffix, item_first=True)
    sequences = [item + suffix + query for item in items]
    expected = scorer.score([], sequences, [4, 5], backend="serial")
    np.testing.assert_allclose(got.logprobs, expected.logprobs, atol=ATOL, rtol=0)


@pytest.mark.parametrize("truncate", ["right", "left"])
def test_truncation_keeps_the_first_or_last_tokens_before_the_suffix(scorer, rng, truncate):
    query = random_tokens(rng, QUERY_LEN, VOCAB)
    items = [random_tokens(rng, n, VOCAB) for n in (5, 12, 20, 13)]
    suffix = random_tokens(rng, SUFFIX_LEN, VOCAB)
    got = scorer.score(
        query, items, [5, 6], item_suffix=suffix, max_item_tokens=12, truncate=truncate,
        backend="prefill_extend",
    )  # fmt: skip
    kept = [i[:12] if truncate == "right" else i[-12:] for i in items]
    assert [len(k) for k in kept] == [5, 12, 12, 12]
    expected = scorer.score(query, [k + suffix for k in kept], [5, 6], backend="serial")
    np.testing.assert_allclose(got.logprobs, expected.logprobs, atol=ATOL, rtol=0)
    assert got.num_tokens == QUERY_LEN + sum(len(k) + SUFFIX_LEN for k in kept)


def test_truncation_of_text_counts_the_item_tokens(scorer):
    items = [
        " The river ran past the old mill, under the stone bridge.",
        " Children played in the park until the evening light faded.",
        " Numbers such as 12, 345 and 6789 appear in text too.",
        " short",
    ]
    ids = [encode(scorer, item) for item in items]
    assert min(len(i) for i in ids[:3]) > 16
    got = scorer.score("q", items, labels=["x"], max_item_tokens=16, truncate="left")
    expected = scorer.score(
        encode(scorer, "q", special=True), [i[-16:] for i in ids], encode(scorer, "x")
    )
    np.testing.assert_array_equal(got.logprobs, expected.logprobs)


def test_a_too_long_item_is_an_error_unless_truncation_is_asked(scorer):
    query, item = [1] * 500, [2] * 30  # max_position_embeddings is 512
    with pytest.raises(ValidationError, match="max_item_tokens") as raised:
        scorer.score(query, [item], [1], backend="spy")
    assert raised.value.code == "sequence_too_long"
    scorer.score(query, [item], [1], max_item_tokens=12, backend="spy")
    with pytest.raises(ValidationError, match="2-token item_suffix") as raised:
        scorer.score(query, [item], [1], max_item_tokens=12, item_suffix=[3, 4], backend="spy")
    assert raised.value.code == "sequence_too_long"  # the suffix is never cut
    assert SpyBackend.calls == 1


def test_score_batch_requests_carry_the_new_arguments(scorer, rng):
    query = random_tokens(rng, QUERY_LEN, VOCAB)
    items = [random_tokens(rng, 16, VOCAB) for _ in range(2)]
    request = {"query": query, "items": items, "label_token_ids": [1, 2]}
    options = {"item_suffix": [7], "max_item_tokens": 4, "truncate": "left"}
    got = scorer.score_batch([request, {**request, **options}])
    expected = scorer.score(query, items + [i[-4:] + [7] for i in items], [1, 2], backend="serial")
    np.testing.assert_allclose(got[0].logprobs, expected.logprobs[:2], atol=ATOL, rtol=0)
    np.testing.assert_allclose(got[1].logprobs, expected.logprobs[2:], atol=ATOL, rtol=0)


SURROGATE = "a\ud800b"

BAD = [
    # (code, param, query, items, kwargs)
    ("invalid_text", "query", SURROGATE, ["x"], {}),
    ("invalid_text", "items[1]", "q", ["x", SURROGATE], {}),
    ("invalid_text", "labels[1]", "q", ["x"], {"labels": ["x", "\udfff"]}),
    ("invalid_text", "item_suffix", "q", ["x"], {"item_suffix": SURROGATE}),
    ("invalid_argument", "item_suffix", "q", ["x"], {"item_suffix": 5}),
    ("invalid_argument", "item_suffix", "q", ["x"], {"item_suffix": [1.5]}),
    ("token_id_exceeds_vocab", "item_suffix", "q", ["x"], {"item_suffix": [331]}),
    ("invalid_argument", "max_item_tokens", "q", ["x"], {"max_item_tokens": 0}),
    ("invalid_argument", "max_item_tokens", "q", ["x"], {"max_item_tokens": 2.0}),
    ("invalid_argument", "max_item_tokens", "q", ["x"], {"max_item_tokens": True}),
    ("invalid_argument", "truncate", "q", ["x"], {"truncate": "middle"}),
    ("invalid_argument", "truncate", "q", ["x"], {"truncate": None}),
]


@pytest.mark.parametrize("code, param, query, items, kwargs", BAD, ids=[b[1] for b in BAD])
def test_bad_values_raise_their_code_before_a_backend(scorer, code, param, query, items, kwargs):
    kwargs = {"label_token_ids": [1, 2], **kwargs}
    if "labels" in kwargs:
        del kwargs["label_token_ids"]
    with pytest.raises(ValidationError) as raised:
        scorer.score(query, items, backend="spy", **kwargs)
    assert (raised.value.code, raised.value.param) == (code, param)
    assert SpyBackend.calls == 0


def test_invalid_text_is_named_inside_score_batch(scorer):
    requests = [{"query": "q", "items": ["x"], "labels": ["x"]}] * 2
    requests[1] = {**requests[1], "items": ["fine", "\ud800"]}
    with pytest.raises(ValidationError) as raised:
        scorer.score_batch(requests, backend="spy")
    assert (raised.value.code, raised.value.param) == ("invalid_text", "requests[1].items[1]")


# Every entry point that takes a request's options checks their names against ScoreOptions.
OPTION_TAKERS = {
    "score": lambda s, **kw: s.score([1, 2], [[3]], **kw),
    "prepare": lambda s, **kw: s.prepare([1, 2], [[3]], **kw),
    "plan": lambda s, **kw: s.plan([1, 2], [[3]], **kw),
    "rank": lambda s, **kw: s.rank([1, 2], [[3], [4]], **kw),
    "score_batch": lambda s, **kw: s.score_batch([{"query": [1, 2], "items": [[3]], **kw}]),
}


@pytest.mark.parametrize("method", OPTION_TAKERS)
def test_an_unknown_option_is_invalid_argument_naming_the_allowed_ones(scorer, method):
    with pytest.raises(ValidationError) as raised:
        OPTION_TAKERS[method](scorer, label_token_ids=[1, 2], lables=["x"])
    assert raised.value.code == "invalid_argument"
    assert raised.value.param.endswith("lables")
    assert all(name in str(raised.value) for name in ScoreOptions.names())
    assert SpyBackend.calls == 0


def test_the_options_reach_validation_by_keyword_and_label_ids_by_position(scorer):
    request = scorer.prepare([1, 2], [[3, 4, 5]], [6], max_item_tokens=1, item_suffix=[7])
    assert (request.items, request.label_ids) == ([[3, 7]], [6])
    assert scorer.prepare("q", ["x"], labels=["x"]).label_ids == encode(scorer, "x")
    with pytest.raises(TypeError):  # one request, one set of labels
        scorer.prepare([1], [[2]], [3], label_token_ids=[4])
    plan = scorer.plan([1, 2], [[3]], [5], item_first=True, backend="spy")  # backend: ignored
    assert not plan["prefill_extend"].eligible  # it cannot run item_first: the option arrived
