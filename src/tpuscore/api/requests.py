"""What a caller asks for: a request's options, declared once, and validated requests as token ids.

`ScoreOptions` is the one declaration of a score request's options (everything but the query and
the items). `Scorer.score`, `prepare`, `plan`, `rank` and `score_batch`, validation, the CLI and
the server's wire schemas all take their option names, defaults and documentation from it.
`RequestLimits` is the one declaration of how large one request may be (the server's bounds and
`tpuscore serve`'s flags).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from typing import Any, Literal, get_args

import attrs

from tpuscore.api.errors import ValidationError
from tpuscore.api.messages import short

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
        adapter: the name of one of the scorer's LoRA adapters (`Scorer(adapters=...)`) to score
            with; None: the base model.
    """

    label_token_ids: list[int] | None = None
    labels: list[str] | None = None
    apply_softmax: bool = False
    item_first: bool = False
    item_suffix: str | list[int] | None = None
    max_item_tokens: int | None = None
    truncate: Truncate = "right"
    adapter: str | None = None

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
                f"{prefix}unknown argument(s) {short(unknown)}; "
                f"allowed: {', '.join(SCORE_ARGUMENTS)}",
                f"{where}.{unknown[0]}" if where else str(unknown[0]),
            )
        return cls(**options)


def attribute_docs(cls: type) -> dict[str, str]:
    """name -> text of the "Attributes:" section of a Google-style class docstring."""
    docs: dict[str, str] = {}
    doc = inspect.getdoc(cls) or ""
    section = doc.split("Attributes:\n", 1)[1] if "Attributes:\n" in doc else ""
    name = None
    for line in section.splitlines():
        if match := re.fullmatch(r"    (\w+): (.*)", line):
            name = match[1]
            docs[name] = match[2]
        elif line.startswith("        ") and name is not None:
            docs[name] += " " + line.strip()
        else:
            break
    return docs


def _at_least_one(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name} must be an int >= 1, got {value!r}")


@attrs.frozen(kw_only=True)
class RequestLimits:
    """How large one request may be: every dimension a caller controls, each bounded, each
    checked on the request as sent (`tpuscore.api.bounds.check_size`), before any
    tokenization or device work, so a refused request costs a pass over its lengths.

    A "length" is a text's characters or a token-id list's ids. A text encodes to at most about
    one token per UTF-8 byte (four per character) with the byte-level tokenizers tpuscore
    loads, so character bounds bound the tokens too; the model's own context length is checked
    after tokenization (`sequence_too_long`).

    Attributes:
        max_items: items of a score request, documents of a rerank, pairs of a vLLM score.
        max_labels: labels of a request (label_token_ids or labels); a repeated label counts
            each time it appears, since it is scored and answered each time.
        max_scores: items times labels: the scores one answer holds.
        max_length: the length of any one query, item, document, label, suffix, instruction or
            prompt (characters of text, or token ids).
        max_total_length: the lengths of all of a request's values together.
        max_queries: distinct queries of one vLLM N:N score request (each is scored as a request
            of its own, so the batcher's max_pending bounds it too).
    """

    max_items: int = attrs.field(default=4096, validator=_at_least_one)
    max_labels: int = attrs.field(default=256, validator=_at_least_one)
    max_scores: int = attrs.field(default=1 << 18, validator=_at_least_one)
    max_length: int = attrs.field(default=1 << 16, validator=_at_least_one)
    max_total_length: int = attrs.field(default=1 << 21, validator=_at_least_one)
    max_queries: int = attrs.field(default=64, validator=_at_least_one)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in attrs.fields(cls))

    @classmethod
    def of(cls, value: RequestLimits | Mapping[str, int] | None) -> RequestLimits:
        """`value` as RequestLimits: itself, the library's (None), or LIBRARY_LIMITS with the
        mapping's fields replaced; a bad value is `invalid_argument` at param `limits`."""
        if value is None:
            return LIBRARY_LIMITS
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValidationError(
                "invalid_argument",
                f"limits must be a RequestLimits or a mapping of its fields, got {short(value)}",
                "limits",
            )
        unknown = sorted(set(value) - set(cls.names()))
        if unknown:
            raise ValidationError(
                "invalid_argument",
                f"limits has no field {short(unknown[0])}; its fields are {', '.join(cls.names())}",
                "limits",
            )
        try:
            return attrs.evolve(LIBRARY_LIMITS, **value)
        except ValueError as e:
            raise ValidationError("invalid_argument", f"limits: {e}", "limits") from None

    def widened(self, other: RequestLimits) -> RequestLimits:
        """Each bound the larger of this one's and other's."""
        return RequestLimits(**{n: max(getattr(self, n), getattr(other, n)) for n in self.names()})


# A library call's bounds (`Scorer(limits=)`, docs/api.md#size-bounds): far above a server's
# defaults, which take requests from strangers, but finite, so one call cannot take memory
# without limit (a request's scores alone are max_scores float32s: 64 MiB).
LIBRARY_LIMITS = RequestLimits(
    max_items=1 << 16,
    max_labels=1 << 12,
    max_scores=1 << 24,
    max_length=1 << 22,
    max_total_length=1 << 26,
    max_queries=1 << 10,
)


# A score request's arguments: the query and items (required), then its options.
SCORE_ARGUMENTS = ("query", "items", *ScoreOptions.names())


@attrs.frozen
class ScoreRequest:
    """A validated request as token ids. For a classification model (`classification`),
    label_ids are the class indices 0..num_labels-1 and the scores are class logits. adapter:
    the index of its LoRA adapter in the model's stack (1..count), 0 for the base model."""

    query: list[int]
    items: list[list[int]]
    label_ids: list[int]
    item_first: bool
    apply_softmax: bool
    classification: bool = False
    adapter: int = 0


@attrs.frozen
class LoglikelihoodRequest:
    """A validated `Scorer.loglikelihood` call as token ids: a non-empty context and non-empty
    continuations; adapter: the index of its LoRA adapter in the model's stack, 0 for none."""

    context: list[int]
    continuations: list[list[int]]
    adapter: int = 0
