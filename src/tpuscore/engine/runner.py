"""The engine under the `Scorer` facade: one model, its tokenizer and backends, and the loop that
validates requests, plans them onto backends and runs them.

`Engine` holds what scales with a scorer (the backend pool with its caches, the cost model, the
selector, the default backend), so two scorers in one process share nothing. The facade loads a
model and hands its calls here; the tasks (`tpuscore.tasks`) build on the same methods.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import attrs
import tokenizers

from tpuscore.api import validation
from tpuscore.api.calibration import Calibration
from tpuscore.api.errors import ValidationError
from tpuscore.api.messages import short
from tpuscore.api.requests import (
    LoglikelihoodRequest,
    RequestLimits,
    ScoreOptions,
    ScoreRequest,
)
from tpuscore.api.results import ScoreResult
from tpuscore.backends import registry
from tpuscore.backends.contract import (
    ContinuationScores,
    LoglikelihoodBackend,
    PositionScores,
    PromptLogprobsBackend,
    ShapeLimits,
)
from tpuscore.backends.pool import BackendPool
from tpuscore.engine import (
    calibration,
    executables,
    memory_guard,
    planning,
    selection,
    shapes,
)
from tpuscore.engine.profiles import DeviceProfile
from tpuscore.engine.warmup import DEFAULT_GEOMETRIES, Warmed, warm
from tpuscore.models.config import ModelConfig
from tpuscore.models.loaders import default as default_model
from tpuscore.models.model import Model


class Engine:
    """Validates, plans and runs score requests on one model. Thread-safe.

    Args:
        model: the model on device.
        tokenizer: its tokenizer, or None (token-id inputs only).
        backend: the backend a call runs when it names none; "auto" lets `selector` pick.
        backend_options: backend name -> its options (checked here, not mid-request).
        selector: what "auto" runs for a call's groups (default the cost model; in
            batch-invariant mode `planning.FixedRule`, whose pick never depends on the batch).
        profile: the device profile the cost model prices backends with (default the built-in
            one of this device kind).
        executables_guard: the `executables.Guard` that keeps this engine's compiled
            executables within the process's memory maps and drops only them (default a new
            one: engines never share executables unless they share a guard).
        batch_invariant: a request's scores bit-identical whatever shares its call
            (docs/batch-invariance.md); backends that cannot be so are refused.
        model_name: what a server on it reports and requests name (`loaders.model_name`).
        score_calibration: a `tpuscore fit-calibration` file (or a loaded `Calibration`) fitted
            for this model, refused otherwise, here and when set later; `run`'s results then
            carry `calibrated` where it covers them (docs/calibration.md).
        limits: how large one request may be (`RequestLimits`, or a mapping of the fields to
            change in `LIBRARY_LIMITS`; default `LIBRARY_LIMITS`), checked on every request
            before it is tokenized: past a bound is a `ValidationError` with the server's size
            codes (docs/api.md#size-bounds).
    """

    def __init__(
        self,
        model: Model,
        tokenizer: tokenizers.Tokenizer | None,
        *,
        backend: str = registry.AUTO,
        backend_options: Mapping[str, Mapping[str, Any]] | None = None,
        selector: planning.Selector | None = None,
        profile: DeviceProfile | None = None,
        batch_invariant: bool = False,
        executables_guard: executables.Guard | None = None,
        model_name: str = default_model.NAME,
        score_calibration: Calibration | str | os.PathLike | None = None,
        limits: RequestLimits | Mapping[str, int] | None = None,
    ):
        self.model = model
        self.limits = RequestLimits.of(limits)
        self.model_name = model_name
        self.score_calibration = score_calibration  # checked by its setter
        self.tokenizer = tokenizer
        self.batch_invariant = bool(batch_invariant)
        self.default_backend = self.checked_backend(backend)
        self.cost_model = selection.CostModel(profile, model.platform)
        default_selector = planning.FixedRule() if self.batch_invariant else self.cost_model
        self.selector = selector or default_selector
        self.executables = executables_guard or executables.Guard()
        self.backends = BackendPool(model, backend_options, self.batch_invariant, self.executables)

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def score_calibration(self) -> Calibration | None:
        return self._score_calibration

    @score_calibration.setter
    def score_calibration(self, value: Calibration | str | os.PathLike | None) -> None:
        """Another calibration (or its file's path, or None), refused if not for this model."""
        self._score_calibration = calibration.load(value, self.model)

    def fresh(self) -> Engine:
        """An engine on the same model and settings with new backend instances: empty caches."""
        engine = copy.copy(self)
        engine.backends = self.backends.fresh()
        return engine

    def backend_name(self, backend: str | None) -> str:
        """The registered name a call's `backend` resolves to (None: the default backend)."""
        return self.checked_backend(self.default_backend if backend is None else backend)

    def checked_backend(self, backend: str) -> str:
        """`registry.backend_name`, refusing in batch-invariant mode a backend without it."""
        name = registry.backend_name(backend)
        if name != registry.AUTO:
            registry.check_capabilities(name, False, self.batch_invariant)
        return name

    def prepare(self, query: Any, items: Any, options: ScoreOptions) -> ScoreRequest:
        """One request checked and tokenized (`validation.validate`); raises ValidationError."""
        return validation.validate(query, items, options, self.facts)

    @property
    def facts(self) -> validation.ModelFacts:
        """What validation checks a request against: the tokenizer and the model's limits."""
        config = self.config
        return validation.ModelFacts(
            self.tokenizer,
            config.vocab_size,
            config.max_position_embeddings,
            config.num_labels,
            config.pad_token_id,
            self.model.adapter_names,
            self.limits,
        )

    def prepare_request(
        self, request: Mapping[str, Any], backend: str | None = None
    ) -> ScoreRequest:
        """One request given as a mapping of `Scorer.score`'s arguments, prepared; `backend`
        (default the engine's) checked to be registered and able to run it."""
        query, items, options = validation.request_arguments(request)
        prepared = self.prepare(query, items, options)
        name = self.backend_name(backend)
        if name != registry.AUTO:  # "auto" picks per group, at run time, one that can
            registry.check_capabilities(name, prepared.item_first, adapter=prepared.adapter != 0)
        return prepared

    def prepare_batch(
        self,
        requests: Sequence[Mapping[str, Any]],
        backend: str | None = None,
        errors: Literal["raise", "return"] = "raise",
        prepare: Callable[[Any, str | None], Any] | None = None,
    ) -> list[Any]:
        """Every request prepared, in order, each error located at ("requests", i, ...):
        raised at the first (errors="raise"), or standing in its request's place ("return").
        `prepare(request, backend)` prepares one (default `prepare_request`)."""
        if errors not in ("raise", "return"):
            raise ValueError(f'errors must be "raise" or "return", got {errors!r}')
        prepare = self.prepare_request if prepare is None else prepare
        prepared: list[Any] = []
        for i, request in enumerate(validation.request_list(requests)):
            try:
                prepared.append(prepare(request, backend))
            except ValidationError as e:
                if errors == "raise":
                    raise e.at("requests", i) from None
                prepared.append(e.at("requests", i))
        return prepared

    def run(
        self,
        requests: Sequence[ScoreRequest],
        *,
        backend: str | None = None,
        on_progress: Callable[[int], None] | None = None,
    ) -> list[ScoreResult]:
        """Score prepared requests (calibrated under `score_calibration`): grouped by query,
        labels and item_first, each backend called once with all the groups that picked it.
        Every group's backend is checked before any runs; on_progress, if given, gets the number
        of requests each backend call completes."""
        _check_prepared(requests)
        name = self.backend_name(backend)
        results = [
            ScoreResult.empty(len(r.label_ids), r.apply_softmax, r.classification) for r in requests
        ]
        calls = planning.plan(
            requests, name, self.selector, self.backends, batch_invariant=self.batch_invariant
        )
        if on_progress is not None:
            on_progress(sum(not r.items for r in requests))  # nothing to run for these
        for call in calls:
            outputs = memory_guard.run(call.backend, self.backends.get(call.backend), call.plan)
            if len(outputs) != len(call.groups):
                raise RuntimeError(
                    f"backend {call.backend!r} returned {len(outputs)} outputs for "
                    f"{len(call.groups)} groups"
                )
            for group, output in zip(call.groups, outputs, strict=True):
                split = planning.split(output, group, requests, call.backend)
                for i, result in zip(group.members, split, strict=True):
                    results[i] = result
            if on_progress is not None:
                on_progress(sum(len(g.members) for g in call.groups))
        self.executables.check()
        return calibration.attach(self.score_calibration, requests, results)

    def plan(self, request: ScoreRequest) -> selection.Plan:
        """Every built-in backend's estimate for the request, and the pick "auto" would make
        (the user's selector's, when one was given; the cost model estimates either way)."""
        batches = [g.batch for g in planning.group([request])]
        plan = self.cost_model.plan(batches, self.backends)
        if self.selector is not self.cost_model:
            pick = planning.picked(self.selector.select(batches, self.backends))
            plan = attrs.evolve(plan, pick=pick)
        return plan

    def loglikelihood(self, request: LoglikelihoodRequest) -> list[ContinuationScores]:
        """Each continuation's token log-probabilities after the context, on the backend with
        loglikelihood plans (`Capabilities.loglikelihood`), under the memory guard."""
        name = registry.loglikelihood_backend()
        backend: LoglikelihoodBackend = self.backends.get(name)
        plan = backend.plan_loglikelihood(
            request.context, request.continuations, adapter=request.adapter
        )
        scores = memory_guard.run(name, backend, plan)
        self.executables.check()
        return scores

    def prompt_logprobs(
        self,
        extensions: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]],
        adapter: int = 0,
    ) -> list[list[PositionScores]]:
        """Per (context, continuations) pair, each continuation's token log-probabilities and
        the most likely tokens at each of its positions and the one after it, each context run
        once, on the backend with loglikelihood plans (its prompt log-probabilities plans),
        under the memory guard; all under LoRA adapter `adapter` (0: none)."""
        name = registry.loglikelihood_backend()
        backend: PromptLogprobsBackend = self.backends.get(name)
        plan = backend.plan_prompt_logprobs(extensions, adapter=adapter)
        scores = memory_guard.run(name, backend, plan)
        self.executables.check()
        return scores

    def warmup(
        self,
        geometries: Sequence[Sequence[int]] | None,
        backends: Sequence[str] | None,
        all: bool = False,  # noqa: A002 (the public keyword: warmup(all=True))
        limits: ShapeLimits | Mapping[str, int] | None = None,
    ) -> list[Warmed]:
        """`Scorer.warmup`: compile the steps of these geometries on these backends (default
        `DEFAULT_GEOMETRIES` on the default backend), or with all=True their whole shape set
        within `limits` (`shapes`)."""
        if all:
            if geometries is not None:
                raise ValidationError(
                    "invalid_geometry",
                    "warmup(all=True) compiles the whole shape set; give geometries or all=True",
                    "geometries",
                )
            return shapes.warm_all(self.backends, self.shapes(limits, backends))
        names = [self.checked_backend(b) for b in backends or [self.default_backend]]
        geometries = DEFAULT_GEOMETRIES if geometries is None else geometries
        return warm(self.backends, self.prepare, self.selector, names, geometries, self.limits)

    def shapes(
        self,
        limits: ShapeLimits | Mapping[str, int] | None,
        backends: Sequence[str] | None,
    ) -> list[shapes.StepShape]:
        """`Scorer.shapes`: the shape set of these backends (default the default backend; auto:
        every backend it may pick) for requests within `limits` (`shapes.limits_for`)."""
        names = []
        for backend in backends or [self.default_backend]:
            checked = self.checked_backend(backend)
            for name in shapes.backends_for(checked, self.selector, self.model.platform):
                if name not in names:
                    names.append(name)
        return shapes.shape_set(self.backends, names, shapes.limits_for(self.config, limits))


def _check_prepared(requests: Any) -> None:
    """`run` takes what `prepare` made: anything else (a mapping of `score`'s arguments, a
    result) is refused by position, not met later as an AttributeError."""
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence):
        raise ValidationError(
            "invalid_argument",
            f"requests must be a list of prepared requests, got {short(requests)}",
            "requests",
        )
    for i, request in enumerate(requests):
        if not isinstance(request, ScoreRequest):
            raise ValidationError(
                "invalid_argument",
                f"requests[{i}] must be a ScoreRequest (from prepare or prepare_request), got "
                f"{short(request)}; score_batch takes mappings of score's arguments",
                f"requests[{i}]",
            )
