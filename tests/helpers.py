"""Helpers shared by the tests (fixtures live in conftest.py)."""

import copy

import numpy as np

from tpuscore.backends import BackendOutput, StepStats

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def compile_events() -> list[str]:
    """Clear JAX's caches and return a list that grows by one entry per XLA compilation.

    The event times `compile_or_get_cached`: with JAX's persistent compilation cache on, a load
    from it counts too (tests/test_warm_start.py tells the two apart)."""
    import jax
    from jax import monitoring

    events = []
    monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_: events.append(event) if event == COMPILE_EVENT else None
    )
    jax.clear_caches()
    return events


def random_tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(0, vocab, size=n).tolist()


def fresh(scorer):
    """A scorer on the same model with its own backends, so an empty prefix cache: the session's
    shared scorers hold other tests' queries, and a partial prefix hit runs other steps (same
    scores within rounding, not bit for bit)."""
    shared = copy.copy(scorer)
    shared.backends = scorer.backends.fresh()
    return shared


class SpyBackend:
    """A backend that counts its calls and scores zeros: what reaches a backend, and when."""

    calls = 0

    def __init__(self, model, options):
        pass

    def score(self, batch):
        SpyBackend.calls += 1
        shape = (batch.items.shape[0], batch.label_ids.shape[0])
        return BackendOutput(np.zeros(shape, np.float32), np.ones(shape[0], bool), StepStats())
