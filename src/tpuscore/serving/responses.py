"""The wire format of the server's answers: a pydantic model per endpoint's response (the
requests are `protocol`'s and `score_protocol`'s); `/openapi.json` describes them from these."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tpuscore.tasks.chunking import RankedDocument


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
    calibrated: list[float] | None = Field(
        None, description="P(positive) per item under --score-calibration; absent without one"
    )


def calibrated(result: Any, index: int | None = None) -> list[float] | float | None:
    """A result's calibrated probabilities (one item's, given its index), or None."""
    if result.calibrated is None:
        return None
    return result.calibrated.tolist() if index is None else float(result.calibrated[index])


class VllmUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0
    prompt_tokens_details: None = None


class VllmScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class VllmScoreResponse(BaseModel):
    """vLLM's `/score` response: a score per (query, document) pair, in pair order."""

    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[VllmScoreData]
    usage: VllmUsage


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class RerankDocument(BaseModel):
    """The document as sent: {"text"} for a string, the whole object for an object."""

    model_config = ConfigDict(extra="allow")

    text: str | None = None

    @classmethod
    def of(cls, document: str | dict[str, str]) -> RerankDocument:
        return cls(text=document) if isinstance(document, str) else cls(**document)


CALIBRATED_SCORE = Field(None, description="the calibrated probability; absent without one")


class RerankChunk(BaseModel):
    """A chunked document's best chunk: its index and [start, end) tokens in the document."""

    index: int
    start: int
    end: int

    @classmethod
    def of(cls, ranked: Any) -> RerankChunk | None:
        if not isinstance(ranked, RankedDocument):
            return None
        start, end = ranked.best_span
        return cls(index=ranked.best_chunk, start=start, end=end)


CHUNK = Field(None, description="the best-scoring chunk; absent unless chunked")


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    calibrated_score: float | None = CALIBRATED_SCORE
    chunk: RerankChunk | None = CHUNK
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
    calibrated_score: float | None = CALIBRATED_SCORE
    chunk: RerankChunk | None = CHUNK


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
    root: str | None = None  # the base model (vLLM's)
    parent: str | None = None  # a LoRA adapter's base; None for the base itself
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
