"""The bodies of the score endpoints: SGLang's `/v1/score` request and vLLM's `/score` request in
its three spellings, told apart by their fields (`AnyScoreRequest`) since both paths take either.

The score arguments of SGLang's request (`query`, `items` and the options of
`tpuscore.api.requests.ScoreOptions`) are typed here for the schema only (`SkipValidation`):
`tpuscore.api.validation` is their one validator and gives their stable codes and messages.
Their names, defaults and descriptions come from `ScoreOptions`. The shared parts of every
request body (`WireRequest`, `DefaultOnly`, `TextOrTexts`) are `protocol`'s.
"""

from __future__ import annotations

import typing
from typing import Annotated, Any, ClassVar

import attrs
import pydantic
from pydantic import BaseModel, ConfigDict, Field, SkipValidation
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from tpuscore.api.requests import ScoreOptions, attribute_docs
from tpuscore.serving.protocol import (
    MODEL_DOC,
    DefaultOnly,
    TextOrTexts,
    WireRequest,
    default_only,
)

# Options /v1/score does not take: SGLang's request has no such fields, and the rerank endpoints
# set them from the template and `max_tokens_per_doc`. The adapter is the `model` field, as vLLM
# names LoRA modules (`Service.adapter`).
SCORE_OPTIONS_NOT_SERVED = ("item_suffix", "max_item_tokens", "truncate", "adapter")


def score_option_fields(exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """`create_model` field definitions for the `ScoreOptions` options, named, defaulted and
    described as `ScoreOptions` declares them, typed for the schema only."""
    docs = attribute_docs(ScoreOptions)
    types = typing.get_type_hints(ScoreOptions)
    fields = {}
    for option in attrs.fields(ScoreOptions):
        if option.name in exclude:
            continue
        fields[option.name] = (
            SkipValidation[types[option.name]],
            Field(default=option.default, description=docs.get(option.name)),
        )
    return fields


class _ScoreArguments(WireRequest):
    query: SkipValidation[str | list[int]] = Field(
        description="the shared context: text, or token ids"
    )
    items: SkipValidation[str | list[str] | list[list[int]]] = Field(
        description="one scored sequence per item: texts or token-id lists (one kind for both "
        "query and items); a bare string is one item"
    )


_ScoreArgumentsAndOptions = pydantic.create_model(
    "_ScoreArgumentsAndOptions",
    __base__=_ScoreArguments,
    **score_option_fields(exclude=SCORE_OPTIONS_NOT_SERVED),
)


class ScoreRequest(_ScoreArgumentsAndOptions):
    """SGLang's `/v1/score` request; `labels` (label strings) is tpuscore's extension."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "query": "Classify the sentiment of each movie review.\nReview:",
                    "items": [
                        " I loved every minute.\nSentiment:",
                        " A waste of money.\nSentiment:",
                    ],
                    "labels": [" positive", " negative"],
                    "apply_softmax": True,
                }
            ]
        }
    )

    model: str | None = Field(None, description=MODEL_DOC)
    embed_override_token_id: DefaultOnly = default_only(None, "SGLang's; accepted only as null")
    query_embed_overrides: DefaultOnly = default_only(None, "SGLang's; accepted only as null")
    item_embed_overrides: DefaultOnly = default_only(None, "SGLang's; accepted only as null")
    return_pooled_hidden_states: DefaultOnly = default_only(
        False, "SGLang's; accepted only as false"
    )


def score_options(request: BaseModel) -> dict[str, Any]:
    """The `ScoreOptions` a score request carries, as keyword arguments of `Scorer.score`."""
    return {
        name: getattr(request, name)
        for name in ScoreOptions.names()
        if name in type(request).model_fields
    }


class _VllmScoreFields(WireRequest):
    model: str | None = Field(None, description=MODEL_DOC)
    truncate_prompt_tokens: DefaultOnly = default_only(None, "vLLM's; accepted only as null")
    priority: DefaultOnly = default_only(0, "vLLM's; accepted only as 0")
    use_activation: DefaultOnly = default_only(None, "vLLM's; accepted only as null")

    def pairs(self) -> list[tuple[str, str]]:
        """(query, document) pairs as vLLM forms them: 1:1, 1:N (one query, a list of
        documents; a one-element query list counts as one) and N:N (pairwise, equal lengths)."""
        names = self.SIDES
        first, second = getattr(self, names[0]), getattr(self, names[1])
        firsts = [first] if isinstance(first, str) else first
        seconds = [second] if isinstance(second, str) else second
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise PydanticCustomError(
                "invalid_argument",
                "has {n} entries and {second} {m}: give one {first} or as many",
                {"param": names[0], "first": names[0], "second": names[1], "n": len(firsts)}
                | {"m": len(seconds)},
            )
        return list(zip(firsts, seconds, strict=True))

    @pydantic.model_validator(mode="after")
    def _paired(self):
        self.pairs()
        return self


class VllmTextScoreRequest(_VllmScoreFields):
    """vLLM's `/score` request, `text_1` scored against each of `text_2`."""

    text_1: TextOrTexts = Field(description="the query, or one query per text_2")
    text_2: TextOrTexts = Field(description="the documents scored against text_1")

    SIDES: ClassVar[tuple[str, str]] = ("text_1", "text_2")


class VllmQueriesScoreRequest(_VllmScoreFields):
    """vLLM's newer `/score` request: `queries` scored against `documents`."""

    queries: TextOrTexts = Field(description="the query, or one query per document")
    documents: TextOrTexts = Field(description="the documents scored against the queries")

    SIDES: ClassVar[tuple[str, str]] = ("queries", "documents")


class VllmDataScoreRequest(_VllmScoreFields):
    """vLLM's `/score` request under its generic names: `data_1` scored against `data_2`."""

    data_1: TextOrTexts = Field(description="the query, or one query per data_2")
    data_2: TextOrTexts = Field(description="the documents scored against data_1")
    SIDES: ClassVar[tuple[str, str]] = ("data_1", "data_2")


SGLANG_SCORE_FIELDS = ("query", "items")
# A vLLM field -> the tag of its request's shape.
VLLM_SCORE_FIELDS = {
    "text_1": "text",
    "text_2": "text",
    "queries": "queries",
    "documents": "queries",
    "data_1": "data",
    "data_2": "data",
}


def _score_shape(body: Any) -> str:
    """Which peer's score request a body is, by its fields: SGLang's unless it has vLLM's."""
    if not isinstance(body, dict):
        return "sglang"
    vllm = [name for name in body if name in VLLM_SCORE_FIELDS]
    if vllm and any(name in SGLANG_SCORE_FIELDS for name in body):
        return "ambiguous"
    return VLLM_SCORE_FIELDS[vllm[0]] if vllm else "sglang"


class _AmbiguousScoreRequest(BaseModel):
    """A body with both peers' score fields: refused, naming both."""

    @pydantic.model_validator(mode="before")
    @classmethod
    def _refuse(cls, body: dict[str, Any]) -> Any:
        raise PydanticCustomError(
            "ambiguous_request",
            "the body has SGLang's score fields ({sglang}) and vLLM's ({vllm}); send one shape",
            {
                "sglang": ", ".join(n for n in body if n in SGLANG_SCORE_FIELDS),
                "vllm": ", ".join(n for n in body if n in VLLM_SCORE_FIELDS),
            },
        )


AnyScoreRequest = Annotated[
    Annotated[ScoreRequest, pydantic.Tag("sglang")]
    | Annotated[VllmTextScoreRequest, pydantic.Tag("text")]
    | Annotated[VllmQueriesScoreRequest, pydantic.Tag("queries")]
    | Annotated[VllmDataScoreRequest, pydantic.Tag("data")]
    | SkipJsonSchema[Annotated[_AmbiguousScoreRequest, pydantic.Tag("ambiguous")]],
    pydantic.Discriminator(_score_shape),
]
# The tags of vLLM's shapes, which errors answer in vLLM's dialect.
VLLM_SHAPES = frozenset({"text", "queries", "data"})
