"""Helpers shared by the tests (fixtures live in conftest.py)."""

import copy

import numpy as np

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
