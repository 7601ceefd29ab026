"""The `Scorer` facade: load a model, then prepare, plan and run its requests on an `Engine`.

A request's options are `ScoreOptions`' fields, by keyword; docs/api.md describes every argument."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
import tokenizers

from tpuscore.api.chunking import Chunking
from tpuscore.api.errors import ValidationError
from tpuscore.api.requests import RequestLimits, ScoreOptions, ScoreRequest
from tpuscore.api.results import ScoreResult
from tpuscore.api.templates import Template
from tpuscore.backends import registry
from tpuscore.engine import building, executables, selection
from tpuscore.engine.building import Adapters, BackendOptions, Profile
from tpuscore.engine.shapes import Limits, StepShape
from tpuscore.engine.view import EngineView
from tpuscore.engine.warmup import Warmed
from tpuscore.models.config import ModelConfig
from tpuscore.models.weights import Params
from tpuscore.tasks import chunking as chunked
from tpuscore.tasks import loglikelihood, prompt_logprobs, scoring
from tpuscore.tasks.chunking import ChunkedRequest, ChunkedResult, RankedDocument
from tpuscore.tasks.loglikelihood import LoglikelihoodResult
from tpuscore.tasks.prompt_logprobs import PromptLogprobs
from tpuscore.tasks.ranking import RankedItem

Query, Items = str | list[int], list[str] | list[list[int]]


class Scorer(EngineView):
    """Scores items against a query with a decoder-only LM: log P(label | query + item). Build
    one with `from_pretrained` and reuse it (it keeps compiled shapes and caches). Thread-safe.
    Its engine's attributes (config, params, tokenizer, limits, ...) are `EngineView`'s."""

    def __init__(self, config: ModelConfig, params: Params,
                 tokenizer: tokenizers.Tokenizer | None, **options: Any):  # fmt: skip
        """A scorer on a config, a parameter tree and a tokenizer (None: token ids only); the
        options as `from_pretrained`'s (but the loader's), and `Engine`'s selector."""
        self.engine = building.build(config, params, tokenizer, **options)

    @classmethod
    def from_pretrained(
        cls, model: str | os.PathLike | None = None, *, dtype: Any = None,
        backend: str = registry.AUTO, backend_options: BackendOptions | None = None,
        revision: str | None = None, local_files_only: bool = False,
        cache_dir: str | os.PathLike | None = None,
        compilation_cache_dir: str | os.PathLike | None = None, profile: Profile | None = None,
        mesh: jax.sharding.Mesh | None = None, devices: Sequence[jax.Device] | None = None,
        batch_invariant: bool = False, score_calibration: str | os.PathLike | None = None,
        executables_guard: executables.Guard | None = None, adapters: Adapters | None = None,
        limits: RequestLimits | Mapping[str, int] | None = None,
    ) -> Scorer:  # fmt: skip
        """A scorer on a Hugging Face directory or hub id, a .gguf file, a `save` directory or
        None (the embedded SmolLM2-135M-Instruct); docs/api.md lists the arguments and errors."""
        scorer = cls.__new__(cls)  # on an engine built from the checkpoint, not from params
        scorer.engine = building.from_checkpoint(
            model, dtype=dtype, backend=backend, backend_options=backend_options,
            revision=revision, local_files_only=local_files_only, cache_dir=cache_dir,
            compilation_cache_dir=compilation_cache_dir, profile=profile, mesh=mesh,
            devices=devices, batch_invariant=batch_invariant, score_calibration=score_calibration,
            executables_guard=executables_guard, adapters=adapters, limits=limits,
        )  # fmt: skip
        return scorer

    def save(self, path: str | os.PathLike) -> None:
        """Write an Orbax checkpoint that `from_pretrained(path)` restores exactly."""
        building.save(self.engine, path)

    def score(
        self, query: Query, items: Items, label_token_ids: list[int] | None = None, *,
        backend: str | None = None, chunking: Chunking | Mapping[str, Any] | None = None,
        **options: Any,
    ) -> ScoreResult | ChunkedResult:  # fmt: skip
        """log P(label | query + item) after each item (with chunking, per document); options:
        `ScoreOptions`. Bad input raises ValidationError before anything runs."""
        options = ScoreOptions.from_mapping({"label_token_ids": label_token_ids, **options})
        return scoring.score_items(self.engine, query, items, chunking, options, backend=backend)

    def prepare(
        self, query: Query, items: Items, label_token_ids: list[int] | None = None, *,
        chunking: Chunking | Mapping[str, Any] | None = None, **options: Any,
    ) -> ScoreRequest | ChunkedRequest:  # fmt: skip
        """Validate one request (`score`'s arguments but backend) and tokenize it for `run`;
        with chunking, its items' chunks (a `ChunkedRequest`, which `run` reads back whole)."""
        options = ScoreOptions.from_mapping({"label_token_ids": label_token_ids, **options})
        return chunked.prepare_items(self.engine, query, items, chunking, options)

    def run(
        self, requests: Sequence[ScoreRequest | ChunkedRequest], *, backend: str | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> list[ScoreResult | ChunkedResult]:  # fmt: skip
        """Score prepared requests together (those sharing a query share its work), a chunked
        one read back as its documents'; on_progress gets the requests each backend call
        completes."""
        return scoring.run(self.engine, requests, backend=backend, on_progress=on_progress)

    def score_batch(
        self, requests: Sequence[Mapping[str, Any]], *, backend: str | None = None,
        show_progress: bool = False,
    ) -> list[ScoreResult | ChunkedResult]:  # fmt: skip
        """One result per request (a mapping of `score`'s arguments, `chunking` too), all
        checked first, run together."""
        return scoring.score_batch(self.engine, requests, backend=backend,
                                   show_progress=show_progress)  # fmt: skip

    def prepare_request(self, request: Mapping[str, Any], *, backend: str | None = None
                        ) -> ScoreRequest | ChunkedRequest:  # fmt: skip
        """One request as a mapping of `score`'s arguments (`chunking` too), prepared for `run`
        on `backend`."""
        return scoring.prepare_request(self.engine, request, backend)

    def prepare_batch(
        self, requests: Sequence[Mapping[str, Any]], *, backend: str | None = None,
        errors: Literal["raise", "return"] = "raise",
    ) -> list[ScoreRequest | ChunkedRequest | ValidationError]:  # fmt: skip
        """Every request prepared, in order; a bad one's located error raised, or in its place."""
        return scoring.prepare_batch(self.engine, requests, backend, errors)

    def validate_batch(self, requests: Sequence[Mapping[str, Any]], *, backend: str | None = None
                       ) -> list[ValidationError | None]:  # fmt: skip
        """Per request, its located ValidationError or None if `score_batch` takes it."""
        return scoring.validate_batch(self.engine, requests, backend)

    def plan(
        self, query: Query, items: Items, label_token_ids: list[int] | None = None, *,
        backend: str | None = None, chunking: Chunking | Mapping[str, Any] | None = None,
        **options: Any,
    ) -> selection.Plan:  # fmt: skip
        """Every built-in backend's estimate for `score`'s call and `pick`, the one "auto" takes
        (with chunking, for the request of its chunks)."""
        options = ScoreOptions.from_mapping({"label_token_ids": label_token_ids, **options})
        return scoring.plan_items(self.engine, query, items, chunking, options)

    def rank(
        self, query: Query, items: Items, *, positive: int | None = None, top_k: int | None = None,
        template: str | Template | None = None, instruction: str | None = None,
        backend: str | None = None, show_progress: bool = False,
        chunking: Chunking | Mapping[str, Any] | None = None, **options: Any,
    ) -> list[RankedItem] | list[RankedDocument]:  # fmt: skip
        """The items best first by the positive label's probability within the labels (on a
        classifier, the relevant class's), ties in input order; with chunking, documents."""
        return chunked.rank_items(
            self.engine, query, items, chunking, ScoreOptions.from_mapping(options),
            positive=positive, top_k=top_k, template=template, instruction=instruction,
            backend=backend, show_progress=show_progress,
        )  # fmt: skip

    def loglikelihood(
        self, context: Query, continuations: Items, *, backend: str | None = None,
        adapter: str | None = None,
    ) -> list[LoglikelihoodResult]:  # fmt: skip
        """log P(continuation | context) per continuation, as lm-evaluation-harness scores it;
        `adapter`: one of the scorer's LoRA adapters, as `score` takes it."""
        return loglikelihood.loglikelihood(self.engine, context, continuations, backend=backend,
                                           adapter=adapter)  # fmt: skip

    def prompt_logprobs(self, prompts: Sequence[Sequence[int]], *, adapter: str | None = None
                        ) -> list[PromptLogprobs]:  # fmt: skip
        """Per prompt (token ids), each token's logprob and the top tokens (docs/completions.md);
        `adapter`: one of the scorer's LoRA adapters, as `score` takes it."""
        return prompt_logprobs.prompt_logprobs(self.engine, prompts, adapter)

    def warmup(
        self, geometries: Sequence[Sequence[int]] | None = None, *,
        backends: Sequence[str] | None = None, all: bool = False, limits: Limits | None = None,  # noqa: A002
    ) -> list[Warmed]:  # fmt: skip
        """Compile the steps of (query_tokens, num_items, item_tokens) or all `shapes(limits)`."""
        return self.engine.warmup(geometries, backends, all, limits)

    def shapes(self, limits: Limits | None = None, *, backends: Sequence[str] | None = None
               ) -> list[StepShape]:  # fmt: skip
        """Every step shape the backends (default: the scorer's) compile for requests in limits."""
        return self.engine.shapes(limits, backends)
