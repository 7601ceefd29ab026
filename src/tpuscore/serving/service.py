"""The endpoints over one scorer and its batcher: `Service`, its shared parts here and each
dialect's handlers in its own module (sglang.py, vllm.py, rerank.py)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from starlette.responses import Response

from tpuscore.api import templates
from tpuscore.api.errors import ValidationError
from tpuscore.api.messages import short
from tpuscore.api.requests import RequestLimits
from tpuscore.scorer import Scorer
from tpuscore.serving import dialects, guards, responses, score_protocol
from tpuscore.serving.batcher import Batcher
from tpuscore.serving.dialects import JSONResponse
from tpuscore.serving.metrics import CONTENT_TYPE, Metrics
from tpuscore.serving.rerank import RerankEndpoints
from tpuscore.serving.sglang import SglangEndpoints
from tpuscore.serving.vllm import VllmEndpoints
from tpuscore.tasks import ranking


class Service(SglangEndpoints, VllmEndpoints, RerankEndpoints):
    """The endpoints over one scorer and its batcher."""

    def __init__(
        self,
        scorer: Scorer,
        batcher: Batcher,
        *,
        model_name: str,
        rerank_template: str | templates.Template | None,
        max_body_bytes: int,
        limits: RequestLimits,
    ):
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes ({max_body_bytes}) must be >= 1")
        classes = scorer.config.num_labels
        self.template = _template(rerank_template)
        # A classification model ranks by its own classes: the template renders the text and
        # supplies the item suffix, not the labels; the relevant class is the only one, else the
        # last (LABEL_1 of a binary classifier).
        self.labels = None if classes or self.template is None else list(self.template.labels)
        self.positive = ranking.relevant_class(classes)
        if self.template is not None:
            _check_fits(scorer, self.template, self.labels)
        fitted = scorer.score_calibration
        if fitted is not None and fitted.template is not None and self.template is not None:
            fitted.check(template=self.template.name)  # docs/calibration.md
        self.scorer, self.batcher = scorer, batcher
        self.model_name = model_name
        self.max_body_bytes, self.limits = max_body_bytes, limits
        self.num_labels = len(self.labels) if self.labels else classes
        self.metrics = Metrics(executables_guard=scorer.engine.executables)
        self.created = int(time.time())

    async def scored(self, request: Request, **score_kwargs: Any):
        """The Batcher's result for this HTTP request, under its deadline (the header, at most
        the server's), dropped unscored if its client disconnects first."""
        timeout_s = guards.request_timeout(request.headers, self.batcher.request_timeout_s)
        work = self.batcher.score_async(timeout_s=timeout_s, **score_kwargs)
        return await guards.unless_disconnected(request.receive, work)

    async def score_any(self, request: Request, body: score_protocol.AnyScoreRequest) -> Response:
        """SGLang's or vLLM's score request, told apart by their fields."""
        if isinstance(body, score_protocol.ScoreRequest):
            dialects.speak(request.scope, "sglang")
            return await self.score(request, body)
        dialects.speak(request.scope, "vllm")
        return await self.score_pairs(request, body)

    def require_tokenizer(self, param: str):
        if self.scorer.tokenizer is None:
            raise ValidationError(
                "invalid_argument",
                "this server's model has no tokenizer: it takes token ids only",
                param,
            )
        return self.scorer.tokenizer

    def adapter(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` field names, as vLLM serves LoRA modules: None
        (the base) for no model or the served model's name, else one of the scorer's adapters.
        Any other name is `model_not_found` (404) where adapters are loaded; without adapters
        the field is accepted unchecked, as before adapters (one server, one model: clients
        send names such as "default")."""
        if model is None or model == self.model_name or not self.scorer.adapters:
            return None
        if model in self.scorer.adapters:
            return model
        served = ", ".join(repr(m) for m in [self.model_name, *self.scorer.adapters])
        raise ValidationError(
            "model_not_found",
            f"the model {short(model)} does not exist; this server serves {served}",
            "model",
        )

    async def health(self) -> Response:
        """`ok` once the model is loaded."""
        return JSONResponse(responses.Health(model=self.model_name).model_dump())

    async def prometheus(self) -> Response:
        """The Prometheus series: requests by status, latency, items, tokens, backends."""
        return Response(self.metrics.text(), media_type=CONTENT_TYPE)


# `--rerank-template none`: a server for /v1/score alone, whose model need not fit any template.
NO_RERANK = "none"


def _template(rerank_template: str | templates.Template | None) -> templates.Template | None:
    """The rerank template a server was given: a Template, a name, or None ("none"): none."""
    if rerank_template is None or rerank_template == NO_RERANK:
        return None
    if isinstance(rerank_template, templates.Template):
        return rerank_template
    try:
        return templates.get(rerank_template)
    except ValueError as e:  # ValidationError: unknown_template
        raise ValueError(f"--rerank-template: {e}") from None


def _check_fits(scorer: Scorer, template: templates.Template, labels: list[str] | None) -> None:
    """ValueError where a template's labels are not single tokens of the model (every rerank
    would fail), naming the way out."""
    try:
        scorer.prepare(
            template.render_query("query"),
            [template.render_item("document")],
            labels=labels,
            item_suffix=template.item_suffix,
        )
    except ValidationError as e:
        raise ValueError(
            f"rerank template {template.name!r} does not fit this model: {e}; choose another "
            "--rerank-template, --rerank-template none to serve /v1/score without the rerank "
            "endpoints, or in Python give create_app a templates.Template whose labels are "
            "single tokens here (docs/serving.md)"
        ) from None
