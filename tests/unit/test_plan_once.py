"""Plan once: a call plans each backend it prices or runs once; the memory guard plans again only
on a retry (compiles nothing)."""

import jax
import pytest
from contract_fakes import FakeBackend, FakePool, request

from tpuscore.backends import registry
from tpuscore.engine import memory_guard, planning, selection
from tpuscore.engine.profiles import built_in


def run_call(pool, backend, selector):
    """What `Engine.run` does with a call: plan it, then run each backend call guarded."""
    requests = [request([1, 2, 3], [[4], [5, 6]]), request([7], [[8]] * 5)]
    calls = planning.plan(requests, backend, selector, pool)
    for call in calls:
        memory_guard.run(call.backend, pool.get(call.backend), call.plan)
    return calls


def test_a_named_backend_plans_once_per_call():
    fake = FakeBackend()
    run_call(FakePool({"serial": fake}), "serial", planning.FixedRule())
    assert fake.calls == {"plan": 1, "price": 1, "run": 1}


def test_auto_plans_each_candidate_once_and_runs_the_winners_plan():
    fakes = {name: FakeBackend(flops=1.0 + i) for i, name in enumerate(registry.candidates())}
    pool = FakePool(fakes)
    calls = run_call(pool, registry.AUTO, selection.CostModel(built_in("cpu"), "tpu"))
    (call,) = calls
    assert call.backend == registry.candidates()[0]  # the least flops
    for fake in fakes.values():
        assert fake.calls["plan"] == 1  # priced for the pick; the winner's not again to run
        assert fake.calls["price"] == 1
    assert fakes[call.backend].calls["run"] == 1


def test_the_memory_guard_replans_only_when_it_retries():
    class OutOfMemoryOnce(FakeBackend):
        def run(self, plan):
            if self.calls["run"] == 0:
                self.calls["run"] += 1
                raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: injected")
            return super().run(plan)

    fake = OutOfMemoryOnce()
    pool = FakePool({"serial": fake})
    (call,) = planning.plan([request([1], [[2]] * 8)], "serial", planning.FixedRule(), pool)
    assert fake.calls["plan"] == 1
    outputs = memory_guard.run("serial", fake, call.plan)
    assert len(outputs) == 1
    assert fake.safety > 1
    assert fake.calls["plan"] >= 2  # the retry re-planned, with more, smaller steps
    assert fake.calls["run"] == 2


def test_a_plan_that_cannot_shrink_reraises():
    class AlwaysOutOfMemory(FakeBackend):
        def plan(self, batches):
            plan = super().plan(batches)
            return type(plan)(plan.batches, plan.steps[:1])  # never more steps

        def run(self, plan):
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: injected")

    fake = AlwaysOutOfMemory()
    plan = fake.plan([planning.group([request([1], [[2]])])[0].batch])
    with pytest.raises(jax.errors.JaxRuntimeError):
        memory_guard.run("serial", fake, plan)
    assert fake.safety == 2**memory_guard.MAX_HALVINGS
