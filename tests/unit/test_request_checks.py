"""Request checks (api/validation.py, api/requests.py, api/errors.py) on pure inputs: every
`ValidationError` code the api layer can raise, with the parameter it names, and the token ids a
valid request becomes. A word-level tokenizer built in memory stands in for a model's."""

import re
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers, processors

import tpuscore.api
from tpuscore.api import bounds, templates, validation
from tpuscore.api.calibration import Calibration
from tpuscore.api.chunking import Chunking
from tpuscore.api.errors import ValidationError, check_int
from tpuscore.api.requests import SCORE_ARGUMENTS, RequestLimits, ScoreOptions

WORDS = ["<pad>", "<s>", "[UNK]", "the", "cat", "sat", "on", "mat", "yes", "no", "dog", "a", "b"]
ID = {w: i for i, w in enumerate(WORDS)}


def tokenizer(vocab: dict[str, int] = ID, bos: bool = True) -> tokenizers.Tokenizer:
    """Whitespace-split words; encoding with special tokens puts "<s>" first (with bos)."""
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 1)]
        )
    return tok


LM = validation.ModelFacts(tokenizer(), vocab_size=len(WORDS), max_sequence_length=8)
NO_TOKENIZER = validation.ModelFacts(None, vocab_size=len(WORDS), max_sequence_length=8)
# The tokenizer knows "c" (id 13) but the model embeds only 13 tokens.
SMALL_MODEL = validation.ModelFacts(tokenizer({**ID, "c": 13}), 13, 8)
NO_BOS = validation.ModelFacts(tokenizer(bos=False), len(WORDS), 8)
CLASSIFIER = validation.ModelFacts(tokenizer(), len(WORDS), 8, num_classes=2, pad_token_id=0)

LABELS = {"label_token_ids": [8, 9]}
LORA_LM = validation.ModelFacts(tokenizer(), len(WORDS), 8, adapters=("a",))
SCORE_BAD = [
    # (code, param, query, items, options, model)
    ("invalid_query", "query", None, [[1]], LABELS, LM),
    # An adapter the model has not loaded (LM has none; LORA_LM has one), or not a name.
    ("unknown_adapter", "adapter", [1], [[1]], {**LABELS, "adapter": "a"}, LM),
    ("unknown_adapter", "adapter", [1], [[1]], {**LABELS, "adapter": "b"}, LORA_LM),
    ("unknown_adapter", "adapter", [1], [[1]], {**LABELS, "adapter": 1}, LORA_LM),
    ("invalid_query", "query", 3, [[1]], LABELS, LM),
    ("invalid_query", "query", np.ones((2, 2), np.int32), [[1]], LABELS, LM),
    ("invalid_query", "query", [1, "a"], [[1]], LABELS, LM),
    ("invalid_query", "query", [1.5], [[1]], LABELS, LM),
    ("invalid_query", "query", [True], [[1]], LABELS, LM),
    ("invalid_items", "items", [1], "abc", LABELS, LM),
    ("invalid_items", "items", [1], np.ones((2, 2, 2), np.int32), LABELS, LM),  # 2-d: rows
    ("invalid_items", "items", [1], np.ones(3, np.int32), LABELS, LM),  # one item's ids
    ("invalid_items", "items", [1], 5, LABELS, LM),
    ("invalid_items", "items", [1], [[1], None], LABELS, LM),
    ("invalid_items", "items", [1], [{"a": 1}], LABELS, LM),
    ("invalid_items", "items[0]", [1], [[1, 2.0]], LABELS, LM),
    ("mixed_input_types", "items", "the", [[1, 2]], LABELS, LM),
    ("mixed_input_types", "items", [1, 2], [[3], "cat"], LABELS, LM),
    ("empty_sequence", "items", [], [[3], []], LABELS, LM),
    ("empty_sequence", "items", "", ["cat", " "], LABELS, NO_BOS),
    ("no_classification_head", "label_token_ids", [1], [[3]], {}, LM),
    ("empty_label_token_ids", "label_token_ids", [1], [[3]], {"label_token_ids": []}, LM),
    ("empty_label_token_ids", "labels", [1], [[3]], {"labels": []}, LM),
    ("invalid_label_token_ids", "labels", [1], [[3]], {**LABELS, "labels": ["yes"]}, LM),
    ("invalid_label_token_ids", "labels", [1], [[3]], {"labels": "yes"}, LM),
    ("invalid_label_token_ids", "labels", [1], [[3]], {"labels": 8}, LM),
    ("invalid_label_token_ids", "labels", [1], [[3]], {"labels": ["yes", 9]}, LM),
    ("invalid_label_token_ids", "label_token_ids", [1], [[3]], {"label_token_ids": 8}, LM),
    ("invalid_label_token_ids", "label_token_ids", [1], [[3]], {"label_token_ids": [[8]]}, LM),
    ("invalid_label_token_ids", "label_token_ids", [1], [[3]], {"label_token_ids": [8.0]}, LM),
    ("token_id_negative", "label_token_ids", [1], [[3]], {"label_token_ids": [8, -1]}, LM),
    ("token_id_negative", "query", [1, -2], [[3]], LABELS, LM),
    ("token_id_negative", "items[1]", [1], [[3], [4, -7]], LABELS, LM),
    ("token_id_exceeds_vocab", "label_token_ids", [1], [[3]], {"label_token_ids": [13]}, LM),
    ("token_id_exceeds_vocab", "query", [13], [[3]], LABELS, LM),
    ("token_id_exceeds_vocab", "items[0]", [1], [[99]], LABELS, LM),
    ("token_id_exceeds_vocab", "items[0]", "the", ["c"], LABELS, SMALL_MODEL),  # text too
    ("token_id_exceeds_vocab", "labels", "the", ["cat"], {"labels": ["c"]}, SMALL_MODEL),
    ("multi_token_label", "labels", [1], [[3]], {"labels": ["yes no"]}, LM),
    ("multi_token_label", "labels", [1], [[3]], {"labels": [""]}, LM),
    ("invalid_text", "query", "the \ud800", ["cat"], LABELS, LM),
    ("invalid_text", "items[1]", "the", ["cat", "\udfff"], LABELS, LM),
    ("invalid_text", "labels[0]", "the", ["cat"], {"labels": ["\ud800"]}, LM),
    ("invalid_text", "item_suffix", "the", ["cat"], {**LABELS, "item_suffix": "\ud800"}, LM),
    ("sequence_too_long", "items", [1] * 6, [[3], [3, 3, 3]], LABELS, LM),
    ("sequence_too_long", "items", "the cat", ["a b"], {**LABELS, "item_suffix": [3] * 4}, LM),
    ("invalid_argument", "apply_softmax", [1], [[3]], {**LABELS, "apply_softmax": "yes"}, LM),
    ("invalid_argument", "item_first", [1], [[3]], {**LABELS, "item_first": 1}, LM),
    ("invalid_argument", "max_item_tokens", [1], [[3]], {**LABELS, "max_item_tokens": 0}, LM),
    ("invalid_argument", "max_item_tokens", [1], [[3]], {**LABELS, "max_item_tokens": True}, LM),
    ("invalid_argument", "max_item_tokens", [1], [[3]], {**LABELS, "max_item_tokens": 2.0}, LM),
    ("invalid_argument", "truncate", [1], [[3]], {**LABELS, "truncate": "middle"}, LM),
    ("invalid_argument", "truncate", [1], [[3]], {**LABELS, "truncate": None}, LM),
    ("invalid_argument", "item_suffix", [1], [[3]], {**LABELS, "item_suffix": 3.5}, LM),
    ("invalid_argument", "item_suffix", [1], [[3]], {**LABELS, "item_suffix": [3.5]}, LM),
    ("token_id_exceeds_vocab", "item_suffix", [1], [[3]], {**LABELS, "item_suffix": [99]}, LM),
    ("invalid_argument", "query", "the", ["cat"], LABELS, NO_TOKENIZER),
    ("invalid_argument", "labels", [1], [[3]], {"labels": ["yes"]}, NO_TOKENIZER),
    ("invalid_argument", "item_suffix", [1], [[3]], {**LABELS, "item_suffix": "x"}, NO_TOKENIZER),
    ("labels_on_classification_model", "labels", "the", ["cat"], {"labels": ["yes"]}, CLASSIFIER),
    ("labels_on_classification_model", "label_token_ids", [1], [[3]], LABELS, CLASSIFIER),
    ("padding_only_item", "items", [1, 0], [[3, 0], [0, 0]], {}, CLASSIFIER),
    ("padding_only_item", "items", [0], [[]], {"item_first": True}, CLASSIFIER),
]


@pytest.mark.parametrize(
    "code, param, query, items, options, model", SCORE_BAD, ids=[b[0] for b in SCORE_BAD]
)
def test_a_bad_score_request_raises_its_code_naming_the_parameter(
    code, param, query, items, options, model
):
    with pytest.raises(ValidationError) as raised:
        validation.validate(query, items, ScoreOptions(**options), model)
    assert (raised.value.code, raised.value.param) == (code, param)
    assert isinstance(raised.value, ValueError)


LOGLIKELIHOOD_BAD = [
    # (code, param, context, continuations, model)
    ("no_language_model_head", "context", [1], [[3]], CLASSIFIER),
    ("invalid_query", "context", 5, [[3]], LM),
    ("invalid_items", "continuations[0]", [1], [None], LM),
    ("mixed_input_types", "continuations[1]", [1], [[3], "cat"], LM),
    ("empty_continuation", "continuations[1]", [1], [[3], []], LM),
    ("empty_continuation", "continuations[0]", "the cat", ["   "], LM),  # encodes to nothing
    ("empty_sequence", "context", [], [[3]], LM),
    ("sequence_too_long", "continuations[1]", [1] * 4, [[3], [3] * 5], LM),
    ("token_id_exceeds_vocab", "continuations[0]", [1], [[13]], LM),
    ("invalid_text", "context", "\ud800", ["cat"], LM),
    ("invalid_argument", "context", "the", ["cat"], NO_TOKENIZER),
]


@pytest.mark.parametrize(
    "code, param, context, continuations, model",
    LOGLIKELIHOOD_BAD,
    ids=[b[0] for b in LOGLIKELIHOOD_BAD],
)
def test_a_bad_loglikelihood_request_raises_its_code(code, param, context, continuations, model):
    with pytest.raises(ValidationError) as raised:
        validation.validate_loglikelihood(context, continuations, model)
    assert (raised.value.code, raised.value.param) == (code, param)


MAPPING_BAD = [
    # (code, param, request, where)
    ("invalid_argument", "requests[2]", ["query", "items"], "requests[2]"),
    ("invalid_argument", None, "not a mapping", None),
    ("invalid_argument", "requests[0].itmes", {"query": [1], "itmes": [[3]]}, "requests[0]"),
    ("invalid_argument", "labelz", {"query": [1], "items": [[3]], "labelz": []}, None),
    ("invalid_argument", "requests[1].items", {"query": [1]}, "requests[1]"),
    ("invalid_argument", "query", {"items": [[3]]}, None),
]


@pytest.mark.parametrize("code, param, request_, where", MAPPING_BAD)
def test_a_bad_request_mapping_is_located(code, param, request_, where):
    with pytest.raises(ValidationError) as raised:
        validation.request_arguments(request_, where)
    assert (raised.value.code, raised.value.param) == (code, param)
    if where:
        assert str(raised.value).startswith(where)


TINY = RequestLimits(
    max_items=2, max_labels=2, max_scores=3, max_length=8, max_total_length=12, max_queries=1
)


def sized(items: list[str], num_labels: int = 0) -> None:
    bounds.check_size(TINY, items=("items", items), values={}, num_labels=num_labels)


OTHER_BAD = [
    ("invalid_backend_option", lambda: check_int("max_rows", 0, minimum=1)),
    ("invalid_backend_option", lambda: check_int("max_rows", True, minimum=0)),
    ("invalid_backend_option", lambda: check_int("max_rows", 2.0, minimum=0)),
    ("unknown_template", lambda: templates.get("qwen4")),
    ("unknown_template", lambda: templates.get(["plain"])),
    ("invalid_chunking", lambda: Chunking(window=0)),
    ("invalid_chunking", lambda: Chunking(window=4, stride=5)),
    ("invalid_chunking", lambda: Chunking(window=4, aggregate="median")),
    ("invalid_chunking", lambda: Chunking.of(["window", 4])),
    ("invalid_calibration", lambda: Calibration.load("/nonexistent/calibration.json")),
    ("too_many_items", lambda: bounds.check_size(TINY, items=("items", ["a"] * 3), values={})),
    ("too_many_labels", lambda: sized(["a"], num_labels=3)),
    ("too_many_scores", lambda: sized(["a", "b"], num_labels=2)),
    ("input_too_long", lambda: sized(["abcdefghi"])),
    ("request_too_large", lambda: sized(["abcdefgh", "abcdefgh"])),
]


@pytest.mark.parametrize("code, call", OTHER_BAD, ids=[b[0] for b in OTHER_BAD])
def test_option_and_template_checks_raise_their_codes(code, call):
    with pytest.raises(ValidationError) as raised:
        call()
    assert raised.value.code == code


def api_codes() -> set[str]:
    """Every code a `ValidationError(...)` in src/tpuscore/api/ is raised with."""
    found = set()
    for path in Path(tpuscore.api.__file__).parent.glob("*.py"):
        found |= set(re.findall(r'ValidationError\(\s*"([a-z_]+)"', path.read_text()))
    return found


def test_every_code_the_api_layer_raises_is_reached_from_pure_inputs():
    tables = (SCORE_BAD, LOGLIKELIHOOD_BAD, MAPPING_BAD, OTHER_BAD)
    tested = {bad[0] for table in tables for bad in table}
    assert "invalid_query" in api_codes()  # the scan finds codes at all
    assert api_codes() <= tested, f"untested codes: {sorted(api_codes() - tested)}"


def test_text_becomes_the_tokens_a_backend_scores():
    options = ScoreOptions(labels=["yes", "no"], item_suffix="on the mat", apply_softmax=True)
    request = validation.validate("the cat", ["sat", "dog sat"], options, LM)
    assert request.query == [1, 3, 4]  # with the BOS
    assert request.items == [[5, 6, 3, 7], [10, 5, 6, 3, 7]]  # each + the suffix, no BOS
    assert request.label_ids == [8, 9]
    assert (request.item_first, request.apply_softmax, request.classification) == (
        False,
        True,
        False,
    )


def test_token_ids_of_any_int_kind_come_back_as_fresh_int_lists():
    query = np.array([1, 3], np.int64)
    items = [(4,), np.array([5, 6], np.uint8), []]
    request = validation.validate(query, items, ScoreOptions(label_token_ids=np.array([8])), LM)
    assert request.query == [1, 3] and request.items == [[4], [5, 6], []]
    assert all(type(t) is int for t in request.query + request.items[1] + request.label_ids)


def test_numpy_arrays_of_texts_or_of_id_rows_are_read_as_their_lists():
    """A column from numpy or pandas (.to_numpy()): 1-d arrays of str or object, 2-d int rows."""
    texts = ScoreOptions(labels=np.array(["yes", "no"]))
    as_list = validation.validate("the", ["cat sat", "dog"], ScoreOptions(labels=["yes", "no"]), LM)
    for items in (np.array(["cat sat", "dog"]), np.array(["cat sat", "dog"], dtype=object)):
        assert validation.validate("the", items, texts, LM) == as_list
    rows = validation.validate(
        [1], np.array([[3, 4], [5, 6]], np.int32), ScoreOptions(**LABELS), LM
    )
    assert rows.items == [[3, 4], [5, 6]]
    ll = validation.validate_loglikelihood("the", np.array(["cat", "dog"]), LM)
    assert ll.continuations == [[4], [10]]
    # An array that is neither (one item's ids, floats) is still refused.
    for items in (np.array([3, 4]), np.array([[1.5]]), np.zeros((1, 1, 1), int)):
        with pytest.raises(ValidationError, match="must be a list"):
            validation.validate([1], items, ScoreOptions(**LABELS), LM)


@pytest.mark.parametrize(
    "truncate, kept", [("right", [[3, 4], [5], [3, 4]]), ("left", [[5, 6], [5], [6, 7]])]
)
def test_truncation_keeps_an_items_first_or_last_tokens_and_never_cuts_the_suffix(truncate, kept):
    options = ScoreOptions(label_token_ids=[8], max_item_tokens=2, truncate=truncate)
    items = [[3, 4, 5, 6], [5], [3, 4, 6, 7]]
    assert validation.validate([1], items, options, LM).items == kept
    suffixed = attrs_evolve(options, item_suffix=[9, 9])
    assert validation.validate([1], items, suffixed, LM).items == [k + [9, 9] for k in kept]
    # With truncation, a sequence over the limit only before the cut is accepted.
    assert validation.validate([1] * 5, [[3] * 10], options, LM).items == [[3, 3]]


def attrs_evolve(options: ScoreOptions, **changes) -> ScoreOptions:
    import attrs

    return attrs.evolve(options, **changes)


def test_a_too_long_sequence_says_how_long_and_how_to_truncate():
    with pytest.raises(ValidationError, match=r"query \+ items\[1\] is 9 tokens \(6 \+ 3\); .*"
                       r"at most 8; max_item_tokens= truncates items"):  # fmt: skip
        validation.validate([1] * 6, [[3], [3, 3, 3]], ScoreOptions(label_token_ids=[8]), LM)
    with pytest.raises(ValidationError, match=r"with a 4-token item_suffix"):
        validation.validate("the cat", ["a b"], ScoreOptions(**LABELS, item_suffix=[3] * 4), LM)


def test_a_bad_token_id_is_named_by_its_position():
    with pytest.raises(ValidationError, match=r"items\[1\]\[2\] is 13; the model's vocabulary has "
                       r"13 tokens \(ids 0..12\)"):  # fmt: skip
        validation.validate([1], [[3], [3, 4, 13]], ScoreOptions(**LABELS), LM)
    with pytest.raises(ValidationError, match=r"label 'yes no' encodes to 2 tokens \[8, 9\]"):
        validation.validate([1], [[3]], ScoreOptions(labels=["yes no"]), LM)


@pytest.mark.parametrize(
    "query, items, item_first, pooled",
    [
        # Query first: each item cut after its last token that is not padding (0) ...
        ([1, 3], [[4, 0, 0], [0, 0], [5]], False, ([1, 3], [[4], [], [5]])),
        # ... an item of padding after an empty query keeps its first token to score after.
        ([], [[0, 0], [4, 0]], False, ([], [[0], [4]])),
        # Item first: the query's own trailing padding goes, for every item at once ...
        ([3, 0, 0], [[4, 0]], True, ([3], [[4, 0]])),
        # ... and a query of padding only leaves each item cut (padding only: its first token).
        ([0], [[4, 0], [0, 0]], True, ([], [[4], [0]])),
    ],
)
def test_a_classifier_scores_up_to_the_token_transformers_pools(query, items, item_first, pooled):
    request = validation.validate(query, items, ScoreOptions(item_first=item_first), CLASSIFIER)
    assert (request.query, request.items) == pooled
    assert request.label_ids == [0, 1] and request.classification


def test_loglikelihood_moves_the_contexts_trailing_space_to_each_continuation():
    request = validation.validate_loglikelihood("the cat ", ["sat", "sat on"], LM)
    assert request.context == [1, 3, 4]
    assert request.continuations == [[5], [5, 6]]
    ids = validation.validate_loglikelihood([1, 3], [np.array([4, 5])], LM)
    assert (ids.context, ids.continuations) == ([1, 3], [[4, 5]])


def test_score_options_are_declared_once_and_refuse_unknown_names():
    assert ("query", "items", *ScoreOptions.names()) == SCORE_ARGUMENTS
    assert ScoreOptions.names() == (
        "label_token_ids", "labels", "apply_softmax", "item_first", "item_suffix",
        "max_item_tokens", "truncate", "adapter",
    )  # fmt: skip
    assert ScoreOptions.from_mapping({"labels": ["yes"]}) == ScoreOptions(labels=["yes"])
    with pytest.raises(ValidationError) as raised:
        ScoreOptions.from_mapping({"b": 1, "a": 2}, where="requests[4]")
    assert raised.value.param == "requests[4].a"  # the first unknown name, sorted
    assert "unknown argument(s) ['a', 'b']" in str(raised.value)
    query, items, options = validation.request_arguments(
        {"query": "q", "items": ["i"], "apply_softmax": True}
    )
    assert (query, items, options) == ("q", ["i"], ScoreOptions(apply_softmax=True))


def test_an_error_located_inside_a_batch_names_both():
    error = ValidationError("invalid_query", "query must be a str", "query")
    located = error.within("requests[3]")
    assert (located.code, located.param) == ("invalid_query", "requests[3].query")
    assert str(located) == "requests[3]: query must be a str"
    assert ValidationError("invalid_argument", "bad", None).within("requests[0]").param == (
        "requests[0]"
    )
    assert repr(error) == (
        "ValidationError(code='invalid_query', loc=('query',), message='query must be a str')"
    )


def test_an_adapter_name_becomes_its_stack_index():
    options = ScoreOptions(label_token_ids=[8], adapter="b")
    lora = validation.ModelFacts(tokenizer(), len(WORDS), 8, adapters=("a", "b"))
    assert validation.validate([1], [[3]], options, lora).adapter == 2
    assert validation.validate([1], [[3]], attrs_evolve(options, adapter=None), lora).adapter == 0
