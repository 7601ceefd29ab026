"""Warm start: compile the jitted steps a service's requests will meet before the first arrives.

A geometry is (query tokens, items, item tokens). Warming one runs a synthetic request of that
geometry through the backend that would serve it, so every step shape it meets (after bucketing,
chunking and batching) is compiled, and exactly those. It runs on a separate set of backend
instances sharing the model, so the scorer's prefix cache and its statistics are untouched; the
compiled executables are shared, since the fresh instances run the scorer's copies of the jitted
steps (`executables.Guard`), which cache them per shape.

Under "auto" a geometry is warmed on the backend a cold request picks and, when that run cached
the query (prefill_extend) and the cached query changes the pick, on that one too: the same
query coming again meets it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import numpy as np

from tpuscore.api.errors import ValidationError
from tpuscore.api.requests import RequestLimits, ScoreOptions, ScoreRequest
from tpuscore.backends.pool import BackendPool
from tpuscore.engine import memory_guard, planning

logger = logging.getLogger(__name__)

# A typical ranking service: user contexts of 64 to 1024 tokens, pages of 10 to 100 candidates of
# about 16 tokens. A sample of a few shapes, not the whole range's shape set (docs/benchmarks.md,
# "Default warmup geometries"); other geometries compile on first use (or warm them by name).
DEFAULT_GEOMETRIES = tuple((q, n, 16) for q in (64, 256, 1024) for n in (10, 100))


@attrs.frozen
class Warmed:
    """One warmed geometry: the backend that ran it, its device steps and the seconds taken; or
    (geometry None) one backend's whole shape set (`shapes.warm_all`), steps its shapes."""

    geometry: tuple[int, int, int] | None
    backend: str
    steps: int
    seconds: float


def check_geometry(geometry: Any, where: str) -> tuple[int, int, int]:
    """(query_tokens, num_items, item_tokens) as ints; ValidationError("invalid_geometry") unless
    it is three ints >= 0 with num_items > 0."""
    values = tuple(geometry) if isinstance(geometry, Sequence) else ()
    ints = all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in values)
    if len(values) != 3 or not ints or min(values) < 0 or values[1] == 0:
        raise ValidationError(
            "invalid_geometry",
            f"{where} must be (query_tokens, num_items > 0, item_tokens), ints, got {geometry!r}",
            where,
        )
    return tuple(int(n) for n in values)


def check_size(
    geometry: tuple[int, int, int], where: str, max_positions: int, limits: RequestLimits
) -> None:
    """Refuse a geometry larger than a request may be, with the code `prepare` gives such a
    request, before its synthetic request is built: (10**9, 2, 3) would otherwise allocate
    10**9 token ids (tens of GB) only for `prepare` to refuse them."""
    query_len, count, item_len = geometry
    if count > limits.max_items:
        raise ValidationError(
            "too_many_items",
            f"{where} has {count} items; this scorer takes at most {limits.max_items}",
            f"{where}.items",
        )
    if query_len + item_len > max_positions:
        raise ValidationError(
            "sequence_too_long",
            f"{where}: query + item is {query_len + item_len} tokens; the model takes at most "
            f"{max_positions}",
            f"{where}.items",
        )
    if query_len + count * item_len > limits.max_total_length:
        raise ValidationError(
            "request_too_large",
            f"{where} has {query_len + count * item_len} tokens in all; this scorer takes at "
            f"most {limits.max_total_length}",
            where,
        )


def warm(
    pool: BackendPool,
    prepare: Callable[[Any, Any, ScoreOptions], ScoreRequest],
    selector: planning.Selector,
    backends: Sequence[str],
    geometries: Iterable[Any],
    limits: RequestLimits,
) -> list[Warmed]:
    """Run one synthetic request per geometry on each of `backends` ("auto": the backend `score`
    would pick for it), logging the time each takes.

    Every geometry is checked, as `prepare` checks a request, before any runs; an error's param
    names it ("geometries[2]", "geometries[2].items"); one past the model's positions or
    `limits` is refused before its request is built. Each geometry runs on new backend
    instances (`pool.fresh()`), so it meets the steps of a cold request and leaves the scorer's
    caches and counters alone."""
    requests = []
    for i, geometry in enumerate(geometries):
        where = f"geometries[{i}]"
        query_len, count, item_len = check_geometry(geometry, where)
        check_size(
            (query_len, count, item_len), where, pool.model.config.max_position_embeddings, limits
        )
        ids = np.arange(query_len + count * item_len) % pool.model.config.vocab_size
        items = ids[query_len:].reshape(count, item_len).tolist()
        try:
            labels = None if pool.model.config.classifier else [0]  # a classifier takes none
            request = prepare(ids[:query_len].tolist(), items, ScoreOptions(label_token_ids=labels))
        except ValidationError as e:
            raise e.within(where) from None
        requests.append(((query_len, count, item_len), request))

    warmed = []
    for geometry, request in requests:
        fresh = pool.fresh()  # empty caches: the geometry runs cold, as a new request would
        for name in backends:
            ran = set()
            while True:  # auto: again if the query, now cached, changes its pick (module doc)
                ((call),) = planning.plan([request], name, selector, fresh)
                chosen = call.backend
                if chosen in ran:
                    break
                ran.add(chosen)
                start = time.perf_counter()
                (output,) = memory_guard.run(chosen, fresh.get(chosen), call.plan)
                stats = output.stats
                seconds = time.perf_counter() - start
                logger.info(
                    "warmed %s on %s: %d steps in %.2f s", geometry, chosen, stats.steps, seconds
                )
                warmed.append(Warmed(geometry, chosen, stats.steps, seconds))
        pool.guard.check()
    return warmed
