"""The compile-free floor: a test here fails if JAX builds an XLA executable while it runs.

JAX fires `COMPILE_EVENT` for every executable it builds (compiled, or loaded from the persistent
compilation cache; tests/test_warm_start.py relies on the same event); a listener registered once
counts them, and each test's setup, body and teardown must leave the count where they found it.
Tests here import tpuscore and use numpy, never a jitted function, so the floor runs in seconds:
`pytest tests/unit`, the first step of `nox -s tests`.
"""

import pytest
from jax import monitoring

from tpuscore.engine.executables import COMPILE_EVENT

COMPILES: list[str] = []
monitoring.register_event_duration_secs_listener(
    lambda event, _secs, **_: COMPILES.append(event) if event == COMPILE_EVENT else None
)


def compiles_nothing(item, phase: str):
    """A hook wrapper's body: run the phase, then fail it if it built an executable."""
    before = len(COMPILES)
    result = yield
    built = len(COMPILES) - before
    if built:
        pytest.fail(
            f"{item.nodeid} built {built} XLA executable(s) in {phase}: tests/unit compiles "
            "nothing; move the test to tests/, or check the numpy arithmetic, not a jitted call",
            pytrace=False,
        )
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from compiles_nothing(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from compiles_nothing(item, "the test"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from compiles_nothing(item, "teardown"))
