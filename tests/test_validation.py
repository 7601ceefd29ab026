"""Every validation code is raised by a bad input, and no bad input reaches a backend."""

from numbers import Integral

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from helpers import SpyBackend
from tpuscore import ValidationError, backends
from tpuscore.api import argument_checks

CASE = "llama_gqa_untied"  # vocab 331, max_position_embeddings 512


@pytest.fixture
def scorer(scorers):
    backends.register("spy", SpyBackend)
    SpyBackend.calls = 0
    return scorers(CASE)


BAD = [
    # (code, param, query, items, kwargs)
    ("invalid_query", "query", None, [[1]], {}),
    ("invalid_query", "query", 3, [[1]], {}),
    ("invalid_query", "query", [1, "a"], [[1]], {}),
    ("invalid_query", "query", [1.5], [[1]], {}),
    ("invalid_query", "query", [True], [[1]], {}),
    ("invalid_items", "items", "abc", 5, {}),
    ("invalid_items", "items", [1], "not a list", {}),
    ("invalid_items", "items", [1], [[1], None], {}),
    ("invalid_items", "items[0]", [1], [[1, 2.0]], {}),
    ("invalid_items", "items", [1], [{"a": 1}], {}),
    ("mixed_input_types", "items", "text", [[1, 2]], {}),
    ("mixed_input_types", "items", [1, 2], ["text"], {}),
    ("mixed_input_types", "items", [1, 2], [[1], "text"], {}),
    ("empty_sequence", "items", [], [[1], []], {}),
    ("empty_sequence", "items", "", [""], {}),
    ("empty_label_token_ids", "label_token_ids", [1], [[1]], {"label_token_ids": []}),
    ("no_classification_head", "label_token_ids", [1], [[1]], {"label_token_ids": None}),
    ("empty_label_token_ids", "labels", "q", ["x"], {"labels": []}),
    ("invalid_label_token_ids", "label_token_ids", [1], [[1]], {"label_token_ids": 5}),
    ("invalid_label_token_ids", "label_token_ids", [1], [[1]], {"label_token_ids": [[1, 2]]}),
    ("invalid_label_token_ids", "label_token_ids", [1], [[1]], {"label_token_ids": [1.0]}),
    ("invalid_label_token_ids", "labels", "q", ["x"], {"labels": " yes"}),
    ("invalid_label_token_ids", "labels", "q", ["x"], {"labels": [3]}),
    ("invalid_label_token_ids", "labels", "q", ["x"], {"label_token_ids": [1], "labels": ["a"]}),
    ("token_id_negative", "label_token_ids", [1], [[1]], {"label_token_ids": [3, -1]}),
    ("token_id_negative", "query", [1, -2], [[1]], {}),
    ("token_id_negative", "items[1]", [1], [[1], [4, -7]], {}),
    ("token_id_exceeds_vocab", "label_token_ids", [1], [[1]], {"label_token_ids": [331]}),
    ("token_id_exceeds_vocab", "query", [400], [[1]], {}),
    ("token_id_exceeds_vocab", "items[0]", [1], [[331]], {}),
    ("multi_token_label", "labels", "q", ["x"], {"labels": [" naïve café"]}),
    ("multi_token_label", "labels", "q", ["x"], {"labels": [""]}),
    ("sequence_too_long", "items", [1] * 501, [[1] * 12], {}),
    ("sequence_too_long", "items", "fox " * 600, [""], {}),
    ("invalid_argument", "apply_softmax", [1], [[1]], {"apply_softmax": "yes"}),
    ("invalid_argument", "item_first", [1], [[1]], {"item_first": 1}),
    ("unknown_backend", "backend", [1], [[1]], {"backend": "no_such_backend"}),
]


@pytest.mark.parametrize("code, param, query, items, kwargs", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_its_code_and_never_reaches_a_backend(
    scorer, code, param, query, items, kwargs
):
    kwargs = {"label_token_ids": [1, 2], **kwargs}
    if "labels" in kwargs and kwargs.get("label_token_ids") == [1, 2]:
        del kwargs["label_token_ids"]
    with pytest.raises(ValidationError) as raised:
        scorer.score(query, items, backend=kwargs.pop("backend", "spy"), **kwargs)
    assert raised.value.code == code
    assert raised.value.param == param
    assert isinstance(raised.value, ValueError)
    assert SpyBackend.calls == 0


def test_every_documented_code_is_exercised():
    codes = {b[0] for b in BAD}
    required = {
        "invalid_query", "invalid_items", "mixed_input_types", "empty_sequence",
        "empty_label_token_ids", "invalid_label_token_ids", "token_id_negative",
        "token_id_exceeds_vocab", "multi_token_label", "sequence_too_long",
    }  # fmt: skip
    assert required <= codes


def test_multi_token_label_error_names_label_and_tokens(scorer):
    with pytest.raises(ValidationError, match=r"label ' naïve café' encodes to \d+ tokens \[\d+"):
        scorer.score("q", ["x"], labels=[" naïve café"], backend="spy")


def test_valid_edge_inputs_reach_the_backend(scorer):
    scorer.score([], [[5]], [1], backend="spy")  # empty query, non-empty item
    scorer.score("", ["x"], [1], backend="spy")
    scorer.score([1], [[]], [1], backend="spy")  # empty item, non-empty query
    scorer.score(np.array([1, 2]), [np.array([3])], np.array([4, 5]), backend="spy")
    scorer.score((1, 2), [(3,)], (4,), backend="spy")
    scorer.score([1] * 500, [[1] * 12], [1], backend="spy")  # exactly max_position_embeddings
    assert SpyBackend.calls == 6


def test_empty_items_return_an_empty_result_without_a_backend(scorer):
    result = scorer.score("query", [], [1, 2, 3], backend="spy")
    assert result.logprobs.shape == (0, 3) and result.backend == "none"
    assert result.scores.shape == (0, 3) and result.label_probs.shape == (0, 3)
    assert SpyBackend.calls == 0


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(
    st.lists(
        st.one_of(
            st.integers(-2, 12),
            st.booleans(),
            st.integers(0, 11).map(np.int32),
            st.floats(0, 5),
        ),
        max_size=20,
    )
)
def test_token_ids_accept_exactly_ints_inside_the_vocabulary(values):
    """The check of a token-id list (a fast path for plain int lists, else element by element):
    the ids back as ints, or the first bad element named, whatever the list holds."""
    vocab = 10
    bad = [
        j
        for j, v in enumerate(values)
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, Integral) or not 0 <= v < vocab
    ]
    ints = all(type(v) is int for v in values)  # also as an int64 array
    for given in [values, np.array(values, dtype=np.int64)] if ints else [values]:
        if not bad:
            ids = argument_checks.token_ids(given, "query", "invalid_query", vocab)
            assert ids == [int(v) for v in values] and all(type(t) is int for t in ids)
            assert ids is not given  # the caller's list is not kept
        else:
            with pytest.raises(ValidationError) as e:
                argument_checks.token_ids(given, "query", "invalid_query", vocab)
            assert f"query[{bad[0]}]" in str(e.value)
