"""Input validation: every bad request stops here with a `ValidationError`; none reaches a backend.

This is the one boundary for errors a caller can cause: the request itself, and the shape of a
`score_batch` request (the backend's name and options are checked by `backends.registry`).
Text is tokenized here too (`tokenization.py`), so the checks that follow (token ranges, empty
and over-long sequences) see exactly the tokens a backend will. The checks of one argument at a
time are `argument_checks.py`'s; this module composes them into each request's check.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import tokenizers

from tpuscore.api import tokenization
from tpuscore.api.argument_checks import (
    check_bool,
    check_truncation,
    input_kind,
    item_suffix_ids,
    labels_to_ids,
    listed,
    require_tokenizer,
    token_ids,
    truncate_item,
)
from tpuscore.api.bounds import check_size, check_text, label_count
from tpuscore.api.errors import ValidationError
from tpuscore.api.messages import short
from tpuscore.api.requests import (
    LIBRARY_LIMITS,
    LoglikelihoodRequest,
    RequestLimits,
    ScoreOptions,
    ScoreRequest,
)

# Whose bounds a library call meets, for the message of a refusal.
SCORER_BOUNDS = "this scorer (Scorer(limits=...) sets its bounds)"


@attrs.frozen
class ModelFacts:
    """What validation needs to know of the model a request goes to.

    num_classes > 0: the model has a classification head with that many classes; it takes no
    labels and scores every class. pad_token_id: that model's padding token, which moves the
    pooled token as transformers moves it (`_pooled`). adapters: the names of the model's LoRA
    adapters, in stack order (a request's `adapter` is one of them, or None). limits: how large
    one request may be, checked before anything is tokenized (`check_request_size`).
    """

    tokenizer: tokenizers.Tokenizer | None
    vocab_size: int
    max_sequence_length: int
    num_classes: int = 0
    pad_token_id: int | None = None
    adapters: tuple[str, ...] = ()
    limits: RequestLimits = LIBRARY_LIMITS


def check_request_size(query: Any, items: Any, options: ScoreOptions, model: ModelFacts) -> None:
    """Refuse a score request past the model's `RequestLimits`, by its lengths as given (the
    server's own, usually smaller, bounds were checked before): too_many_items, too_many_labels,
    too_many_scores, input_too_long, request_too_large."""
    labels = label_count(options.labels, options.label_token_ids) or model.num_classes
    check_size(
        model.limits,
        items=("items", items),
        values={
            "query": query,
            "labels": options.labels,
            "label_token_ids": options.label_token_ids,
            "item_suffix": options.item_suffix,
        },
        num_labels=labels,
        holder=SCORER_BOUNDS,
        check_ids=False,
    )


def validate(query: Any, items: Any, options: ScoreOptions, model: ModelFacts) -> ScoreRequest:
    """Check a `Scorer.score` call (its query, items and `ScoreOptions`) for `model` and turn it
    into token ids."""
    items = listed(items)
    check_request_size(query, items, options, model)
    tokenizer, vocab_size, num_classes = model.tokenizer, model.vocab_size, model.num_classes
    adapter = adapter_index(options.adapter, model.adapters)
    check_bool(options.apply_softmax, "apply_softmax")
    check_bool(options.item_first, "item_first")
    max_item_tokens, truncate = options.max_item_tokens, options.truncate
    check_truncation(max_item_tokens, truncate)

    text = input_kind(query, items, "query", "items", item_param=lambda i: "items")
    if num_classes:
        _no_labels(options)
        label_ids = list(range(num_classes))
    else:
        if options.label_token_ids is None and options.labels is None:
            raise ValidationError(
                "no_classification_head",
                "give label_token_ids or labels: this model is a causal LM, scored by label "
                "tokens; only a classification-head (*ForSequenceClassification) checkpoint "
                "scores without labels",
                "label_token_ids",
            )
        label_ids = labels_to_ids(options.label_token_ids, options.labels, tokenizer, vocab_size)
    suffix_ids = item_suffix_ids(options.item_suffix, tokenizer, vocab_size)

    if text:
        check_text(query, "query")
        tok = require_tokenizer(tokenizer, "query")
        query = tokenization.encode_query(tok, query)
        items = tokenization.encode_items(tok, list(items))
    # Text ids are checked too: a tokenizer may know more tokens than the model embeds.
    query_ids = token_ids(query, "query", "invalid_query", vocab_size)
    item_ids = [
        truncate_item(
            token_ids(item, f"items[{i}]", "invalid_items", vocab_size), max_item_tokens, truncate
        )
        + suffix_ids
        for i, item in enumerate(items)
    ]

    for i, ids in enumerate(item_ids):
        length = len(query_ids) + len(ids)
        if length == 0:
            raise ValidationError(
                "empty_sequence",
                f"query and items[{i}] are both empty: there is no token to score after",
                "items",
            )
        if length > model.max_sequence_length:
            hint = "" if max_item_tokens is not None else "; max_item_tokens= truncates items"
            raise ValidationError(
                "sequence_too_long",
                f"query + items[{i}] is {length} tokens ({len(query_ids)} + {len(ids)}"
                f"{f', with a {len(suffix_ids)}-token item_suffix' if suffix_ids else ''}); "
                f"the model takes at most {model.max_sequence_length}{hint}",
                "items",
            )
    if num_classes and model.pad_token_id is not None:
        item_first = bool(options.item_first)
        query_ids, item_ids = _pooled(query_ids, item_ids, model.pad_token_id, item_first)
    return ScoreRequest(
        query_ids,
        item_ids,
        label_ids,
        bool(options.item_first),
        bool(options.apply_softmax),
        classification=bool(num_classes),
        adapter=adapter,
    )


def adapter_index(name: Any, adapters: tuple[str, ...], param: str = "adapter") -> int:
    """The stack index of adapter `name` (1..len(adapters)); None is the base model, 0.
    Anything else is `unknown_adapter`, naming the adapters there are."""
    if name is None:
        return 0
    if isinstance(name, str) and name in adapters:
        return adapters.index(name) + 1
    known = ", ".join(map(repr, adapters)) if adapters else "none (Scorer(adapters=...) adds them)"
    raise ValidationError(
        "unknown_adapter", f"adapter {short(name)} is not loaded; the adapters are {known}", param
    )


def _no_labels(options: ScoreOptions) -> None:
    for param in ("label_token_ids", "labels"):
        if getattr(options, param) is not None:
            raise ValidationError(
                "labels_on_classification_model",
                f"this model has a classification head and scores its own classes; do not give "
                f"{param}",
                param,
            )


def _pooled(
    query: list[int], items: list[list[int]], pad: int, item_first: bool
) -> tuple[list[int], list[list[int]]]:
    """The query and items cut so that each sequence ends at the token transformers pools: the
    last one that is not `pad` (the first token if all are). A causal model's state there does
    not depend on the tokens after it, so scoring the cut sequence is exact."""

    def strip(ids: list[int]) -> list[int]:
        end = len(ids)
        while end and ids[end - 1] == pad:
            end -= 1
        return ids[:end]

    if item_first:  # item + query: the query's own trailing padding goes first, for all items
        query = strip(query)
        if query:
            return query, items
        cut = []
        for i, item in enumerate(items):
            if not item:
                raise _unpoolable(i, pad)
            cut.append(strip(item) or item[:1])
        return query, cut
    cut = []
    for i, item in enumerate(items):
        kept = strip(item)
        if not kept and query and query[-1] == pad:
            raise _unpoolable(i, pad)
        cut.append(kept if kept or query else item[:1])
    return query, cut


def _unpoolable(i: int, pad: int) -> ValidationError:
    return ValidationError(
        "padding_only_item",
        f"items[{i}] is only padding (pad_token_id {pad}) and the query ends in padding, so "
        "transformers would pool a query token that depends on the item; trim the padding",
        "items",
    )


def _indexed(i: int) -> str:
    return f"continuations[{i}]"


def validate_loglikelihood(
    context: Any, continuations: Any, model: ModelFacts, adapter: Any = None
) -> LoglikelihoodRequest:
    """Check a `Scorer.loglikelihood` call and turn it into token ids. A classification model
    (num_classes > 0) has no next-token distribution: `no_language_model_head`. adapter: one of
    the model's LoRA adapters by name, or None (`unknown_adapter` otherwise).

    Text follows lm-evaluation-harness: the context's trailing whitespace moves to the front of
    every continuation, then the context is encoded with special tokens and each continuation
    without (`tpuscore.tasks.loglikelihood` says where this differs from the harness).
    """
    if model.num_classes:
        raise ValidationError(
            "no_language_model_head",
            "this model has a classification head, not an LM head: it has no token "
            "log-likelihoods; use score() for its class logits",
            "context",
        )
    adapter_at = adapter_index(adapter, model.adapters)
    continuations = listed(continuations)
    check_size(
        model.limits,
        items=("continuations", continuations),
        values={"context": context},
        holder=SCORER_BOUNDS,
        check_ids=False,
    )
    text = input_kind(context, continuations, "context", "continuations", item_param=_indexed)
    for i, continuation in enumerate(continuations):
        param = f"continuations[{i}]"
        if len(continuation) == 0:
            raise ValidationError(
                "empty_continuation", f"{param} is empty: there is nothing to score", param
            )

    if text:
        check_text(context, "context")
        tok = require_tokenizer(model.tokenizer, "context")
        stripped = context.rstrip()
        moved = context[len(stripped) :]
        context = tokenization.encode_query(tok, stripped)
        continuations = tokenization.encode_items(tok, [moved + c for c in continuations])
    context_ids = token_ids(context, "context", "invalid_query", model.vocab_size)
    if not context_ids:
        raise ValidationError(
            "empty_sequence",
            "the context has no token (and the tokenizer adds no BOS), so the first "
            "continuation token has nothing to be predicted from; pass a context, or token ids "
            "that start with the model's BOS or EOS token as lm-evaluation-harness does",
            "context",
        )
    continuation_ids = []
    for i, continuation in enumerate(continuations):
        param = f"continuations[{i}]"
        ids = token_ids(continuation, param, "invalid_items", model.vocab_size)
        if not ids:
            raise ValidationError(
                "empty_continuation", f"{param} encodes to no token: nothing to score", param
            )
        length = len(context_ids) + len(ids)
        if length > model.max_sequence_length:
            raise ValidationError(
                "sequence_too_long",
                f"context + {param} is {length} tokens ({len(context_ids)} + {len(ids)}); "
                f"the model takes at most {model.max_sequence_length}",
                param,
            )
        continuation_ids.append(ids)
    return LoglikelihoodRequest(context_ids, continuation_ids, adapter_at)


def request_list(requests: Any) -> list[Any]:
    """`score_batch`'s requests as a list: anything but an iterable of requests (None, a number,
    one request's mapping or text) is `invalid_argument` at `requests`."""
    if isinstance(requests, Mapping | str | bytes) or not isinstance(requests, Iterable):
        raise ValidationError(
            "invalid_argument",
            f"requests must be a list of mappings of score() arguments, got "
            f"{type(requests).__name__}",
            "requests",
        )
    return list(requests)


def request_arguments(request: Any, where: str | None = None) -> tuple[Any, Any, ScoreOptions]:
    """A score request given as a mapping (a `score_batch` request, a CLI request object): its
    query, items and `ScoreOptions`. Not a mapping, an unknown name or a missing query or items
    is `invalid_argument`, located inside `where` (e.g. "requests[3]") when given."""
    prefix = f"{where}." if where else ""
    if not isinstance(request, Mapping):
        raise ValidationError(
            "invalid_argument",
            f"{where or 'a request'} must be a mapping of score() arguments, "
            f"got {type(request).__name__}",
            where,
        )
    rest = {k: v for k, v in request.items() if k not in ("query", "items")}
    options = ScoreOptions.from_mapping(rest, where)
    for name in ("query", "items"):
        if name not in request:
            what = where or "the request"
            raise ValidationError("invalid_argument", f"{what} has no {short(name)}", prefix + name)
    return request["query"], request["items"], options
