"""The last line against running out of device memory.

Backends size their steps to their memory estimates (`backends/budgets.py`), but an estimate can
be short of what XLA really allocates. When a backend call still fails with RESOURCE_EXHAUSTED,
the safety factor of that backend instance doubles (for the rest of its life: its scorer's pool
holds it, so other scorers keep theirs) until its plan has more, smaller steps, and the call
runs again from the start: halved rows or chunks, down to one item per step. Nothing of the failed
call is kept, so the scores are those of a call that never failed. A backend whose plan cannot
shrink further (or that has no estimates) re-raises the error.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import jax

from tpuscore.backends import registry
from tpuscore.backends.budgets import Budgeted
from tpuscore.backends.contract import BackendOutput, ScoreBatch

logger = logging.getLogger(__name__)

MAX_HALVINGS = 10  # per failure: a plan not smaller at 1/1024 of the budget will not shrink


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)


def score_groups(
    name: str, backend: registry.Backend, batches: Sequence[ScoreBatch]
) -> list[BackendOutput]:
    """`registry.score_groups`, retried on RESOURCE_EXHAUSTED with the backend's steps shrunk
    (module doc)."""
    while True:
        try:
            return registry.score_groups(backend, batches)
        except Exception as error:
            if not is_out_of_memory(error) or not _shrink(backend, batches):
                raise
            logger.warning(
                "%s ran out of device memory (%s); retrying with its steps sized to 1/%g of its "
                "budget", name, str(error).splitlines()[0], backend.safety,
            )  # fmt: skip


def _shrink(backend: registry.Backend, batches: Sequence[ScoreBatch]) -> bool:
    """Grow the backend's safety factor until its plan for these batches has more steps;
    False if it cannot (no estimates, or MAX_HALVINGS did not)."""
    if not isinstance(backend, Budgeted):
        return False
    steps = len(backend.work(batches))
    for _ in range(MAX_HALVINGS):
        backend.grow_safety()
        if len(backend.work(batches)) > steps:
            return True
    return False
