"""Text Embeddings Inference's (TEI's) `/rerank` and `/tokenize`, beside the other peers' bodies on
the same paths.

TEI's request and response shapes are those of its router (huggingface/text-embeddings-inference,
router/src/http/types.rs: `RerankRequest`, `Rank`, `TokenizeRequest`, `SimpleToken`; the handlers
in router/src/http/server.rs). A body is told apart from the other peers' by its fields, as
/v1/score tells SGLang's from vLLM's: `/rerank` with `texts` is TEI's, with `documents` Cohere's,
Jina's or vLLM's; `/tokenize` with `inputs` is TEI's, with `prompt` vLLM's. A body with both
is refused with 400 `ambiguous_request`.

A TEI rerank scores each text with the server's rerank template, as `/v1/rerank` does: its
`score` is the same relevance score, P(yes) / (P(yes) + P(no)) (a classification model: the
relevant class's probability), and with `raw_scores` the logit whose sigmoid that is,
log P(yes) - log P(no), as TEI's raw scores are a reranker's logit before its sigmoid. Results
are sorted as TEI sorts them: highest score first, equal scores in reverse input order (TEI sorts
ascending, stably, then reverses).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
import pydantic
import scipy.special
from fastapi import Request
from pydantic import AfterValidator, BaseModel, Field, RootModel
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError
from starlette.responses import Response

from tpuscore.api import bounds
from tpuscore.api.errors import ValidationError
from tpuscore.api.results import ScoreResult
from tpuscore.serving import dialects, protocol, responses
from tpuscore.serving.dialects import JSONResponse

if TYPE_CHECKING:
    from tpuscore.serving.app import Service

# The fields that make a body TEI's, and the other peers' on the same path.
TEI_RERANK_FIELD, OTHER_RERANK_FIELD = "texts", "documents"
TEI_TOKENIZE_FIELD, OTHER_TOKENIZE_FIELD = "inputs", "prompt"

# -- requests -------------------------------------------------------------------------------------


class TeiRerankRequest(protocol.WireRequest):
    """TEI's `/rerank` request."""

    model_config = pydantic.ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "query": "What is Deep Learning?",
                    "texts": ["Deep Learning is not...", "Deep learning is..."],
                    "raw_scores": False,
                }
            ]
        }
    )

    query: str
    texts: Annotated[list[str], AfterValidator(protocol.not_empty)] = Field(
        description="the texts to rank; at least one", json_schema_extra={"minItems": 1}
    )
    truncate: bool | None = Field(
        None,
        description="true: cut each text to what fits beside the query; false or null: a text "
        "that does not fit fails with sequence_too_long",
    )
    truncation_direction: Literal["right", "left", "Right", "Left"] = Field(
        "right", description="right: a cut text keeps its start; left: its end"
    )
    raw_scores: bool = Field(False, description="return the logits, not their sigmoid")
    return_text: bool = Field(False, description="include each text in its result")


class TeiTokenizeRequest(protocol.WireRequest):
    """TEI's `/tokenize` request."""

    inputs: protocol.TextOrTexts = Field(description="a text, or a non-empty list of texts")
    add_special_tokens: bool = Field(True, description="add the tokenizer's special tokens (BOS)")
    prompt_name: protocol.DefaultOnly = protocol.default_only(
        None, "TEI's sentence-transformers prompt; accepted only as null"
    )


class _AmbiguousRequest(BaseModel):
    """A body with both TEI's field and the other peers' on the same path: refused."""

    @pydantic.model_validator(mode="before")
    @classmethod
    def _refuse(cls, body: dict[str, Any]) -> Any:
        tei = TEI_RERANK_FIELD if TEI_RERANK_FIELD in body else TEI_TOKENIZE_FIELD
        other = OTHER_RERANK_FIELD if tei == TEI_RERANK_FIELD else OTHER_TOKENIZE_FIELD
        raise PydanticCustomError(
            "ambiguous_request",
            "the body has TEI's field {tei} and the other shape's {other}; send one shape",
            {"param": tei, "tei": tei, "other": other},
        )


def _shape(tei_field: str, other_field: str) -> Callable[[Any], str]:
    def shape(body: Any) -> str:
        if not isinstance(body, dict) or tei_field not in body:
            return "other"
        return "ambiguous" if other_field in body else "tei"

    return shape


AnyRerankRequest = Annotated[
    Annotated[protocol.RerankRequest, pydantic.Tag("other")]
    | Annotated[TeiRerankRequest, pydantic.Tag("tei")]
    | SkipJsonSchema[Annotated[_AmbiguousRequest, pydantic.Tag("ambiguous")]],
    pydantic.Discriminator(_shape(TEI_RERANK_FIELD, OTHER_RERANK_FIELD)),
]
AnyTokenizeRequest = Annotated[
    Annotated[protocol.TokenizeRequest, pydantic.Tag("other")]
    | Annotated[TeiTokenizeRequest, pydantic.Tag("tei")]
    | SkipJsonSchema[Annotated[_AmbiguousRequest, pydantic.Tag("ambiguous")]],
    pydantic.Discriminator(_shape(TEI_TOKENIZE_FIELD, OTHER_TOKENIZE_FIELD)),
]

# -- responses ------------------------------------------------------------------------------------


class TeiRank(BaseModel):
    index: int
    text: str | None = Field(None, description="absent unless return_text")
    score: float


class TeiRerankResponse(RootModel[list[TeiRank]]):
    """TEI's `/rerank` response: highest score first, equal scores in reverse input order."""


class TeiToken(BaseModel):
    id: int
    text: str
    special: bool
    start: int | None = Field(description="the token's first byte in the input; null: special")
    stop: int | None = Field(description="one past its last byte; null: special")


class TeiTokenizeResponse(RootModel[list[list[TeiToken]]]):
    """TEI's `/tokenize` response: a list of tokens per input (one list for a single text)."""


# -- handlers -------------------------------------------------------------------------------------


def log_odds(result: ScoreResult, positive: int) -> np.ndarray:
    """Per item, the logit whose sigmoid is the relevance score `ranking.rank_result` gives:
    log P(positive) - log(sum of the other labels' P) (a one-logit classifier: its logit)."""
    logits = result.logprobs.astype(np.float64)
    if result.classification and logits.shape[1] == 1:
        return logits[:, 0]
    others = np.delete(logits, positive, axis=1)
    return logits[:, positive] - scipy.special.logsumexp(others, axis=1)


async def rerank(service: Service, request: Request, body: TeiRerankRequest) -> Response:
    """TEI's rerank: every text's relevance to the query under the server's template."""
    from tpuscore.serving.app import wire_names  # app imports this module

    texts = body.texts
    bounds.check_size(
        service.limits,
        items=("texts", texts),
        values={"query": body.query},
        num_labels=service.num_labels,
    )
    bounds.check_texts({"query": body.query, "texts": texts})  # before anything tokenizes
    # Each distinct text is scored once: equal texts get equal scores, so TEI's tie order holds.
    distinct = list(dict.fromkeys(texts))
    t = service.template
    query = t.render_query(body.query)
    max_tokens = None
    if body.truncate and service.scorer.tokenizer is not None:
        room = await asyncio.to_thread(service.room_beside, query)
        if room >= 1:  # else the query alone is too long: sequence_too_long says so
            max_tokens = room
    try:
        result = await service.scored(
            request,
            query=query,
            items=[t.render_item(text) for text in distinct],
            labels=service.labels,
            item_suffix=t.item_suffix,
            max_item_tokens=max_tokens,
            truncate=body.truncation_direction.lower(),
        )
    except ValidationError as e:
        raise wire_names(e, {"items": "texts"}) from None
    service.metrics.scored(request.url.path, len(distinct), result)
    # The relevance score as every rerank door computes it (ranking.rank_result), so TEI's
    # scores equal theirs bit for bit; raw_scores: its logit, log P(yes) - log P(no).
    if body.raw_scores:
        values = log_odds(result, service.positive)
    else:
        values = result.label_probs[:, service.positive]
    by_text = dict(zip(distinct, values, strict=True))
    scores = [float(by_text[text]) for text in texts]
    order = sorted(range(len(texts)), key=lambda i: (scores[i], i), reverse=True)
    ranks = [
        TeiRank(index=i, text=texts[i] if body.return_text else None, score=scores[i]).model_dump(
            exclude_none=True
        )
        for i in order
    ]
    return JSONResponse(ranks)


def tokens_of(encoding: Any, text: str) -> list[dict[str, Any]]:
    """TEI's tokens of one text's encoding: byte offsets into its UTF-8, and the bytes they span
    as text (core/src/tokenization.rs `into_tokens`); a special token has its own text and no
    offsets. Plain dicts, as `TeiToken` dumps them: a pydantic object per token took ~1.4 KB."""
    data = text.encode("utf-8")
    # tokenizers' Python encodings give character offsets; TEI's are bytes. A character's UTF-8
    # length from its code point, without a Python object per character.
    points = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    widths = 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000)
    byte_at = np.concatenate(([0], np.cumsum(widths))).tolist()
    tokens = []
    for token_id, (start, stop), special, token in zip(
        encoding.ids,
        encoding.offsets,
        encoding.special_tokens_mask,
        encoding.tokens,
        strict=True,
    ):
        if special:
            tokens.append({"id": token_id, "text": token, "special": True, "start": None,
                           "stop": None})  # fmt: skip
            continue
        first, last = byte_at[start], byte_at[stop]
        piece = data[first:last].decode("utf-8", errors="replace")
        tokens.append({"id": token_id, "text": piece, "special": False, "start": first,
                       "stop": last})  # fmt: skip
    return tokens


def _tokenized(service: Service, texts: list[str], add_special_tokens: bool) -> list[list[dict]]:
    """Each text's TEI tokens, the answer bounded as a score answer is: at most max_scores
    tokens in all (a body within the length bounds can hold millions, ~300 bytes each here and
    ~70 in the JSON)."""
    tokenizer = service.require_tokenizer("inputs")
    encodings = tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
    total, most = sum(len(e.ids) for e in encodings), service.limits.max_scores
    if total > most:
        raise ValidationError(
            "request_too_large",
            f"the inputs make {total} tokens; this server answers at most {most} per request "
            "(--max-scores)",
            "inputs",
        )
    return [tokens_of(e, text) for e, text in zip(encodings, texts, strict=True)]


async def tokenize(service: Service, body: TeiTokenizeRequest) -> Response:
    """TEI's tokenize: each input's tokens under the served model's tokenizer."""
    service.require_tokenizer("inputs")
    inputs = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    bounds.check_size(service.limits, items=("inputs", inputs), values={})
    bounds.check_texts({"inputs": body.inputs})
    # Off the event loop: inputs within the bounds can take seconds to tokenize.
    tokens = await asyncio.to_thread(_tokenized, service, inputs, body.add_special_tokens)
    return JSONResponse(tokens)


def routes(service: Service) -> list[tuple[str, Callable[..., Any], Any]]:
    """(path, handler, response model) of `/rerank` and `/tokenize`, each taking TEI's body or
    the other peers' (served by `service`'s own handlers)."""

    async def rerank_any(request: Request, body: AnyRerankRequest) -> Response:
        """TEI's rerank (`texts`), or Cohere v1's / Jina's / vLLM's (`documents`)."""
        if isinstance(body, TeiRerankRequest):
            dialects.speak(request.scope, "tei")
            return await rerank(service, request, body)
        return await service.rerank_v1(request, body)

    async def tokenize_any(request: Request, body: AnyTokenizeRequest) -> Response:
        """TEI's tokenize (`inputs`), or vLLM's (`prompt`)."""
        if isinstance(body, TeiTokenizeRequest):
            dialects.speak(request.scope, "tei")
            return await tokenize(service, body)
        return await service.tokenize(body)

    return [
        ("/rerank", rerank_any, responses.RerankResponse | TeiRerankResponse),
        ("/tokenize", tokenize_any, responses.TokenizeResponse | TeiTokenizeResponse),
    ]
