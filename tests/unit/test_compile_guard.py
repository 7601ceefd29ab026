"""The floor's guard (conftest.py) fails a test that builds an executable, without compiling one
here: JAX's own compile event is recorded by hand."""

import pytest
from jax import monitoring

from conftest import COMPILES, compiles_nothing
from tpuscore.engine.executables import COMPILE_EVENT


class Item:
    nodeid = "tests/unit/test_example.py::test_compiles"


def test_a_phase_that_builds_an_executable_fails():
    guard = compiles_nothing(Item(), "the test")
    next(guard)
    before = len(COMPILES)
    monitoring.record_event_duration_secs(COMPILE_EVENT, 0.25)
    assert COMPILES[before:] == [COMPILE_EVENT]
    with pytest.raises(pytest.fail.Exception, match="built 1 XLA executable"):
        guard.send(None)
    del COMPILES[before:]  # this test's own "compile" is not one


def test_a_phase_that_builds_nothing_passes_its_result_on():
    guard = compiles_nothing(Item(), "the test")
    next(guard)
    monitoring.record_event_duration_secs("/jax/some/other/event", 0.25)
    with pytest.raises(StopIteration) as done:
        guard.send("result")
    assert done.value.value == "result"
