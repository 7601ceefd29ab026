"""Fake backends and pools for the unit floor: plans, prices and runs with no model and no
compiled step, counting what the engine asks of them."""

from __future__ import annotations

import types

import numpy as np

from tpuscore.api.requests import ScoreRequest
from tpuscore.backends.budgets import Budgeted
from tpuscore.backends.contract import (
    BackendOutput,
    Plan,
    ShapeLimits,
    Step,
    StepShape,
    StepTable,
    step_table,
)
from tpuscore.backends.work import StepWork
from tpuscore.parallel.sharding import ONE_DEVICE


class FakeBackend(Budgeted):
    """A backend on the contract alone: one step per item, each priced `seconds_per_step`
    (as flops) and `peak` bytes; it counts `plan`, `price` and `run` calls."""

    activation_bytes = 1 << 20

    def __init__(self, model=None, options=None, *, flops: float = 1.0, peak: int = 1):
        self.flops, self.peak = flops, peak
        self.calls = {"plan": 0, "price": 0, "run": 0}
        self.warmed: list[tuple] = []

    def plan(self, batches):
        self.calls["plan"] += 1
        rows = max(1, self.budget // (1 << 18))  # items per step: fewer as the budget shrinks
        steps = [(g, i) for g, b in enumerate(batches) for i in range(0, b.num_items, rows)]
        return Plan(tuple(batches), steps)

    def price(self, plan):
        self.calls["price"] += 1
        return [StepWork(self.flops, 0.0, 0.0, self.peak) for _ in plan.steps]

    def replan(self, plan):
        return self.plan(plan.batches)

    def run(self, plan):
        self.calls["run"] += 1
        out = []
        for batch in plan.batches:
            shape = (batch.items.shape[0], batch.label_ids.shape[0])
            logprobs = np.full(shape, -1.0, np.float32)
            valid = np.ones(shape[0], bool)
            out.append(BackendOutput(logprobs, valid, _stats()))
        return out

    @property
    def steps(self) -> StepTable:
        return step_table(Step("fake_step", self._step, self._zeros))

    def _step(self, rows, length):
        self.warmed.append((rows, length))

    def _zeros(self, shape):
        return shape, {}

    def shapes(self, limits: ShapeLimits) -> set[StepShape]:
        return {StepShape("fake_step", (rows, limits.item_tokens)) for rows in (1, 2)}


def _stats():
    from tpuscore.backends.contract import StepStats

    return StepStats()


class FakePool:
    """`BackendPool`'s `get` and `model` over given instances."""

    def __init__(self, backends: dict):
        self.backends = backends
        self.model = types.SimpleNamespace(
            layout=ONE_DEVICE, dtype=np.dtype("float32"), matmul_dtype="float32"
        )

    def get(self, name):
        return self.backends[name]


def request(query, items, labels=(1,), item_first=False) -> ScoreRequest:
    return ScoreRequest(list(query), [list(i) for i in items], list(labels), item_first, False)
