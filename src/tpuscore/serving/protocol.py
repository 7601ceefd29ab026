"""The server's wire format: the typed request models of the endpoints other than score
(serving/score_protocol.py) and the responses (serving/responses.py), and the errors they make.

Why pydantic v2 with FastAPI: these models are the one declaration of the wire format. FastAPI
parses each request body into its model, generates the OpenAPI document from the models
(`GET /openapi.json`) and serves a docs page on it (`/docs`), and schemathesis reads that
document to fuzz the live server (tests/test_openapi.py). msgspec with Starlette parses faster
but publishes no schema by itself, and a hand-written one would drift from the code.

Who checks what:
- The models check the fields the server owns (a rerank's query, documents, top_n, ...) and
  refuse fields an endpoint does not take. A failed check is a pydantic error whose `type` is a
  tpuscore error code where one applies; `error_fields` turns it into tpuscore's error.
- The score endpoints' bodies (SGLang's and vLLM's, told apart by shape) are
  `score_protocol`'s; the parts every body shares (`WireRequest`, `DefaultOnly`, `TextOrTexts`,
  `MODEL_DOC`) and the rerank, chunking and tokenize bodies are here.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import pydantic
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    WithJsonSchema,
)
from pydantic_core import PydanticCustomError

from tpuscore.api.messages import short

# Cohere's v2 rerank truncates every document to this many tokens unless told otherwise.
COHERE_MAX_TOKENS_PER_DOC = 4096

# The code of a field's wrong type or missing value; every other field's is `invalid_argument`.
# They are the library's codes for the same arguments (tpuscore.api.validation).
FIELD_CODES = {"query": "invalid_query", "items": "invalid_items", "documents": "invalid_documents"}

# Codes the models' own checks raise, as their pydantic error type.
TPUSCORE_CODES = frozenset(
    {
        "unknown_field",
        "unsupported_field",
        "invalid_documents",
        "invalid_argument",
        "ambiguous_request",
        "empty_documents",
    }
)


def not_empty(value: list[Any]) -> list[Any]:
    """Refuse an empty list of documents (`empty_documents`): the rerank APIs tpuscore serves
    refuse one (Cohere: 400 "list of documents must not be empty"; TEI: 400 "`texts` cannot be
    empty"), where a library call gets an empty result (docs/serving.md)."""
    if not value:
        raise PydanticCustomError("empty_documents", "cannot be empty: there is nothing to rerank")
    return value


# The `model` field of the scoring requests: it picks a LoRA adapter, as vLLM's LoRA modules are
# picked (`Service.adapter`).
MODEL_DOC = (
    "the served model's name (or null): the base model; a LoRA adapter's name (GET /v1/models "
    "lists them): that adapter; any other name is refused (404)"
)

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


class ChunkingRequest(WireRequest):
    """`tpuscore.api.chunking.Chunking` on the wire; its checks give `invalid_chunking`."""

    window: Annotated[int, Field(ge=1)] | None = Field(
        None, description="tokens per chunk; null: max_tokens_per_doc, else what fits"
    )
    stride: Annotated[int, Field(ge=1)] | None = Field(
        None, description="tokens between chunk starts, at most window; null: window"
    )
    max_chunks: Annotated[int, Field(ge=1)] | None = Field(
        None, description="score at most this many chunks per document, its first"
    )
    aggregate: Literal["max", "mean", "first"] = Field("max", description="of the chunks' scores")


def chunking(body: BaseModel) -> dict[str, Any] | None:
    """A rerank's chunking as `Chunking`'s fields, window left out where not given: its
    `chunking`, with Cohere's `max_chunks_per_doc` (the best chunk's score), or None."""
    given, max_chunks = body.chunking, getattr(body, "max_chunks_per_doc", None)
    if given is None and max_chunks is None:
        return None
    options = {} if given is None else given.model_dump(exclude_none=True)
    if max_chunks is not None:
        options["max_chunks"] = max_chunks
    return options


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

    model: str | None = Field(None, description=MODEL_DOC)
    query: str
    documents: Annotated[list[Document], AfterValidator(not_empty)] = Field(
        description='strings, or {"text": string} objects; at least one',
        json_schema_extra={"minItems": 1},
    )
    top_n: Annotated[int, Field(ge=0)] | None = Field(
        None, description="how many results to return; 0 or null returns all"
    )
    instruction: str | None = Field(
        None, description="the task description in the prompt; null: the template's"
    )
    chunking: ChunkingRequest | None = Field(
        None, description="tpuscore's: score each document by its chunks (docs/chunking.md)"
    )


def _document_object(value: Any) -> str | dict[str, Any]:
    """A Cohere v1 document: a string, or an object of string fields (kept whole, to return)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and value and all(isinstance(v, str) for v in value.values()):
        return value
    raise PydanticCustomError(
        "invalid_documents",
        "must be a string or an object of string fields, got {got}",
        {"got": short(value)},
    )


DocumentObject = Annotated[
    str | dict[str, str],
    PlainValidator(_document_object),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string"},
                {"type": "object", "additionalProperties": {"type": "string"}, "minProperties": 1},
            ]
        }
    ),
]


def rank_text(document: str | dict[str, str], rank_fields: list[str] | None) -> str:
    """The text a Cohere v1 document is ranked on.

    A string is itself. An object is ranked on its `text` field, or, given rank_fields, on
    those fields in that order, one `name: value` line each: Cohere ranks on "the values in
    title, author, text sequentially" and formats semi-structured documents as YAML lines."""
    if isinstance(document, str):
        return document
    if rank_fields is None:
        if "text" not in document:
            raise ValueError('an object document needs a "text" field, or give rank_fields')
        return document["text"]
    missing = [f for f in rank_fields if f not in document]
    if missing:
        raise ValueError(f"has no field {', '.join(map(repr, missing))} named in rank_fields")
    return "\n".join(f"{f}: {document[f]}" for f in rank_fields)


class RerankRequest(_RerankFields):
    """The Cohere v1 / Jina rerank request (`/v1/rerank`, `/rerank`), as vLLM serves it.

    After validation `documents` holds the texts ranked on; `originals` the documents as sent,
    returned when `return_documents`."""

    documents: Annotated[list[DocumentObject], AfterValidator(not_empty)] = Field(
        description="strings, or objects of string fields ranked on `text` or on `rank_fields`; "
        "at least one",
        json_schema_extra={"minItems": 1},
    )
    return_documents: bool = Field(True, description="include each document in its result")
    max_tokens_per_doc: Annotated[int, Field(ge=1)] | None = Field(
        None, description="cut each document to this many tokens; null: a too-long one fails"
    )
    rank_fields: Annotated[list[str], Field(min_length=1)] | None = Field(
        None,
        description="the object documents' fields to rank on, in order, as `name: value` lines; "
        "null: the `text` field",
    )
    max_chunks_per_doc: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="Cohere's: score each document by its first max_chunks_per_doc chunks of "
        "max_tokens_per_doc tokens (null: what fits), the best chunk's score (docs/chunking.md)",
    )
    truncate_prompt_tokens: DefaultOnly = default_only(None, "vLLM's; accepted only as null")
    priority: DefaultOnly = default_only(0, "vLLM's; accepted only as 0")
    use_activation: DefaultOnly = default_only(None, "vLLM's; accepted only as null")
    _originals: list[str | dict[str, str]] = pydantic.PrivateAttr(default_factory=list)

    @pydantic.model_validator(mode="after")
    def _rank_texts(self) -> RerankRequest:
        self._originals = list(self.documents)
        texts = []
        for i, document in enumerate(self._originals):
            try:
                texts.append(rank_text(document, self.rank_fields))
            except ValueError as e:
                raise PydanticCustomError(
                    "invalid_documents", "{reason}", {"param": f"documents[{i}]", "reason": str(e)}
                ) from None
        self.documents = texts
        return self

    @property
    def originals(self) -> list[str | dict[str, str]]:
        return self._originals


class RerankV2Request(_RerankFields):
    """Cohere's v2 rerank request (`/v2/rerank`)."""

    max_tokens_per_doc: Annotated[int, Field(ge=1)] | None = Field(
        COHERE_MAX_TOKENS_PER_DOC, description="cut each document to this many tokens"
    )
    relevant_spans: DefaultOnly = default_only(None, "accepted only as null")
    priority: DefaultOnly = default_only(0, "accepted only as 0")


def _text_or_texts(value: Any) -> str | list[str]:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    raise PydanticCustomError(
        "invalid_argument",
        "must be a string or a non-empty list of strings, got {got}",
        {"got": short(value)},
    )


TextOrTexts = Annotated[
    str | list[str],
    PlainValidator(_text_or_texts),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "minItems": 1},
            ]
        }
    ),
]


class TokenizeRequest(WireRequest):
    """vLLM's `/tokenize` request (the completion form: a prompt)."""

    model: str | None = Field(None, description="accepted, not checked: one server, one model")
    prompt: str
    add_special_tokens: bool = Field(True, description="add the tokenizer's special tokens (BOS)")
    return_token_strs: bool = Field(False, description="also return each token as a string")


class DetokenizeRequest(WireRequest):
    """vLLM's `/detokenize` request."""

    model: str | None = Field(None, description="accepted, not checked: one server, one model")
    tokens: list[int]


# The tags of the request unions told apart by shape (score_protocol.AnyScoreRequest's, and
# tei.py's for /rerank's and /tokenize's), which an error's location drops (`error_fields`).
SCORE_SHAPE_TAGS = frozenset({"sglang", "text", "queries", "data", "ambiguous", "other", "tei"})


def error_fields(error: dict[str, Any]) -> tuple[str, str | None, str]:
    """(code, param, message) of one pydantic error on a request body.

    A tpuscore check's error carries its code as its type and may name its field in ctx
    ("param"); any other error takes its field's code from FIELD_CODES. param is the field's
    path as the body spells it ("documents[3]")."""
    loc = tuple(error.get("loc", ()))
    if loc[:1] == ("body",):
        loc = loc[1:]
    if loc[:1] and loc[0] in SCORE_SHAPE_TAGS:  # the score shape's union tag
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
    if param is not None and len(param) > len(short(param)):  # an unknown field's name
        param = short(param)
    return code, param, f"{param}: {message}" if param else message
