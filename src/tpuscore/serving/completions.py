"""`POST /v1/completions` for scoring: OpenAI's completions request and response, as vLLM serves
them, limited to what scoring needs (docs/completions.md).

- `prompt`: text, token ids, or a list of either (one choice per prompt, in order).
- `echo: true` with `logprobs: k` and `max_tokens: 0` returns, in `choices[i].logprobs`, every
  prompt token: `tokens`, `token_logprobs` (null for the first: nothing predicts it),
  `top_logprobs` (the k most likely tokens there, and the prompt's own) and `text_offset`.
- `max_tokens: 1` also returns the token after the prompt: the greedy one, its log-probability
  and its alternatives (lm-evaluation-harness's `local-completions` asks for this and drops it).
- Anything that needs more generation (max_tokens > 1, n > 1, streaming, sampling at a
  temperature) is refused with `generation_unsupported`: tpuscore scores, it does not generate.

All prompts of a request run in one `Scorer.prompt_logprobs` call, so prompts sharing a prefix
(a question's choices) share its computation. Text is tokenized with the tokenizer's special
tokens (a BOS where it adds one), as vLLM does.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from pydantic import BaseModel, Field, SkipValidation
from starlette.responses import Response

from tpuscore.api import bounds, tokenization
from tpuscore.api.errors import ValidationError
from tpuscore.serving import guards
from tpuscore.serving.admission import estimate_tokens
from tpuscore.serving.batcher import DeadlineExceeded
from tpuscore.serving.protocol import DefaultOnly, WireRequest, default_only
from tpuscore.tasks.prompt_logprobs import TOP, PromptLogprobs

if TYPE_CHECKING:
    from tpuscore.serving.app import Service

PATH = "/v1/completions"


class CompletionRequest(WireRequest):
    """OpenAI's completions request, for scoring (max_tokens 0 or 1)."""

    model: str | None = Field(
        None,
        description="the served model's name (or null), or a LoRA adapter's: the prompt's "
        "log-probabilities under it",
    )
    prompt: SkipValidation[str | list[str] | list[int] | list[list[int]]] = Field(
        description="text, token ids, or a list of either: one choice per prompt"
    )
    max_tokens: int | None = Field(
        16, description="0: the prompt only; 1: also the greedy next token; more is refused"
    )
    echo: bool = Field(False, description="return the prompt's tokens and log-probabilities")
    logprobs: int | None = Field(
        None, ge=0, le=TOP, description=f"the k most likely tokens at each position (<= {TOP})"
    )
    temperature: float | int | None = Field(
        None, description="0 or null with max_tokens 1: the greedy token; no effect with 0"
    )
    seed: int | None = Field(None, description="accepted; nothing is sampled")
    stop: str | list[str] | None = Field(None, description="accepted; nothing is generated")
    user: str | None = Field(None, description="accepted, not used")
    n: DefaultOnly = default_only(1, "accepted only as 1")
    best_of: DefaultOnly = default_only(None, "accepted only as null")
    stream: DefaultOnly = default_only(False, "accepted only as false")
    suffix: DefaultOnly = default_only(None, "accepted only as null")
    logit_bias: DefaultOnly = default_only(None, "accepted only as null")


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["length"] = "length"


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage


def _refuse_generation(body: CompletionRequest) -> None:
    if body.max_tokens is None or not 0 <= body.max_tokens <= 1:
        raise ValidationError(
            "generation_unsupported",
            f"max_tokens is {body.max_tokens}: tpuscore scores and does not generate; give "
            "max_tokens 0 (the prompt's log-probabilities) or 1 (and the greedy next token)",
            "max_tokens",
        )
    if body.max_tokens == 1 and body.temperature not in (None, 0):
        raise ValidationError(
            "generation_unsupported",
            f"temperature is {body.temperature}: tpuscore does not sample; the next token it "
            "returns is the greedy one (give temperature 0 or leave it out)",
            "temperature",
        )


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _prompts(prompt: Any, tokenizer) -> tuple[list[list[int]], list[str | None]]:
    """(token ids, text or None) per prompt; text is tokenized with special tokens."""
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt)
    ):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ValidationError(
            "invalid_prompt",
            "prompt must be text, token ids or a non-empty list of either",
            "prompt",
        )
    ids, texts = [], []
    for i, p in enumerate(prompt):
        where = f"prompt[{i}]" if len(prompt) > 1 else "prompt"
        if isinstance(p, str):
            if tokenizer is None:
                raise ValidationError(
                    "invalid_prompt", "this server's model has no tokenizer: give token ids", where
                )
            bounds.check_text(p, where)
            ids.append(tokenization.encode_query(tokenizer, p))
            texts.append(p)
        elif isinstance(p, list) and all(_is_id(t) for t in p):
            ids.append(p)
            texts.append(None)
        else:
            raise ValidationError("invalid_prompt", f"{where} must be text or token ids", where)
    return ids, texts


class _Strings:
    """Token ids as the strings OpenAI's API returns: each token decoded alone."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, token: int) -> str:
        if token not in self.cache:
            self.cache[token] = (
                f"token_id:{token}"
                if self.tokenizer is None
                else self.tokenizer.decode([token], skip_special_tokens=False)
            )
        return self.cache[token]


def _choice(
    index: int,
    scored: PromptLogprobs,
    text: str | None,
    body: CompletionRequest,
    strings: _Strings,
) -> tuple[CompletionChoice, int]:
    """A prompt's choice and its completion tokens (0 or 1)."""
    n, k = len(scored.tokens), body.logprobs or 0
    tokens, logprobs = list(scored.tokens), [None, *map(float, scored.token_logprobs[1:])]
    generated = []
    if body.max_tokens == 1:
        generated = [int(scored.top_ids[n - 1, 0])]
        tokens.append(generated[0])
        logprobs.append(float(scored.top_logprobs[n - 1, 0]))
    first = 0 if body.echo else n
    if text is None or not body.echo:  # token ids: their text, special tokens too (vLLM's)
        tokenizer = strings.tokenizer
        echoed = body.echo and tokenizer is not None
        text = tokenizer.decode(scored.tokens, skip_special_tokens=False) if echoed else ""
    if generated:
        text += strings(generated[0])
    result = None
    if body.logprobs is not None:
        shown = tokens[first:]
        tops: list[dict[str, float] | None] = []
        for j in range(first, len(tokens)):
            if j == 0:
                tops.append(None)
                continue
            row = j - 1
            # Best first, and the first of tokens that decode alike keeps its place (byte tokens
            # of one UTF-8 character all decode to U+FFFD): the best value stays the top's.
            top: dict[str, float] = {}
            for t, v in zip(scored.top_ids[row, :k], scored.top_logprobs[row, :k], strict=True):
                top.setdefault(strings(int(t)), float(v))
            top.setdefault(strings(tokens[j]), logprobs[j])
            tops.append(top)
        offsets = np.concatenate([[0], np.cumsum([len(strings(t)) for t in shown])])[:-1]
        result = CompletionLogprobs(
            tokens=[strings(t) for t in shown],
            token_logprobs=logprobs[first:],
            top_logprobs=tops,
            text_offset=[int(o) for o in offsets],
        )
    return CompletionChoice(index=index, text=text, logprobs=result), len(generated)


def _check_answer_size(limits, ids: list[list[int]], body: CompletionRequest) -> None:
    """An echoed answer holds each prompt token and its top alternatives: bounded as a score
    answer's scores are (max_scores), or prompts within the length bounds would make an answer
    of hundreds of millions of entries."""
    if not body.echo:
        return
    entries = sum(map(len, ids)) * (1 + (body.logprobs or 0))
    if entries > limits.max_scores:
        raise ValidationError(
            "too_many_scores",
            f"echoing {sum(map(len, ids))} prompt tokens with {body.logprobs or 0} alternatives "
            f"each is {entries} log-probabilities; this server answers at most "
            f"{limits.max_scores} per request (--max-scores)",
            "prompt",
        )


async def complete(service: Service, request: Request, body: CompletionRequest) -> Response:
    """OpenAI's `/v1/completions`, for scoring."""
    from tpuscore.serving.app import JSONResponse

    _refuse_generation(body)
    # The server's deadline and queue bound, as a batcher request keeps them (X-Request-Timeout).
    timeout_s = guards.request_timeout(request.headers, service.batcher.request_timeout_s)
    adapter = service.adapter(body.model)  # an unknown name is model_not_found
    scorer = service.scorer
    prompts = body.prompt
    if isinstance(prompts, str) or (isinstance(prompts, list) and all(map(_is_id, prompts))):
        prompts = [prompts]
    # The request's size as sent, before anything tokenizes it (RequestLimits).
    bounds.check_size(service.limits, items=("prompt", prompts), values={})
    # Under the batcher's bounds beside its requests, until the work's thread ends.
    release = service.batcher.reserve(estimate_tokens(None, prompts))

    def tokenized_and_scored() -> tuple[list[list[int]], list[tuple[CompletionChoice, int]]]:
        """Off the event loop: tokenizing and answering prompts within the bounds takes
        seconds."""
        ids, texts = _prompts(body.prompt, scorer.tokenizer)
        _check_answer_size(service.limits, ids, body)
        scored = scorer.prompt_logprobs(ids, adapter=adapter)
        strings = _Strings(scorer.tokenizer)
        pairs = enumerate(zip(scored, texts, strict=True))
        return ids, [_choice(i, result, text, body, strings) for i, (result, text) in pairs]

    try:
        work = guards.run_held(tokenized_and_scored, release, timeout_s)
        ids, answered = await guards.unless_disconnected(request.receive, work)
    except TimeoutError:  # the work not started is dropped, a running one's answer discarded
        raise DeadlineExceeded(timeout_s) from None
    choices = [choice for choice, _ in answered]
    generated = sum(count for _, count in answered)
    prompt_tokens = sum(map(len, ids))
    response = CompletionResponse(
        id=f"cmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=adapter or service.model_name,
        choices=choices,
        usage=CompletionUsage(
            prompt_tokens=prompt_tokens,
            completion_tokens=generated,
            total_tokens=prompt_tokens + generated,
        ),
    )
    return JSONResponse(response.model_dump())


def register(app: FastAPI, service: Service, route_class, responses) -> str:
    """Add the endpoint to app; returns its path (for the metrics)."""

    async def endpoint(request: Request, body: CompletionRequest) -> Response:
        return await complete(service, request, body)

    app.router.add_api_route(
        PATH,
        endpoint,
        methods=["POST"],
        response_model=CompletionResponse,
        responses=responses,
        route_class_override=route_class,
        summary="OpenAI's completions, for scoring: prompt log-probabilities (docs/completions.md)",
    )
    return PATH
