"""Backends by name. Each registration holds a factory, its options class and its capabilities.

A factory is called as `factory(model, options)`: `model` is a `tpuscore.models.model.Model`,
`options` an instance of the options class given at registration (a frozen dataclass that
validates itself), or None for a backend registered without one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from tpuscore.api.errors import ValidationError
from tpuscore.backends.contract import Backend, BackendOutput, ScoreBatch, missing_members

AUTO = "auto"
PLATFORMS = frozenset({"cpu", "gpu", "tpu"})  # as jax.default_backend() names them


def score_groups(backend: Backend, batches: Sequence[ScoreBatch]) -> list[BackendOutput]:
    """Plan and run several groups on one backend, checking it returns one output per group."""
    outputs = list(backend.run(backend.plan(batches)))
    if len(outputs) != len(batches):
        raise RuntimeError(f"run returned {len(outputs)} outputs for {len(batches)} batches")
    return outputs


BackendFactory = Callable[[Any, Any], Backend]


@attrs.frozen
class Capabilities:
    """What a backend can do. item_first: it can score items placed before the query.
    compiled_on: the platforms where it runs compiled code; elsewhere it runs in Pallas interpret
    mode (right, but slow, and never picked by auto). auto: "auto" may pick it, pricing its plan
    (`price`) against the other candidates'. batch_invariant: it can run in batch-invariant mode
    (`Scorer(batch_invariant=True)`), where a request's scores are bit-identical whatever shares
    its call; if its options class has a `batch_invariant` field, the pool sets it in that mode.
    fixed_rule: the item_first values for which `planning.FixedRule` (auto's rule in
    batch-invariant mode) picks it. fallback: auto's pick where no candidate fits its budget,
    and for item_first requests. loglikelihood: it has loglikelihood plans
    (`contract.LoglikelihoodBackend`), which `Scorer.loglikelihood` runs. adapters: it runs
    each row under its batch's LoRA adapter (`ScoreBatch.adapter`, `Model.row_adapters`); a
    backend without it is never handed a batch with one (`check_capabilities`, auto)."""

    item_first: bool = True
    compiled_on: frozenset[str] = PLATFORMS
    auto: bool = False
    batch_invariant: bool = False
    fixed_rule: frozenset[bool] = frozenset()
    fallback: bool = False
    loglikelihood: bool = False
    adapters: bool = False

    def compiled(self, platform: str) -> bool:
        return platform in self.compiled_on


@attrs.frozen
class Registration:
    name: str
    factory: BackendFactory
    options: type | None
    capabilities: Capabilities


_REGISTRY: dict[str, Registration] = {}


def register(
    name: str,
    factory: BackendFactory,
    *,
    options: type | None = None,
    item_first: bool = True,
    compiled_on: frozenset[str] | set[str] = PLATFORMS,
    auto: bool = False,
    batch_invariant: bool = False,
    fixed_rule: frozenset[bool] | set[bool] = frozenset(),
    fallback: bool = False,
    loglikelihood: bool = False,
    adapters: bool = False,
) -> None:
    """Make `factory` selectable as `backend=name`; registering a name again replaces it.

    Args:
        name: the backend's name; any non-empty string but "auto".
        factory: called as `factory(model, options)`, returns a `contract.Backend`. A class
            is checked here and refused (TypeError naming what is missing) unless it has every
            member of the protocol; another callable's result is checked when first built.
            A backend of `score(batch)` alone subclasses `base.PerGroupBackend`.
        options: a frozen dataclass of the backend's options (keyword-only fields, None meaning
            the default), built from `Scorer(backend_options={name: {...}})`; None if it has none.
        item_first: whether it can score `item_first=True` requests; if not, they are refused
            with `ValidationError(code="unsupported_option")` before they reach it.
        compiled_on: platforms ("cpu", "gpu", "tpu") where it runs compiled code.
        auto: whether "auto" may pick it, by the price of its plan (`price(plan)`) against its
            `peak_budget`, which `engine/selection.py` compares with the other candidates'.
        batch_invariant: whether it can run in batch-invariant mode (`Capabilities`); if not,
            a scorer in that mode refuses it (`ValidationError`, "batch_invariant_unsupported").
        fixed_rule, fallback, loglikelihood: `Capabilities`' (the built-in backends' roles in
            auto's rules, and the one that runs `Scorer.loglikelihood`).
        adapters: whether it runs requests with a LoRA adapter (`Capabilities.adapters`); if
            not, they are refused with `ValidationError(code="adapter_unsupported")`.

    Raises:
        ValueError: a bad name, options class or platform. TypeError: a factory that is not
            callable.
    """
    if not isinstance(name, str) or not name or name == AUTO:
        raise ValueError(
            f"backend name must be a non-empty string other than {AUTO!r}, got {name!r}"
        )
    if not callable(factory):
        raise TypeError(f"factory for backend {name!r} must be callable, got {factory!r}")
    if isinstance(factory, type):
        check_protocol(name, factory)
    if options is not None and not dataclasses.is_dataclass(options):
        raise ValueError(f"options for backend {name!r} must be a dataclass, got {options!r}")
    if not set(compiled_on) <= PLATFORMS:
        raise ValueError(f"compiled_on must be a subset of {sorted(PLATFORMS)}, got {compiled_on}")
    capabilities = Capabilities(
        bool(item_first),
        frozenset(compiled_on),
        bool(auto),
        bool(batch_invariant),
        frozenset(bool(x) for x in fixed_rule),
        bool(fallback),
        bool(loglikelihood),
        bool(adapters),
    )
    _REGISTRY[name] = Registration(name, factory, options, capabilities)


def check_protocol(name: str, backend: type | object) -> None:
    """TypeError naming the `contract.Backend` members a backend class or instance lacks."""
    missing = missing_members(backend)
    if missing:
        raise TypeError(
            f"backend {name!r} ({getattr(backend, '__name__', type(backend).__name__)}) lacks "
            f"{', '.join(missing)} of the backend protocol (tpuscore.backends.contract.Backend); "
            "a backend written as score(batch) alone subclasses "
            "tpuscore.backends.base.PerGroupBackend"
        )


def fixed_rule(item_first: bool) -> str:
    """The backend `planning.FixedRule` picks for requests with this item_first."""
    return next(n for n, r in _REGISTRY.items() if item_first in r.capabilities.fixed_rule)


def fallback() -> str:
    """auto's pick where nothing fits, and for item_first requests."""
    return next(n for n, r in _REGISTRY.items() if r.capabilities.fallback)


def loglikelihood_backend() -> str:
    """The backend that runs `Scorer.loglikelihood` (`Capabilities.loglikelihood`)."""
    return next(n for n, r in _REGISTRY.items() if r.capabilities.loglikelihood)


def available() -> list[str]:
    """Registered backend names, sorted."""
    return sorted(_REGISTRY)


def registration(name: str) -> Registration:
    return _REGISTRY[name]


def candidates() -> list[str]:
    """The backends "auto" may pick, in registration order (which breaks ties in time)."""
    return [name for name, reg in _REGISTRY.items() if reg.capabilities.auto]


def backend_name(name: Any) -> str:
    """A registered backend's name, or "auto"."""
    if name != AUTO and name not in available():
        raise ValidationError(
            "unknown_backend",
            f"backend {name!r} is not registered; available: {', '.join([AUTO, *available()])}",
            "backend",
        )
    return name


def adapter_backends() -> list[str]:
    """The backends that run requests with a LoRA adapter."""
    return [n for n, r in _REGISTRY.items() if r.capabilities.adapters]


def check_capabilities(
    name: str, item_first: bool, batch_invariant: bool = False, adapter: bool = False
) -> None:
    """Refuse a request the backend cannot score (in batch-invariant mode, if it has none;
    adapter: the request runs under a LoRA adapter)."""
    if adapter and not registration(name).capabilities.adapters:
        raise ValidationError(
            "adapter_unsupported",
            f"backend {name!r} does not run LoRA adapters; use one of "
            f"{', '.join([AUTO, *adapter_backends()])}, or no adapter",
            "backend",
        )
    if batch_invariant and not registration(name).capabilities.batch_invariant:
        supported = [n for n in available() if registration(n).capabilities.batch_invariant]
        raise ValidationError(
            "batch_invariant_unsupported",
            f"backend {name!r} cannot make a request's scores independent of what shares its "
            f"device steps, which batch_invariant=True requires; use one of "
            f"{', '.join([AUTO, *supported])}",
            "backend",
        )
    if item_first and not registration(name).capabilities.item_first:
        raise ValidationError(
            "unsupported_option",
            f"backend {name!r} runs the query once as a prefix shared by all items, "
            "so it cannot put items first; use backend='serial' or 'auto'",
            "item_first",
        )


def backend_options(name: Any, options: Any) -> Any:
    """The options instance for backend `name` from a mapping of its option names to values."""
    where = f"backend_options.{name}"
    if name == AUTO or name not in available():
        raise ValidationError(
            "unknown_backend",
            f"backend_options names unknown backend {name!r}; available: {', '.join(available())}",
            "backend_options",
        )
    if not isinstance(options, Mapping):
        raise ValidationError(
            "invalid_backend_option", f"{where} must be a mapping, got {options!r}", where
        )
    cls = registration(name).options
    allowed = [f.name for f in dataclasses.fields(cls)] if cls is not None else []
    unknown = sorted(set(options) - set(allowed), key=str)
    if unknown:
        raise ValidationError(
            "invalid_backend_option",
            f"{where}: unknown option(s) {unknown}; {name} takes "
            f"{', '.join(allowed) if allowed else 'no options'}",
            f"{where}.{unknown[0]}",
        )
    if cls is None:
        return None
    try:
        return cls(**options)
    except ValidationError as e:
        raise e.within(where) from None
