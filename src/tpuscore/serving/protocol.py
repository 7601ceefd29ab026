"""The server's wire format: a typed request and response model for every endpoint.

Why pydantic v2 with FastAPI: these models are the one declaration of the wire format. FastAPI
parses each request body into its model, generates the OpenAPI document from the models
(`GET /openapi.json`) and serves a docs page on it (`/docs`), and schemathesis reads that
document to fuzz the live server (tests/test_openapi.py). msgspec with Starlette parses faster
but publishes no schema by itself, and a hand-written one would drift from the code.

Who checks what:
- The models check the fields the server owns (a rerank's query, documents, top_n, ...) and
  refuse fields an endpoint does not take. A failed check is a pydantic error whose `type` is a
  tpuscore error code where one applies; `error_fields` turns it into tpuscore's error.
- The score arguments of /v1/score (`query`, `items` and the options of
  `tpuscore.api.requests.ScoreOptions`) are typed here for the schema only (`SkipValidation`):
  `tpuscore.api.validation` is their one validator and gives their stable codes and messages.
  Their names, defaults and descriptions come from `ScoreOptions`.
"""

from __future__ import annotations

import inspect
import json
import re
import reprlib
import typing
from typing import Annotated, Any, Literal

import attrs
import pydantic
from pydantic import BaseModel, ConfigDict, Field, PlainValidator, SkipValidation, WithJsonSchema
from pydantic_core import PydanticCustomError

from tpuscore.api.requests import ScoreOptions

# Cohere's v2 rerank truncates every document to this many tokens unless told otherwise.
COHERE_MAX_TOKENS_PER_DOC = 4096

# The code of a field's wrong type or missing value; every other field's is `invalid_argument`.
# They are the library's codes for the same arguments (tpuscore.api.validation).
FIELD_CODES = {"query": "invalid_query", "items": "invalid_items", "documents": "invalid_documents"}

# Codes the models' own checks raise, as their pydantic error type.
TPUSCORE_CODES = frozenset({"unknown_field", "unsupported_field", "invalid_documents"})

# Options /v1/score does not take: SGLang's request has no such fields, and the rerank endpoints
# set them from the template and `max_tokens_per_doc`.
SCORE_OPTIONS_NOT_SERVED = ("item_suffix", "max_item_tokens", "truncate")

_short = reprlib.Repr()
_short.maxlevel, _short.maxstring, _short.maxother = 3, 60, 60


def short(value: Any) -> str:
    """A bounded repr for error messages: any input, however large or deeply nested."""
    return _short.repr(value)


# -- requests ---------------------------------------------------------------------------------


class _DefaultOnly:
    """Marks a field of a peer's API that tpuscore does not implement."""


# Such a field is accepted at its default (clients send it) and refused with `unsupported_field`
# otherwise, by `WireRequest`. Declare it as `name: DefaultOnly = default_only(default, doc)`.
DefaultOnly = Annotated[Any, _DefaultOnly()]


def default_only(default: Any, description: str) -> Any:
    return Field(default, description=description, json_schema_extra={"enum": [default]})


class WireRequest(BaseModel):
    """A request body: a JSON object of the endpoint's fields, each of the JSON type declared."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @pydantic.model_validator(mode="before")
    @classmethod
    def _known_fields(cls, body: Any) -> Any:
        """Refuse, first and in body order, an unknown field and a peer's field that tpuscore
        does not implement set to other than its default."""
        if not isinstance(body, dict):
            return body
        for name, value in body.items():
            field = cls.model_fields.get(name)
            if field is None:
                raise PydanticCustomError(
                    "unknown_field",
                    "unknown field; this endpoint takes {allowed}",
                    {"param": name, "allowed": ", ".join(sorted(cls.model_fields))},
                )
            default = field.default
            peer_only = any(isinstance(m, _DefaultOnly) for m in field.metadata)
            if peer_only and not (type(value) is type(default) and value == default):
                raise PydanticCustomError(
                    "unsupported_field",
                    "not supported by tpuscore; leave it out or set it to {default}",
                    {"param": name, "default": json.dumps(default)},
                )
        return body


def _document_text(value: Any) -> str:
    """A rerank document as text: a string or {"text": string}."""
    if isinstance(value, dict) and set(value) == {"text"}:
        value = value["text"]
    if not isinstance(value, str):
        raise PydanticCustomError(
            "invalid_documents",
            'must be a string or {"text": string}, got {got}',
            {"got": short(value)},
        )
    return value


Document = Annotated[
    str,
    PlainValidator(_document_text),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string"},
                {
                    "type": "object",
                    "properties": {"text": {"type": "string"}},
                    "required": ["text"],
                    "additionalProperties": False,
                },
            ]
        }
    ),
]


def _attribute_docs(cls: type) -> dict[str, str]:
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


def score_option_fields(exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """`create_model` field definitions for the `ScoreOptions` options, named, defaulted and
    described as `ScoreOptions` declares them, typed for the schema only."""
    docs = _attribute_docs(ScoreOptions)
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

    model: str | None = Field(None, description="accepted, not checked: one server, one model")
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


class _RerankFields(WireRequest):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "query": "What is the capital of France?",
                    "documents": [
                        "Berlin is the capital of Germany.",
                        "Paris is the capital and largest city of France.",
                    ],
                    "top_n": 1,
                }
            ]
        }
    )

    model: str | None = Field(None, description="accepted, not checked: one server, one model")
    query: str
    documents: list[Document] = Field(description='strings, or {"text": string} objects')
    top_n: Annotated[int, Field(ge=0)] | None = Field(
        None, description="how many results to return; 0 or null returns all"
    )
    instruction: str | None = Field(
        None, description="the task description in the prompt; null: the template's"
    )


class RerankRequest(_RerankFields):
    """The Cohere v1 / Jina rerank request (`/v1/rerank`, `/rerank`), as vLLM serves it."""

    return_documents: bool = Field(True, description='include {"text"} in each result')
    max_tokens_per_doc: Annotated[int, Field(ge=1)] | None = Field(
        None, description="cut each document to this many tokens; null: a too-long one fails"
    )
    rank_fields: DefaultOnly = default_only(None, "Cohere's; accepted only as null")
    max_chunks_per_doc: DefaultOnly = default_only(None, "Cohere's; accepted only as null")


class RerankV2Request(_RerankFields):
    """Cohere's v2 rerank request (`/v2/rerank`)."""

    max_tokens_per_doc: Annotated[int, Field(ge=1)] | None = Field(
        COHERE_MAX_TOKENS_PER_DOC, description="cut each document to this many tokens"
    )
    relevant_spans: DefaultOnly = default_only(None, "accepted only as null")
    priority: DefaultOnly = default_only(0, "accepted only as 0")


def error_fields(error: dict[str, Any]) -> tuple[str, str | None, str]:
    """(code, param, message) of one pydantic error on a request body.

    A tpuscore check's error carries its code as its type and may name its field in ctx
    ("param"); any other error takes its field's code from FIELD_CODES. param is the field's
    path as the body spells it ("documents[3]")."""
    loc = tuple(error.get("loc", ()))
    if loc[:1] == ("body",):
        loc = loc[1:]
    ctx = error.get("ctx") or {}
    param = ctx.get("param")
    if param is None and loc:
        param = str(loc[0]) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])
    if error["type"] in TPUSCORE_CODES:
        code, message = error["type"], error["msg"]
    else:
        code = FIELD_CODES.get(str(loc[0]), "invalid_argument") if loc else "invalid_request"
        message = (
            error["msg"]
            if error["type"] == "missing"
            else f"{error['msg']}, got {short(error.get('input'))}"
        )
    return code, param, f"{param}: {message}" if param else message


# -- responses --------------------------------------------------------------------------------


class Usage(BaseModel):
    """SGLang's usage block: scoring runs prompts only, so completion_tokens is 0."""

    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0

    @classmethod
    def of(cls, num_tokens: int) -> Usage:
        return cls(prompt_tokens=num_tokens, total_tokens=num_tokens)


class ScoreResponse(BaseModel):
    """A row per item in item order, a column per label in label order."""

    scores: list[list[float]]
    model: str
    usage: Usage
    object: Literal["scoring"] = "scoring"


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = Field(None, description="absent unless return_documents")


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    """Results sorted by relevance_score, highest first (ties keep input order)."""

    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class RerankV2Result(BaseModel):
    index: int
    relevance_score: float


class BilledUnits(BaseModel):
    input_tokens: int
    output_tokens: int = 0


class ApiVersion(BaseModel):
    version: str = "2"


class RerankV2Meta(BaseModel):
    api_version: ApiVersion
    billed_units: BilledUnits
    tokens: BilledUnits


class RerankV2Response(BaseModel):
    """Cohere's v2 rerank response, results sorted by relevance_score, highest first."""

    id: str
    results: list[RerankV2Result]
    meta: RerankV2Meta


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    model: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tpuscore"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    """Every error: `code` is a stable string to branch on, `param` names the offending field."""

    object: Literal["error"] = "error"
    message: str
    type: str
    param: str | None
    code: str
