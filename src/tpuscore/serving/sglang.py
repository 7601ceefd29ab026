"""SGLang's dialect: POST /v1/score (and /score with SGLang's fields), mixed into `Service`."""

from __future__ import annotations

from fastapi import Request
from starlette.responses import Response

from tpuscore.api import bounds
from tpuscore.serving import responses, score_protocol
from tpuscore.serving.dialects import JSONResponse


class SglangEndpoints:
    """SGLang's endpoint, over the `Service` attributes it reads (limits, scored, metrics)."""

    async def score(self, request: Request, body: score_protocol.ScoreRequest) -> Response:
        """SGLang's scoring: P(label | query + item) for each item and label; on a classification
        model (no label_token_ids), its class logits per item, or their softmax (sigmoid for one
        class) with apply_softmax, as SGLang scores SequenceClassification models."""
        adapter = self.adapter(body.model)
        items = [body.items] if isinstance(body.items, str) else body.items
        bounds.check_size(
            self.limits,
            items=("items", items),
            values={"query": body.query, "labels": body.labels},
            num_labels=bounds.label_count(body.labels, body.label_token_ids),
        )
        result = await self.scored(
            request,
            query=body.query,
            items=items,
            adapter=adapter,
            **score_protocol.score_options(body),
        )
        self.metrics.scored(request.url.path, len(items), result)
        response = responses.ScoreResponse(
            scores=result.scores.tolist(),
            model=adapter or self.model_name,
            usage=responses.Usage.of(result.num_tokens),
            calibrated=responses.calibrated(result),
        )
        return JSONResponse(response.model_dump(exclude_none=True))
