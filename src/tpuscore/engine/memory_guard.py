"""The last line against running out of device memory.

Backends size their steps to their memory estimates (`backends/budgets.py`), but an estimate can
be short of what XLA really allocates. When a backend call still fails with RESOURCE_EXHAUSTED,
the safety factor of that backend instance doubles (for the rest of its life: its scorer's pool
holds it, so other scorers keep theirs) until its plan has more, smaller steps, and the call
runs again from the start on that new plan: halved rows or chunks, down to one item per step. A
retry is the only place a call plans again. Nothing of the failed call is kept, so the scores are
those of a call that never failed. A backend whose plan cannot shrink further (or that prices no
steps) re-raises the error.
"""

from __future__ import annotations

import logging
from typing import Any

import jax

from tpuscore.backends.contract import Backend, Plan

logger = logging.getLogger(__name__)

MAX_HALVINGS = 10  # per failure: a plan not smaller at 1/1024 of the budget will not shrink


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)


def run(name: str, backend: Backend, plan: Plan) -> list[Any]:
    """`backend.run(plan)`, on RESOURCE_EXHAUSTED re-planned with the backend's steps shrunk and
    run again (module doc)."""
    while True:
        try:
            return list(backend.run(plan))
        except Exception as error:
            smaller = _shrink(backend, plan) if is_out_of_memory(error) else None
            if smaller is None:
                raise
            plan = smaller
            logger.warning(
                "%s ran out of device memory (%s); retrying with its steps sized to 1/%g of its "
                "budget", name, str(error).splitlines()[0], backend.safety,
            )  # fmt: skip


def _shrink(backend: Backend, plan: Plan) -> Plan | None:
    """Grow the backend's safety factor until its plan for the same batches has more steps: that
    plan; None if MAX_HALVINGS did not (a plan that prices no steps never shrinks)."""
    steps = len(backend.price(plan))
    for _ in range(MAX_HALVINGS):
        backend.grow_safety()
        smaller = backend.replan(plan)
        if len(backend.price(smaller)) > steps:
            return smaller
    return None
