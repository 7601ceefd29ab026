"""Chunked documents: how a long document is cut into windows of tokens, and how its chunks'
scores become the document's (docs/chunking.md).

    chunk k covers tokens [k * stride, k * stride + window) of the document, the last one cut
    at its end; no chunk lies wholly inside the one before; at most max_chunks (the first).

A document of n tokens has max(1, ceil((n - window) / stride) + 1) chunks before max_chunks (one
empty chunk for an empty document). The document's score is `aggregate` of its chunks'
relevance scores: "max" (the best chunk: Cohere's and Elastic's choice), "mean" (every chunk
alike) or "first" (the document's opening, scored at its full window). Host arithmetic only.
"""

from __future__ import annotations

from collections.abc import Mapping
from numbers import Integral
from typing import Any, Literal, get_args

import attrs
import numpy as np

from tpuscore.api.errors import ValidationError

Aggregate = Literal["max", "mean", "first"]
AGGREGATES = get_args(Aggregate)


def _invalid(field: str, message: str) -> ValidationError:
    return ValidationError("invalid_chunking", f"chunking.{field} {message}", f"chunking.{field}")


def _int(value: Any, field: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise _invalid(field, f"must be an int >= {minimum}, got {value!r}")
    return int(value)


@attrs.frozen(kw_only=True)
class Chunking:
    """How documents are chunked and their chunks' scores aggregated.

    Attributes:
        window: tokens per chunk (the document's own tokens: a template's or suffix's are
            added to each chunk as to any item).
        stride: tokens from one chunk's start to the next's; default window (no overlap);
            window - stride tokens overlap. At most window, or tokens would go unscored.
        max_chunks: score at most this many chunks per document, its first; None: all.
        aggregate: "max", "mean" or "first" of the chunks' scores.
    """

    window: int
    stride: int | None = None
    max_chunks: int | None = None
    aggregate: Aggregate = "max"

    def __attrs_post_init__(self) -> None:
        window = _int(self.window, "window", 1)
        if self.stride is not None and _int(self.stride, "stride", 1) > window:
            raise _invalid("stride", f"must be at most window ({window}), got {self.stride}")
        if self.max_chunks is not None:
            _int(self.max_chunks, "max_chunks", 1)
        if self.aggregate not in AGGREGATES:
            raise _invalid(
                "aggregate", f"must be one of {', '.join(AGGREGATES)}, got {self.aggregate!r}"
            )

    @classmethod
    def of(cls, value: Chunking | Mapping[str, Any]) -> Chunking:
        """A `Chunking` from itself or a mapping of its fields; else `invalid_chunking`."""
        if isinstance(value, Chunking):
            return value
        if not isinstance(value, Mapping):
            raise ValidationError(
                "invalid_chunking",
                f"chunking must be a Chunking or a mapping of its fields, got {value!r}",
                "chunking",
            )
        names = [f.name for f in attrs.fields(cls)]
        unknown = sorted(set(value) - set(names), key=str)
        if unknown:
            raise _invalid(str(unknown[0]), f"is unknown; chunking takes {', '.join(names)}")
        if "window" not in value:
            raise _invalid("window", "is required")
        return cls(**value)

    def check_cap(self, max_item_tokens: Any) -> None:
        """Refuse a max_item_tokens below the window: it would cut every chunk while the
        chunk's span still named the whole window (tokens never scored)."""
        cap = max_item_tokens
        if isinstance(cap, Integral) and not isinstance(cap, bool) and cap < self.window:
            raise ValidationError(
                "invalid_argument",
                f"max_item_tokens={cap} would cut each chunk of chunking.window={self.window} "
                f"tokens (the chunk's span would name tokens never scored): set chunking.window="
                f"{cap} instead",
                "max_item_tokens",
            )

    def spans(self, num_tokens: int) -> list[tuple[int, int]]:
        """[start, end) token spans of a document of num_tokens tokens, in order."""
        stride = self.stride or self.window
        spans = []
        for start in range(0, max(num_tokens, 1), stride):
            spans.append((start, min(start + self.window, num_tokens)))
            if start + self.window >= num_tokens or len(spans) == self.max_chunks:
                break
        return spans

    def count(self, num_tokens: int) -> int:
        """len(spans(num_tokens)), without building them."""
        stride = self.stride or self.window
        n = 1 + max(0, -(-(num_tokens - self.window) // stride))
        return n if self.max_chunks is None else min(n, self.max_chunks)

    def tokens(self, num_tokens: int) -> int:
        """The chunks' tokens in all, at most (each chunk at most the window), without building
        them: what scoring the document by its chunks runs."""
        return self.count(num_tokens) * max(min(self.window, num_tokens), 1)

    def reduce(self, scores: np.ndarray) -> tuple[float, int]:
        """(the document's score, the index of its best chunk) from its chunks' scores."""
        scores = np.asarray(scores, np.float64)
        best = int(np.argmax(scores))  # the first of equal maxima
        if self.aggregate == "max":
            return float(scores[best]), best
        if self.aggregate == "mean":
            return float(scores.mean()), best
        return float(scores[0]), best
