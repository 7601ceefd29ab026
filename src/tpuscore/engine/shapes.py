"""The shape set: every device-step shape a scorer can compile for requests within its limits.

XLA compiles once per input shape. Each backend pads every step onto a small lattice of its own
(`shapes(limits)` beside `schedule`; docs/serving.md, "Compiled shapes"), so the executables a
scorer can ever build are a finite list, known without compiling: `shape_set` lists it for the
backends a call may run ("auto": every candidate auto may pick here), and `warm_all` compiles
exactly that list, each shape by running its jitted step once on zeros. After it, no request
within the limits compiles anything.

The limits: query tokens, item tokens (each default, and at most, the model's
max_position_embeddings) and labels per request (default 16, one label bucket; a classifier's
class count if larger). Items per step come from each backend's budget and options, and requests
per call are free.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

import attrs
import jax

from tpuscore.api.errors import ValidationError
from tpuscore.backends import contract, registry
from tpuscore.backends.buckets import MIN_LABEL_BUCKET
from tpuscore.backends.contract import ShapeLimits, StepShape
from tpuscore.backends.pool import BackendPool
from tpuscore.engine import planning
from tpuscore.engine.warmup import Warmed
from tpuscore.models.config import ModelConfig

logger = logging.getLogger(__name__)

LIMIT_FIELDS = ("query_tokens", "item_tokens", "labels")
Limits = ShapeLimits | Mapping[str, int]  # a mapping: some of the fields, the rest defaults


def limits_for(config: ModelConfig, limits: Limits | None) -> ShapeLimits:
    """The limits a shape set covers: `limits` (a `ShapeLimits`, or a mapping of some of its
    fields), the rest the model's defaults (module doc). ValidationError("invalid_limits")
    names a bad field."""
    if isinstance(limits, ShapeLimits):
        limits = attrs.asdict(limits)
    limits = dict(limits or {})
    unknown = sorted(set(limits) - set(LIMIT_FIELDS), key=str)
    if unknown:
        raise ValidationError(
            "invalid_limits",
            f"unknown limit(s) {unknown}; limits are {', '.join(LIMIT_FIELDS)}",
            f"limits.{unknown[0]}",
        )
    defaults = {
        "query_tokens": config.max_position_embeddings,
        "item_tokens": config.max_position_embeddings,
        "labels": max(MIN_LABEL_BUCKET, config.num_labels or 0),
    }
    values = {**defaults, **{k: v for k, v in limits.items() if v is not None}}
    for name, value in values.items():
        minimum = 1 if name == "labels" else 0
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValidationError(
                "invalid_limits", f"{name} must be an int >= {minimum}, got {value!r}", name
            )
    # No request is longer than the model's positions, so no step shape past them exists; the
    # buckets up to 10**12 tokens took hours to list.
    for name in ("query_tokens", "item_tokens"):
        values[name] = min(values[name], config.max_position_embeddings)
    return ShapeLimits(**values)


def backends_for(name: str, selector: planning.Selector, platform: str) -> list[str]:
    """The backends a call on `name` may run: itself, or for "auto" what the selector may pick
    (`FixedRule`: prefill_extend and serial; otherwise every candidate compiled here)."""
    if name != registry.AUTO:
        return [name]
    if isinstance(selector, planning.FixedRule):
        return [registry.fixed_rule(False), registry.fixed_rule(True)]
    return [
        n for n in registry.candidates() if registry.registration(n).capabilities.compiled(platform)
    ]


def shape_set(pool: BackendPool, names: Sequence[str], limits: ShapeLimits) -> list[StepShape]:
    """The shapes of these backends for requests within `limits`, sorted by backend, step and
    shape. A backend with no compiled step (reference: numpy) has none."""
    out = set()
    for name in names:
        out.update(attrs.evolve(s, backend=name) for s in pool.get(name).shapes(limits))
    return sorted(out, key=StepShape.sort_key)


def warm_all(pool: BackendPool, shapes: Sequence[StepShape]) -> list[Warmed]:
    """Compile every shape, each by running its step once on zeros; one `Warmed` per backend
    (geometry None, steps: its shapes), logged. Every `warmup_probe` shapes of the pool's
    `executables.Guard`, ValidationError ("shape_set_too_large") if the whole set's executables
    would not fit in the memory maps the process may hold; the backend with the most shapes goes
    first, so the first probe measures the executables that dominate the set."""
    by_backend: dict[str, list[StepShape]] = {}
    for shape in shapes:
        by_backend.setdefault(shape.backend, []).append(shape)
    guard = pool.guard
    maps_before, done = guard.map_count(), 0
    warmed = []
    for name, own in sorted(by_backend.items(), key=lambda named: -len(named[1])):
        table = pool.get(name).steps
        start = time.perf_counter()
        for shape in own:
            contract.warm(table, shape)
            done += 1
            if done % guard.warmup_probe == 0:
                guard.check_warmup(len(shapes), done, maps_before)
        jax.effects_barrier()
        seconds = time.perf_counter() - start
        logger.info("warmed %s: %d shapes in %.1f s", name, len(own), seconds)
        warmed.append(Warmed(None, name, len(own), seconds))
    return warmed
