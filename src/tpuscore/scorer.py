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
from tpuscore.api.requests import ScoreOptions, ScoreRequest
from tpuscore.api.results import ScoreResult
from tpuscore.api.templates import Template
from tpuscore.backends import registry
from tpuscore.engine import building, executables, planning, progress, selection
from tpuscore.engine.profiles import DeviceProfile
from tpuscore.engine.shapes import Limits, StepShape
from tpuscore.engine.warmup import Warmed
from tpuscore.models.adapters import LoraAdapter
from tpuscore.models.config import ModelConfig
from tpuscore.models.loaders import orbax
from tpuscore.models.weights import Params
from tpuscore.tasks import calibrated, loglikelihood, prompt_logprobs
from tpuscore.tasks import chunking as chunked
from tpuscore.tasks.chunking import ChunkedResult, RankedDocument
from tpuscore.tasks.loglikelihood import LoglikelihoodResult
from tpuscore.tasks.prompt_logprobs import PromptLogprobs
from tpuscore.tasks.ranking import RankedItem

Query, Items = str | list[int], list[str] | list[list[int]]
Adapters = Mapping[str, "str | os.PathLike | LoraAdapter"]
BackendOptions, Profile = Mapping[str, Mapping[str, Any]], DeviceProfile | str | os.PathLike


class Scorer:
    """Scores items against a query with a decoder-only LM: log P(label | query + item). Build
    one with `from_pretrained` and reuse it (it keeps compiled shapes and caches). Thread-safe."""

    def __init__(
        self, config: ModelConfig, params: Params, tokenizer: tokenizers.Tokenizer | None, *,
        dtype: Any = None, backend: str = registry.AUTO,
        backend_options: BackendOptions | None = None, selector: planning.Selector | None = None,
        profile: Profile | None = None, mesh: jax.sharding.Mesh | None = None,
        devices: Sequence[jax.Device] | None = None, batch_invariant: bool = False,
        executables_guard: executables.Guard | None = None, adapters: Adapters | None = None,
    ):  # fmt: skip
        """A scorer on a config, a parameter tree and a tokenizer (None: token ids only); the
        other arguments as `from_pretrained`'s, selector and executables_guard as `Engine`'s."""
        self.engine = building.build(
            config, params, tokenizer, dtype=dtype, mesh=mesh, devices=devices,
            adapters=adapters, profile=profile, backend=backend, backend_options=backend_options,
            selector=selector, batch_invariant=batch_invariant,
            executables_guard=executables_guard,
        )  # fmt: skip
        self.score_calibration = None  # a `Calibration`: see from_pretrained

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
    ) -> Scorer:  # fmt: skip
        """A scorer on a Hugging Face directory or hub id, a .gguf file, a `save` directory or
        None (the embedded SmolLM2-135M-Instruct); docs/api.md lists the arguments and errors.
        adapters: name -> PEFT LoRA adapter directory, loaded and stacked once; a request picks
        one with `adapter="name"` (docs/adapters.md)."""
        config, params, tokenizer = building.load(
            model, dtype=dtype, mesh=mesh, devices=devices,
            compilation_cache_dir=compilation_cache_dir, revision=revision,
            local_files_only=local_files_only, cache_dir=cache_dir,
        )  # fmt: skip
        scorer = cls(
            config, params, tokenizer, dtype=dtype, backend=backend, adapters=adapters,
            backend_options=backend_options, profile=profile, mesh=mesh, devices=devices,
            batch_invariant=batch_invariant, executables_guard=executables_guard,
        )  # fmt: skip
        if score_calibration is not None:  # docs/calibration.md
            scorer.score_calibration = calibrated.load(score_calibration, scorer.engine)
        return scorer

    def save(self, path: str | os.PathLike) -> None:
        """Write an Orbax checkpoint that `from_pretrained(path)` restores exactly."""
        orbax.save(path, self.config, self.params, self.tokenizer)

    def score(
        self, query: Query, items: Items, label_token_ids: list[int] | None = None, *,
        backend: str | None = None, chunking: Chunking | Mapping[str, Any] | None = None,
        **options: Any,
    ) -> ScoreResult | ChunkedResult:  # fmt: skip
        """log P(label | query + item) after each item, a `ScoreResult` (with chunking, a
        `ChunkedResult`); options: `ScoreOptions`. Bad input raises ValidationError before
        anything runs. docs/api.md has every argument."""
        if chunking is not None:
            options = ScoreOptions.from_mapping({"label_token_ids": label_token_ids, **options})
            return chunked.score(self.engine, query, items, chunking, options, backend=backend)
        request = self.prepare(query, items, label_token_ids, **options)
        return self.run([request], backend=backend)[0]

    def prepare(
        self, query: Query, items: Items, label_token_ids: list[int] | None = None, **options: Any
    ) -> ScoreRequest:
        """Validate one request (`score`'s arguments but backend) and tokenize it for `run`."""
        options = ScoreOptions.from_mapping({"label_token_ids": label_token_ids, **options})
        return self.engine.prepare(query, items, options)

    def run(
        self, requests: Sequence[ScoreRequest], *, backend: str | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> list[ScoreResult]:  # fmt: skip
        """Score prepared requests together; requests sharing a query, labels and item_first
        share its work. on_progress gets the requests each backend call completes."""
        results = self.engine.run(requests, backend=backend, on_progress=on_progress)
        return calibrated.attach(self.score_calibration, requests, results)

    def score_batch(
        self, requests: Sequence[Mapping[str, Any]], *, backend: str | None = None,
        show_progress: bool = False,
    ) -> list[ScoreResult]:  # fmt: skip
        """One result per request (a mapping of `score`'s arguments), in order. All are checked
        before any runs ("requests[3].items" names the culprit); they share device steps."""
        prepared = self.prepare_batch(requests, backend=backend)
        with progress.bar(len(prepared), "request", enabled=show_progress) as advance:
            return self.run(prepared, backend=backend, on_progress=advance)

    def prepare_request(
        self, request: Mapping[str, Any], *, backend: str | None = None
    ) -> ScoreRequest:
        """One request as a mapping of `score`'s arguments, prepared for `run` on `backend`."""
        return self.engine.prepare_request(request, backend)

    def prepare_batch(
        self, requests: Sequence[Mapping[str, Any]], *, backend: str | None = None,
        errors: Literal["raise", "return"] = "raise",
    ) -> list[ScoreRequest | ValidationError]:  # fmt: skip
        """Every request prepared, in order: errors="raise" raises the first bad one's error,
        located at ("requests", i, ...); "return" puts it in its request's place."""
        return self.engine.prepare_batch(requests, backend, errors)

    def validate_batch(
        self, requests: Sequence[Mapping[str, Any]], *, backend: str | None = None
    ) -> list[ValidationError | None]:
        """Per request, its located ValidationError or None if `score_batch` takes it."""
        return self.engine.validate_batch(requests, backend)

    def plan(
        self, query: Query, items: Items, label_token_ids: list[int] | None = None, *,
        backend: str | None = None, **options: Any,
    ) -> selection.Plan:  # fmt: skip
        """What `score` would run, without running: every built-in backend's estimate, and
        `pick`, the one "auto" takes (backend is ignored: every candidate is estimated)."""
        return self.engine.plan(self.prepare(query, items, label_token_ids, **options))

    def rank(
        self, query: Query, items: Items, *, positive: int | None = None, top_k: int | None = None,
        template: str | Template | None = None, instruction: str | None = None,
        backend: str | None = None, show_progress: bool = False,
        chunking: Chunking | Mapping[str, Any] | None = None, **options: Any,
    ) -> list[RankedItem] | list[RankedDocument]:  # fmt: skip
        """The items best first by the positive label's probability within the labels (or a
        template's; on a classifier, the relevant class's), ties in input order; with chunking,
        documents by their chunks (docs/chunking.md). docs/api.md has every argument."""
        return chunked.rank_items(
            self.engine, query, items, chunking, ScoreOptions.from_mapping(options),
            positive=positive, top_k=top_k, template=template, instruction=instruction,
            backend=backend, show_progress=show_progress,
        )  # fmt: skip

    def loglikelihood(
        self, context: Query, continuations: Items, *, backend: str | None = None
    ) -> list[LoglikelihoodResult]:
        """log P(continuation | context) per continuation, as lm-evaluation-harness scores it."""
        return loglikelihood.loglikelihood(self.engine, context, continuations, backend=backend)

    def prompt_logprobs(self, prompts: Sequence[Sequence[int]]) -> list[PromptLogprobs]:
        """Per prompt (token ids), every token's log-probability and the most likely tokens at
        each position (OpenAI's completions echo, docs/completions.md)."""
        return prompt_logprobs.prompt_logprobs(self.engine, prompts)

    def warmup(
        self, geometries: Sequence[Sequence[int]] | None = None, *,
        backends: Sequence[str] | None = None, all: bool = False, limits: Limits | None = None,  # noqa: A002
    ) -> list[Warmed]:  # fmt: skip
        """Compile ahead of time the steps of (query_tokens, num_items, item_tokens) geometries,
        or with all=True every shape of `shapes(limits)`: then nothing within them compiles."""
        return self.engine.warmup(geometries, backends, all, limits)

    def shapes(
        self, limits: Limits | None = None, *, backends: Sequence[str] | None = None
    ) -> list[StepShape]:
        """Every step shape the backends (default the scorer's; auto: all it may pick) can
        compile for requests within `limits` (query_tokens, item_tokens, labels), uncompiled."""
        return self.engine.shapes(limits, backends)

    def get_backend(self, name: str) -> registry.Backend:  # built on first use
        return self.engine.backends.get(name)

    config = property(lambda self: self.engine.model.config, doc="The model's `ModelConfig`.")
    adapters = property(
        lambda self: list(self.engine.model.adapter_names),
        doc="The names of the LoRA adapters a request may name (`adapter=`), in load order.",
    )
    params = property(lambda self: self.engine.model.weights, doc="The parameters on device.")
    dtype = property(lambda self: self.engine.model.dtype, doc="Attention's and K/V's dtype.")
    mesh = property(lambda self: self.engine.model.layout.mesh, doc="The mesh, or None.")
    tokenizer = property(lambda self: self.engine.tokenizer, doc="The tokenizer, or None.")
    backends = property(lambda self: self.engine.backends, doc="The `BackendPool`.")
    cost_model = property(lambda self: self.engine.cost_model, doc="auto's `CostModel`.")
