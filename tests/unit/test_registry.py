"""The registry checks a backend against the protocol when it is registered (compiles nothing)."""

import pytest
from contract_fakes import FakeBackend

from tpuscore.backends import PerGroupBackend, registry
from tpuscore.backends.contract import PROTOCOL, missing_members


class OnlyScore:
    def __init__(self, model, options):
        pass

    def score(self, batch): ...


class NoPrice(FakeBackend):
    price = None


def test_a_backend_missing_a_member_is_refused_with_its_name():
    with pytest.raises(TypeError, match="lacks price of the backend protocol"):
        registry.register("unit_no_price", NoPrice)
    assert "unit_no_price" not in registry.available()


def test_a_score_only_class_is_refused_and_pointed_at_the_per_group_base():
    with pytest.raises(TypeError) as refused:
        registry.register("unit_only_score", OnlyScore)
    message = str(refused.value)
    for member in ("plan", "price", "run", "steps", "shapes"):
        assert member in message
    assert "PerGroupBackend" in message


def test_a_complete_backend_registers():
    class Scores(PerGroupBackend):
        def score(self, batch): ...

    assert missing_members(FakeBackend) == []
    assert missing_members(Scores) == []
    registry.register("unit_fake", FakeBackend)
    try:
        assert "unit_fake" in registry.available()
    finally:
        registry._REGISTRY.pop("unit_fake")


def test_a_factory_function_is_checked_when_the_pool_builds_it():
    from tpuscore.backends.pool import BackendPool

    registry.register("unit_factory", lambda model, options: OnlyScore(model, options))
    try:
        with pytest.raises(TypeError, match="unit_factory.*lacks .*plan"):
            BackendPool(None, None).get("unit_factory")
    finally:
        registry._REGISTRY.pop("unit_factory")


def test_every_built_in_backend_has_the_whole_protocol():
    for name in registry.available():
        assert missing_members(registry.registration(name).factory) == [], name
    assert set(PROTOCOL) >= {"plan", "price", "run", "steps", "shapes", "budget"}


def test_the_fixed_rule_and_the_fallback_are_capabilities():
    assert registry.fixed_rule(False) == "prefill_extend"
    assert registry.fixed_rule(True) == "serial"
    assert registry.fallback() == "serial"
