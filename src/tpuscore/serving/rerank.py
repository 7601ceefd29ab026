"""The rerank dialects: POST /v1/rerank and /rerank (Cohere v1, Jina, as vLLM serves them) and
/v2/rerank (Cohere v2), mixed into `Service`."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import attrs
from fastapi import Request
from starlette.responses import Response

from tpuscore.api import bounds, tokenization
from tpuscore.api.chunking import Chunking
from tpuscore.api.errors import ValidationError
from tpuscore.serving import protocol, responses
from tpuscore.serving.dialects import JSONResponse
from tpuscore.serving.errors import wire_names
from tpuscore.tasks import chunking as chunked
from tpuscore.tasks import ranking

# The library calls a rerank's documents `items`; its errors name them as the wire does.
RERANK_PARAMS = {"items": "documents"}


class RerankEndpoints:
    """The rerank endpoints, over the `Service` attributes they read (template, labels,
    positive, scorer, limits, scored, metrics)."""

    async def rerank_v1(self, request: Request, body: protocol.RerankRequest) -> Response:
        """Documents sorted by relevance to the query, highest first (Cohere v1, Jina, vLLM)."""
        ranked, result = await self.rerank(request, body)
        self.metrics.scored(request.url.path, len(body.documents), result)
        results = [
            responses.RerankResult(
                index=r.index,
                relevance_score=float(r.score),
                calibrated_score=responses.calibrated(result, r.index),
                chunk=responses.RerankChunk.of(r),
                document=responses.RerankDocument.of(body.originals[r.index])
                if body.return_documents
                else None,
            )
            for r in ranked
        ]
        usage = responses.RerankUsage(
            prompt_tokens=result.num_tokens, total_tokens=result.num_tokens
        )
        response = responses.RerankResponse(
            id=f"rerank-{uuid.uuid4().hex}",
            model=self.adapter(body.model) or self.model_name,
            usage=usage,
            results=results,
        )
        return JSONResponse(response.model_dump(exclude_none=True))  # no document: no key

    async def rerank_v2(self, request: Request, body: protocol.RerankV2Request) -> Response:
        """Documents sorted by relevance to the query, highest first (Cohere v2)."""
        ranked, result = await self.rerank(request, body, fit=True)
        self.metrics.scored(request.url.path, len(body.documents), result)
        tokens = responses.BilledUnits(input_tokens=result.num_tokens)
        response = responses.RerankV2Response(
            id=str(uuid.uuid4()),
            results=[
                responses.RerankV2Result(
                    index=r.index,
                    relevance_score=float(r.score),
                    calibrated_score=responses.calibrated(result, r.index),
                    chunk=responses.RerankChunk.of(r),
                )
                for r in ranked
            ],
            meta=responses.RerankV2Meta(
                api_version=responses.ApiVersion(), billed_units=tokens, tokens=tokens
            ),
        )
        return JSONResponse(response.model_dump(exclude_none=True))

    async def rerank(
        self,
        request: Request,
        body: protocol.RerankRequest | protocol.RerankV2Request,
        *,
        fit: bool = False,
    ):
        """(ranked documents, ScoreResult) under the server's template.

        The relevance score is P(positive label) / (P(positive) + P(negative)), as Scorer.rank
        computes it, or on a classification model the relevant class's probability; `top_n` null
        or 0 returns every document (vLLM's default is 0). max_tokens_per_doc cuts each
        document to the text of its first that many tokens, counted on the document alone (the
        template's words around it are not the document's). With fit, each rendered document is
        also cut to what fits beside the query (Cohere's v2 behaviour) instead of failing
        sequence_too_long."""
        adapter = self.adapter(body.model)
        docs = body.documents
        bounds.check_size(
            self.limits,
            items=("documents", docs),
            values={"query": body.query, "instruction": body.instruction},
            num_labels=self.num_labels,
        )
        # Before anything tokenizes them (room_beside does, for v2).
        bounds.check_texts(
            {"query": body.query, "instruction": body.instruction, "documents": docs}
        )
        t = self.template
        query = t.render_query(body.query, instruction=body.instruction)
        tokenizer, max_tokens, texts = self.scorer.tokenizer, None, docs
        if fit and tokenizer is not None:
            room = await asyncio.to_thread(self.room_beside, query)
            if room >= 1:  # else the query alone is too long: sequence_too_long says so
                max_tokens = room
        chunks = None
        if (chunking := protocol.chunking(body)) is not None:  # docs/chunking.md
            chunks, chunking = await asyncio.to_thread(
                self.chunked, query, docs, chunking, body.max_tokens_per_doc
            )
            texts = chunks.items  # a chunk is window tokens; fit still fits
        elif body.max_tokens_per_doc is not None and tokenizer is not None:
            # The document's own tokens, not the template's words around it.
            texts = await asyncio.to_thread(
                tokenization.cut_to_tokens, tokenizer, docs, body.max_tokens_per_doc
            )
        try:
            result = await self.scored(
                request,
                query=query,
                items=[t.render_item(text) for text in texts],
                labels=self.labels,
                item_suffix=t.item_suffix,
                max_item_tokens=max_tokens,
                truncate="right",
                adapter=adapter,
            )
        except ValidationError as e:
            e = e if chunks is None else chunked.located(e, chunks)
            raise wire_names(e, RERANK_PARAMS) from None
        if chunks is not None:
            scored = chunked.aggregate(chunks, result.label_probs[:, self.positive], chunking)
            # A chunk's calibrated probability is not its document's: none is returned.
            result = attrs.evolve(result, calibrated=None)
            return chunked.rank_documents(scored, docs, body.top_n or None), result
        ranked = ranking.rank_result(result, docs, positive=self.positive, top_k=body.top_n or None)
        return ranked, result

    def chunked(self, query: str, docs: list[str], options: dict[str, Any], max_tokens: int | None):
        """(chunks, Chunking) of the documents; a window left out (Cohere's max_chunks_per_doc
        alone) is max_tokens_per_doc, else what fits beside the query and the template (at least
        a token: a query that leaves none fails sequence_too_long, as without chunking)."""
        if "window" not in options and max_tokens is None:
            part = self.template.render_item("")
            max_tokens = max(
                1,
                self.room_beside(query)
                - len(tokenization.encode_items(self.require_tokenizer("documents"), [part])[0]),
            )
        options.setdefault("window", max_tokens)
        plan = Chunking.of(options)
        tokenizer = self.require_tokenizer("documents")
        split = chunked.split(
            tokenizer, docs, plan, "documents", limits=self.limits, num_labels=self.num_labels,
            holder="this server",
        )  # fmt: skip
        return split, plan

    def room_beside(self, rendered_query: str) -> int:
        """A document's most tokens beside this query under the template: the model's positions
        less the query's and the item suffix's tokens."""
        tokenizer = self.scorer.tokenizer
        query = tokenization.encode_query(tokenizer, rendered_query)
        suffix = tokenization.encode_suffix(tokenizer, self.template.item_suffix or "")
        return self.scorer.config.max_position_embeddings - len(query) - len(suffix)
