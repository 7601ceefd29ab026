"""vLLM's dialect: POST /score with vLLM's fields, /tokenize, /detokenize and GET /v1/models,
mixed into `Service`."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Iterable
from typing import TypeVar

from fastapi import Request
from starlette.responses import Response

from tpuscore.api import bounds
from tpuscore.api.errors import ValidationError
from tpuscore.serving import protocol, responses, score_protocol
from tpuscore.serving.dialects import JSONResponse
from tpuscore.serving.errors import rerank_not_configured, wire_names
from tpuscore.tasks import ranking

T = TypeVar("T")


class VllmEndpoints:
    """vLLM's endpoints, over the `Service` attributes they read (template, labels, positive,
    scorer, limits, batcher, scored, require_tokenizer, metrics)."""

    async def score_pairs(
        self,
        request: Request,
        body: score_protocol.VllmTextScoreRequest
        | score_protocol.VllmQueriesScoreRequest
        | score_protocol.VllmDataScoreRequest,
    ) -> Response:
        """vLLM's scoring: each (query, document) pair's reranker score, as /v1/rerank gives
        the same pair (the server's template and labels)."""
        if self.template is None:
            raise rerank_not_configured("vLLM's /score (text_1, text_2)")
        adapter = self.adapter(body.model)
        pairs = body.pairs()
        first, second = body.SIDES
        queries = [query for query, _ in pairs]
        bounds.check_size(
            self.limits,
            items=(second, [doc for _, doc in pairs]),
            values={first: queries if len(set(queries)) > 1 else queries[:1]},
            num_labels=self.num_labels,
        )
        bounds.check_texts({side: getattr(body, side) for side in body.SIDES})
        by_query: dict[str, list[int]] = {}
        for i, query in enumerate(queries):
            by_query.setdefault(query, []).append(i)
        # Each distinct query is a batcher request: the request is admitted whole or not at all.
        most = min(self.limits.max_queries, self.batcher.max_pending)
        if len(by_query) > most:
            raise ValidationError(
                "too_many_queries",
                f"{first} holds {len(by_query)} distinct queries; each is scored as a request of "
                f"its own, and this server takes at most {most} in one request "
                "(--max-queries, --max-pending)",
                first,
            )
        groups = list(by_query.items())
        results = await all_or_none(
            self.relevance(
                request, query, [pairs[i][1] for i in indexes], body.SIDES, indexes, adapter
            )
            for query, indexes in groups
        )
        scores = [0.0] * len(pairs)
        num_tokens = 0
        for (_, indexes), result in zip(groups, results, strict=True):
            num_tokens += result.num_tokens
            for ranked in ranking.rank_result(result, indexes, positive=self.positive):
                scores[ranked.item] = ranked.score  # as /v1/rerank scores the pair
            self.metrics.scored(request.url.path, len(indexes), result)
        response = responses.VllmScoreResponse(
            id=f"score-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=adapter or self.model_name,
            data=[responses.VllmScoreData(index=i, score=s) for i, s in enumerate(scores)],
            usage=responses.VllmUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
        )
        return JSONResponse(response.model_dump())

    async def relevance(
        self,
        request: Request,
        query: str,
        docs: list[str],
        sides: tuple[str, str],
        indexes: list[int],
        adapter: str | None = None,
    ):
        """The ScoreResult of docs against query under the server's template and labels, which
        `ranking.rank_result` turns into the relevance scores a rerank gives, under `adapter`
        (None: the base). An error names the wire's fields, a document by its pair's index
        (docs[j] is pair indexes[j])."""
        t = self.template
        try:
            return await self.scored(
                request,
                query=t.render_query(query),
                items=[t.render_item(doc) for doc in docs],
                labels=self.labels,
                item_suffix=t.item_suffix,
                adapter=adapter,
            )
        except ValidationError as e:
            if e.loc[:1] == ("items",) and len(e.loc) > 1 and isinstance(e.loc[1], int):
                loc = (sides[1], indexes[e.loc[1]], *e.loc[2:])
                raise ValidationError(e.code, str(e), loc=loc) from None
            raise wire_names(e, {"query": sides[0], "items": sides[1]}) from None

    async def tokenize(self, body: protocol.TokenizeRequest) -> Response:
        """vLLM's /tokenize: the prompt's token ids under the scorer's tokenizer."""
        tokenizer = self.require_tokenizer("prompt")
        bounds.check_size(self.limits, items=("prompt", []), values={"prompt": body.prompt})
        bounds.check_text(body.prompt, "prompt")
        encoding = await asyncio.to_thread(  # off the event loop, as every tokenization
            tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens
        )
        response = responses.TokenizeResponse(
            count=len(encoding.ids),
            max_model_len=self.scorer.config.max_position_embeddings,
            tokens=encoding.ids,
            token_strs=encoding.tokens if body.return_token_strs else None,
        )
        return JSONResponse(response.model_dump())

    async def detokenize(self, body: protocol.DetokenizeRequest) -> Response:
        """vLLM's /detokenize: the text of token ids under the scorer's tokenizer."""
        tokenizer = self.require_tokenizer("tokens")
        bounds.check_size(self.limits, items=("tokens", []), values={"tokens": body.tokens})
        vocab_size = self.scorer.config.vocab_size
        for j, t in enumerate(body.tokens):
            if not 0 <= t < vocab_size:
                code = "token_id_negative" if t < 0 else "token_id_exceeds_vocab"
                raise ValidationError(
                    code,
                    f"tokens[{j}] is {t}; the model's vocabulary has {vocab_size} tokens "
                    f"(ids 0..{vocab_size - 1})",
                    "tokens",
                )
        prompt = tokenizer.decode(body.tokens, skip_special_tokens=False)
        return JSONResponse(responses.DetokenizeResponse(prompt=prompt).model_dump())

    async def models(self) -> Response:
        """The model this server serves, then its LoRA adapters, each with `parent` (and `root`)
        the base, as vLLM lists LoRA modules."""
        common = {
            "created": self.created,
            "max_model_len": self.scorer.config.max_position_embeddings,
        }
        cards = [responses.ModelCard(id=self.model_name, root=self.model_name, **common)]
        cards += [
            responses.ModelCard(id=name, root=self.model_name, parent=self.model_name, **common)
            for name in self.scorer.adapters
        ]
        return JSONResponse(responses.ModelList(data=cards).model_dump())


async def all_or_none(works: Iterable[Awaitable[T]]) -> list[T]:
    """Every result of `works`, run concurrently; if one fails, the others are cancelled (a
    batcher request cancelled is dropped unscored) before its error is raised."""
    tasks = [asyncio.ensure_future(work) for work in works]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
