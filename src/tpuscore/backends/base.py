"""What backends share beside their protocol: scoring without an explicit plan, and the base for
a backend that scores one group at a time.

`Scoring` derives `score`, `score_groups`, `work` and `replan` from a backend's `plan`, `run`
and `price` (for callers and tests that hold batches, not a plan). `PerGroupBackend` is the base
of a backend written as `score(batch)` alone (the reference, or a user's): its plan is the groups
themselves, run one `score` call each, with no compiled steps, no priced work and no budget to
shrink.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tpuscore.backends.budgets import Budgeted
from tpuscore.backends.contract import (
    BackendOutput,
    Plan,
    ScoreBatch,
    ShapeLimits,
    StepShape,
    StepTable,
)
from tpuscore.backends.work import StepWork


class Scoring:
    """`score`, `score_groups` and `work` over a backend's own `plan`, `run` and `price`."""

    def plan(self, batches: Sequence[ScoreBatch]) -> Plan:
        raise NotImplementedError

    def run(self, plan: Plan) -> list[BackendOutput]:
        raise NotImplementedError

    def price(self, plan: Plan) -> list[StepWork]:
        raise NotImplementedError

    def replan(self, plan: Plan) -> Plan:
        """The plan's groups planned again (at the budget as it is now)."""
        return self.plan(plan.batches)

    def score(self, batch: ScoreBatch) -> BackendOutput:
        """One group planned and run."""
        return self.score_groups([batch])[0]

    def score_groups(self, batches: Sequence[ScoreBatch]) -> list[BackendOutput]:
        """These groups planned and run in one call."""
        return self.run(self.plan(batches))

    def work(self, batches: Sequence[ScoreBatch]) -> list[StepWork]:
        """The priced steps of these groups' plan."""
        return self.price(self.plan(batches))


class PerGroupBackend(Scoring, Budgeted):
    """A backend that scores one group per `score(batch)` call; subclasses write `score`.

    Its plan runs each group alone, it prices nothing (so "auto" must not pick it: register it
    without auto=True) and lists no compiled steps."""

    activation_bytes = 0
    steps: StepTable = {}

    def __init__(self, model: Any = None, options: Any = None):
        pass

    def score(self, batch: ScoreBatch) -> BackendOutput:
        raise NotImplementedError(f"{type(self).__name__} must define score(batch)")

    def score_groups(self, batches: Sequence[ScoreBatch]) -> list[BackendOutput]:
        return self.run(self.plan(batches))

    def plan(self, batches: Sequence[ScoreBatch]) -> Plan:
        return Plan(tuple(batches), tuple(batches))

    def price(self, plan: Plan) -> list[StepWork]:
        return []

    def run(self, plan: Plan) -> list[BackendOutput]:
        return [self.score(batch) for batch in plan.steps]

    def shapes(self, limits: ShapeLimits) -> set[StepShape]:
        return set()
