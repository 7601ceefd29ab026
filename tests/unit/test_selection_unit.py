"""Selection over fake priced work: the least time among the fitting, eligible candidates; the
fallback when nothing fits (compiles nothing)."""

import attrs
from contract_fakes import FakeBackend, FakePool, request

from tpuscore.backends import registry
from tpuscore.engine import planning, selection
from tpuscore.engine.profiles import built_in


def batches(item_first=False):
    return [g.batch for g in planning.group([request([1, 2], [[3], [4]], item_first=item_first)])]


def cost_model():
    return selection.CostModel(built_in("cpu"), platform="tpu")  # every candidate compiled


def test_the_least_time_wins_and_its_plan_comes_with_it():
    names = registry.candidates()
    fakes = {n: FakeBackend(flops=10.0) for n in names}
    fakes[names[-1]] = FakeBackend(flops=1.0)
    groups = batches()
    choice = cost_model().select(groups, FakePool(fakes))
    assert choice.backend == names[-1]
    assert choice.plan.batches == tuple(groups)
    assert len(choice.work) == len(choice.plan.steps)


def test_a_candidate_over_its_budget_is_passed_over():
    names = registry.candidates()
    fakes = {n: FakeBackend(flops=10.0) for n in names}
    fakes[names[0]] = FakeBackend(flops=1.0, peak=1 << 40)  # fastest, but never fits
    plan = cost_model().plan(batches(), FakePool(fakes))
    assert not plan[names[0]].fits
    assert plan.pick != names[0]


def test_nothing_fitting_falls_back():
    fakes = {n: FakeBackend(peak=1 << 40) for n in registry.candidates()}
    assert cost_model().select(batches(), FakePool(fakes)).backend == registry.fallback()


def test_item_first_goes_to_the_fallback():
    fakes = {n: FakeBackend(flops=1.0) for n in registry.candidates()}
    choice = cost_model().select(batches(item_first=True), FakePool(fakes))
    assert choice.backend == registry.fallback()


def test_interpret_mode_is_not_eligible_on_cpu(monkeypatch):
    registration = registry.registration("packed_segment")  # as if a Pallas kernel alone
    capabilities = attrs.evolve(registration.capabilities, compiled_on=frozenset({"tpu", "gpu"}))
    monkeypatch.setitem(
        registry._REGISTRY, "packed_segment", attrs.evolve(registration, capabilities=capabilities)
    )
    fakes = {n: FakeBackend(flops=10.0) for n in registry.candidates()}
    fakes["packed_segment"] = FakeBackend(flops=0.001)
    plan = selection.CostModel(built_in("cpu"), platform="cpu").plan(batches(), FakePool(fakes))
    assert not plan["packed_segment"].eligible
    assert plan.pick != "packed_segment"


def test_a_request_with_an_adapter_goes_only_to_backends_that_run_them(monkeypatch):
    """A candidate without `Capabilities.adapters` is not eligible for a batch holding an
    adapter's rows, however cheap; the same batch without one may go to it."""
    name = registry.candidates()[0]
    reg = registry.registration(name)
    monkeypatch.setitem(
        registry._REGISTRY, name, attrs.evolve(reg, capabilities=attrs.evolve(
            reg.capabilities, adapters=False))
    )  # fmt: skip
    fakes = {n: FakeBackend(flops=10.0) for n in registry.candidates()}
    fakes[name] = FakeBackend(flops=0.001)
    adapted = [g.batch for g in planning.group([attrs.evolve(request([1, 2], [[3]]), adapter=1)])]
    assert adapted[0].adapter == 1
    plan = cost_model().plan(adapted, FakePool(fakes))
    assert not plan[name].eligible and plan.pick != name
    assert cost_model().plan(batches(), FakePool(fakes)).pick == name


def test_one_query_under_two_adapters_is_two_groups():
    same = request([1, 2], [[3]])
    groups = planning.group([same, attrs.evolve(same, adapter=2), same])
    assert [(g.batch.adapter, g.members) for g in groups] == [(0, (0, 2)), (2, (1,))]
