"""Warm start: compile the jitted steps a service's requests will meet before the first arrives.

A geometry is (query tokens, items, item tokens). Warming one runs a synthetic request of that
geometry through the backend that would serve it, so every step shape it meets (after bucketing,
chunking and batching) is compiled, and exactly those. It runs on a separate set of backend
instances sharing the model, so the scorer's prefix cache and its statistics are untouched; the
compiled executables are shared, since JAX caches them per function and shape.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

import attrs
import numpy as np

from tpuscore import planning
from tpuscore.backends import registry
from tpuscore.backends.pool import BackendPool
from tpuscore.validation import ScoreRequest

logger = logging.getLogger(__name__)

# A typical ranking service: user contexts of 64 to 1024 tokens, pages of 10 to 100 candidates of
# about 16 tokens. Other geometries compile on first use (or warm them by name).
DEFAULT_GEOMETRIES = tuple((q, n, 16) for q in (64, 256, 1024) for n in (10, 100))


@attrs.frozen
class Warmed:
    """One warmed geometry: the backend that ran it, its device steps and the seconds taken."""

    geometry: tuple[int, int, int]
    backend: str
    steps: int
    seconds: float


def warm(
    pool: BackendPool,
    selector: planning.Selector,
    default_backend: str,
    vocab_size: int,
    geometries: Iterable[Sequence[int]],
    backends: Sequence[str] | None = None,
) -> list[Warmed]:
    """Run one synthetic request per geometry and backend (default: the one the scorer would
    pick), logging the time each takes."""
    warmed = []
    for geometry in geometries:
        query_len, count, item_len = (int(n) for n in geometry)
        if min(query_len, count, item_len) < 0 or query_len + item_len == 0 or count == 0:
            raise ValueError(
                f"a geometry is (query_tokens, num_items > 0, item_tokens), got {geometry}"
            )
        ids = np.arange(query_len + count * item_len) % vocab_size
        request = ScoreRequest(
            query=ids[:query_len].tolist(),
            items=ids[query_len:].reshape(count, item_len).tolist(),
            label_ids=[0],
            item_first=False,
            apply_softmax=False,
        )
        (group,) = planning.group([request])
        auto = default_backend == registry.AUTO
        names = backends or [selector.select(group, pool.model) if auto else default_backend]
        fresh = pool.fresh()  # empty caches: the geometry runs cold, as a new request would
        for name in names:
            start = time.perf_counter()
            stats = fresh.get(name).score(group.batch).stats
            seconds = time.perf_counter() - start
            logger.info("warmed %s on %s: %d steps in %.2f s", geometry, name, stats.steps, seconds)
            warmed.append(Warmed((query_len, count, item_len), name, stats.steps, seconds))
    return warmed
