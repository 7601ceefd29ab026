"""The checks on a request as sent, before anything tokenizes or queues it: every text valid
Unicode, and every dimension within `RequestLimits` (docs/serving.md#request-size-bounds), so a
refused request costs one pass over its lengths."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from numbers import Integral
from typing import Any

import numpy as np

from tpuscore.api.errors import ValidationError
from tpuscore.api.requests import RequestLimits


def check_text(value: str, param: str) -> None:
    """Raise `invalid_text` for a str that is not valid Unicode (a lone surrogate such as
    "\\ud800", which JSON and Python strings can carry but UTF-8 cannot encode)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValidationError(
            "invalid_text",
            f"{param} is not valid Unicode text: {e.reason} {value[e.start : e.end]!r} at "
            f"character {e.start}",
            param,
        ) from None


def check_texts(values: Mapping[str, Any]) -> None:
    """check_text on each named value that is a str, and on each str of a named list (named
    `name[i]`); other values are left to their own checks."""
    for name, value in values.items():
        if isinstance(value, str):
            check_text(value, name)
        elif isinstance(value, list):
            for i, text in enumerate(value):
                if isinstance(text, str):
                    check_text(text, f"{name}[{i}]")


def is_token_id(value: Any) -> bool:
    """An int that is not a bool: what a token-id list may hold."""
    return isinstance(value, Integral) and not isinstance(value, (bool, np.bool_))


def _is_list(value: Any) -> bool:
    """A list, tuple or array with a length: a 0-d array (np.array(5)) has none (len raises
    TypeError), and validation refuses it as it refuses a number."""
    return isinstance(value, (list, tuple)) or (isinstance(value, np.ndarray) and value.ndim > 0)


def length(value: Any) -> int:
    """A value's length as `RequestLimits` counts it: a text's characters, a list's entries (a
    token-id list's ids); 0 for anything else, which validation refuses later."""
    return len(value) if isinstance(value, str) or _is_list(value) else 0


def label_count(labels: Any, label_token_ids: Any) -> int:
    """The labels a request names, as sent (0 for none: a classification model's classes)."""
    return max((len(v) for v in (labels, label_token_ids) if _is_list(v)), default=0)


def check_chunks(
    limits: RequestLimits,
    chunks: int,
    num_labels: int,
    holder: str = "this server",
    param: str = "documents",
) -> None:
    """Refuse documents cut into more chunks than `limits` takes items (each chunk is scored as
    one), or whose chunks' scores pass max_scores: a small request with a narrow window (one
    token) would otherwise score as many items as its documents have tokens."""
    if chunks > limits.max_items:
        raise ValidationError(
            "too_many_items",
            f"the documents make {chunks} chunks, each an item; {holder} takes at most "
            f"{limits.max_items}: widen chunking.window or chunking.stride, or set max_chunks",
            param,
        )
    if chunks * num_labels > limits.max_scores:
        raise ValidationError(
            "too_many_scores",
            f"{chunks} chunks x {num_labels} labels is {chunks * num_labels} scores; {holder} "
            f"answers at most {limits.max_scores} per request",
            param,
        )


def check_size(
    limits: RequestLimits,
    *,
    items: tuple[str, Any],
    values: Mapping[str, Any],
    num_labels: int = 0,
    holder: str = "this server",
    check_ids: bool = True,
) -> None:
    """Refuse a request larger than `limits`, by its lengths as sent: no tokenization, no copy.

    items is (its name on the wire, its list); values the request's other texts or token-id
    lists by name (query, labels, suffix, instruction). Codes: too_many_items, too_many_labels,
    too_many_scores, input_too_long (one value), request_too_large (all of them together).
    holder: whose bounds they are, for the message ("this server", "this scorer ...").
    check_ids: refuse an item list holding other than ints first (a server's 400 before its
    413); off where validation checks every token id after (the library's own pass, which a
    per-token check here would make several times slower)."""
    name, entries = items
    entries = [entries] if isinstance(entries, str) else entries
    # Any sequence validation takes as items is counted (a Sequence subclass got past this).
    count = len(entries) if isinstance(entries, Sequence) and not isinstance(entries, str) else 0
    # A malformed token-id list is refused as such (400) before a bound (413): one pass over
    # what the body already holds.
    for i, entry in enumerate(entries if count and check_ids else ()):
        if isinstance(entry, list) and not all(is_token_id(t) for t in entry):
            raise ValidationError(
                "invalid_items", f"{name}[{i}] must hold token ids (ints)", f"{name}[{i}]"
            )
    if count > limits.max_items:
        raise ValidationError(
            "too_many_items",
            f"{name} has {count} entries; {holder} takes at most {limits.max_items}",
            name,
        )
    if num_labels > limits.max_labels:
        raise ValidationError(
            "too_many_labels",
            f"the request names {num_labels} labels; {holder} takes at most "
            f"{limits.max_labels} (a repeated label counts each time)",
            "labels",
        )
    if count * num_labels > limits.max_scores:
        raise ValidationError(
            "too_many_scores",
            f"{count} {name} x {num_labels} labels is {count * num_labels} scores; {holder} "
            f"answers at most {limits.max_scores} per request",
            name,
        )
    total = 0
    named = [(f"{name}[{i}]", e) for i, e in enumerate(entries)] if count else []
    for param, value in [*values.items(), *named]:
        texts = isinstance(value, list) and value and isinstance(value[0], str)  # labels
        parts = [(f"{param}[{j}]", v) for j, v in enumerate(value)] if texts else [(param, value)]
        for param, part in parts:  # noqa: PLW2901 (a part is named as its own param)
            size = length(part)
            if size > limits.max_length:
                raise ValidationError(
                    "input_too_long",
                    f"{param} has length {size} (characters of text, or token ids); "
                    f"{holder} takes at most {limits.max_length}",
                    param,
                )
            total += size
    if total > limits.max_total_length:
        raise ValidationError(
            "request_too_large",
            f"the request's texts and token ids have length {total} in all; {holder} takes "
            f"at most {limits.max_total_length}",
            None,
        )
