"""What a caller asks for: a request's options, declared once, and validated requests as token ids.

`ScoreOptions` is the one declaration of a score request's options (everything but the query and
the items). `Scorer.score`, `prepare`, `plan`, `rank` and `score_batch`, validation, the CLI and
the server's wire schemas all take their option names, defaults and documentation from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args

import attrs

from tpuscore.api.errors import ValidationError

Truncate = Literal["right", "left"]  # right keeps an item's first tokens, left its last
TRUNCATE_SIDES = get_args(Truncate)


@attrs.frozen(kw_only=True)
class ScoreOptions:
    """A score request's options, as `Scorer.score` and every other entry point take them.

    The annotations are the options' types on the wire (the server's schema reads them); values
    are not checked here but by `tpuscore.api.validation`, which gives each its error code.

    Attributes:
        label_token_ids: the labels as token ids; or give `labels`. Neither for a
            classification model, which scores its own classes.
        labels: the labels as strings that each encode to exactly one token.
        apply_softmax: whether `result.scores` is the softmax over the labels (else the model's
            probabilities over the full vocabulary); for a classification model, the softmax
            over its classes, or the sigmoid of a single class (else its logits).
        item_first: score item + query instead of query + item.
        item_suffix: text (tokenized once, without special tokens) or token ids appended to every
            item, such as a reranker's assistant-turn opener.
        max_item_tokens: truncate each item to this many of its own tokens (the suffix is not
            counted and never cut); None: a too-long sequence is an error.
        truncate: "right" keeps an item's first max_item_tokens tokens, "left" its last.
    """

    label_token_ids: list[int] | None = None
    labels: list[str] | None = None
    apply_softmax: bool = False
    item_first: bool = False
    item_suffix: str | list[int] | None = None
    max_item_tokens: int | None = None
    truncate: Truncate = "right"

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in attrs.fields(cls))

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any], where: str | None = None) -> ScoreOptions:
        """The options named in `options`; an unknown name is `invalid_argument`, located
        inside `where` (e.g. "requests[3]") when given."""
        unknown = sorted(set(options) - set(cls.names()), key=str)
        if unknown:
            prefix = f"{where}: " if where else ""
            raise ValidationError(
                "invalid_argument",
                f"{prefix}unknown argument(s) {unknown}; allowed: {', '.join(SCORE_ARGUMENTS)}",
                f"{where}.{unknown[0]}" if where else str(unknown[0]),
            )
        return cls(**options)


# A score request's arguments: the query and items (required), then its options.
SCORE_ARGUMENTS = ("query", "items", *ScoreOptions.names())


@attrs.frozen
class ScoreRequest:
    """A validated request as token ids. For a classification model (`classification`),
    label_ids are the class indices 0..num_labels-1 and the scores are class logits."""

    query: list[int]
    items: list[list[int]]
    label_ids: list[int]
    item_first: bool
    apply_softmax: bool
    classification: bool = False


@attrs.frozen
class LoglikelihoodRequest:
    """A validated `Scorer.loglikelihood` call as token ids: a non-empty context and non-empty
    continuations."""

    context: list[int]
    continuations: list[list[int]]
