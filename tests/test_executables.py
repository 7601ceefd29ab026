"""Compiled executables within the process's memory-map limit (`engine/executables.py`).

XLA:CPU maps about a hundred regions per step executable and Linux allows 65,530 maps by
default: without the guard a process crashes (SIGSEGV) after some 550 distinct step shapes. Here
each scorer is given a guard whose limit sits just above the maps in use, so a few compiles
cross it (`benchmarks/executable_limit.py` runs the real crash and the guard against it).
"""

import gc
import logging
import threading

import numpy as np
import pytest

from helpers import compile_events, random_tokens
from tpuscore import Scorer, ValidationError
from tpuscore.engine import executables

CASE = "llama_gqa_untied"


def limit_with_room(maps: int, **kwargs) -> executables.Guard:
    """A guard whose high-water mark is `maps` above the maps in use now. Earlier tests' garbage
    is collected first: executables freed by a later collection, mid-test, would lower the maps
    in use and with them the drops the test counts (a CI run's worker once dropped once, not
    twice, after other files' tests)."""
    gc.collect()
    high_water = executables.map_count() + maps
    limit = int(high_water / executables.HIGH_WATER)
    return executables.Guard(map_limit=lambda: limit, **kwargs)


def guarded(base: Scorer, guard: executables.Guard, **kwargs) -> Scorer:
    """A scorer on `base`'s model with its own backends and the given guard."""
    return Scorer(base.config, base.params, base.tokenizer, executables_guard=guard, **kwargs)


def test_past_the_high_water_mark_the_executables_are_dropped_and_scores_stay(scorers, rng, caplog):
    """A call that compiles past the mark drops the scorer's executables, says so, and the same
    request then compiles again and scores the same bits."""
    vocab = scorers(CASE).config.vocab_size
    query = random_tokens(rng, 40, vocab)
    items = [random_tokens(rng, int(n), vocab) for n in rng.integers(1, 12, 5)]
    compiles = compile_events()
    # Under one step executable's maps (about a hundred).
    guard = limit_with_room(50)
    scorer = guarded(scorers(CASE), guard)
    dropped = guard.dropped
    with caplog.at_level(logging.WARNING, logger=executables.__name__):
        first = scorer.score(query, items, [1, 2], backend="prefill_extend")
    assert compiles and guard.dropped == dropped + 1 and guard.held == 0
    assert "dropped this scorer's compiled executables" in caplog.text
    # The same shapes again: kept, they would compile nothing. (The count is process-wide, so
    # another test's leftover thread may add to it: only growth is asserted.)
    built = len(compiles)
    scorer.get_backend("prefill_extend").cache.clear()  # the query runs cold again
    again = scorer.score(query, items, [1, 2], backend="prefill_extend")
    assert len(compiles) > built  # dropped: built again
    np.testing.assert_array_equal(again.logprobs, first.logprobs)
    assert guard.dropped == dropped + 2  # and past the mark again

    guard.map_limit = executables.map_limit  # the real limit, far off: built again, nothing dropped
    built = len(compiles)
    scorer.get_backend("prefill_extend").cache.clear()
    scorer.score(query, items, [1, 2], backend="prefill_extend")
    assert len(compiles) > built and guard.dropped == dropped + 2 and guard.held > 0


def test_nothing_compiled_nothing_checked(scorers, rng):
    """Calls that compile nothing never read the maps, even past the mark."""
    reads, past = [], [False]
    guard = executables.Guard(map_count=lambda: reads.append(1) or (10**9 if past[0] else 0))
    scorer = guarded(scorers(CASE), guard)
    query, items = random_tokens(rng, 20, scorer.config.vocab_size), [[5, 6], [7]]
    scorer.score(query, items, [1], backend="prefill_extend")  # compiled, checked
    assert reads and guard.dropped == 0
    reads.clear()
    past[0] = True
    scorer.score(query, items, [1], backend="prefill_extend")
    assert reads == [] and guard.dropped == 0


def test_without_proc_the_guard_does_nothing():
    assert executables.map_count("/nonexistent/maps") is None
    assert executables.map_limit("/nonexistent/max_map_count") is None
    guard = executables.Guard(map_count=lambda: None, map_limit=lambda: None)
    guard.checked_at -= 1  # as if a compile happened
    assert not guard.check()
    guard.check_warmup(total=10**6, done=8, maps_before=None)  # no refusal without figures


def test_warmup_refuses_a_shape_set_that_cannot_stay(scorers):
    """Room for about ten executables, a set of dozens: refused after the first
    `warmup_probe` shapes (2 here: each compile costs a second), naming the limit, rather than
    compiling on towards a crash."""
    options = {"prefill_extend": {"batch_items": 4, "prefill_chunk": 16}}
    compiles = compile_events()
    guard = limit_with_room(1000, warmup_probe=2)
    scorer = guarded(scorers(CASE), guard, backend_options=options)
    limits = {"query_tokens": 64, "item_tokens": 8, "labels": 2}
    total = len(scorer.shapes(limits, backends=["prefill_extend"]))
    assert total > 3 * guard.warmup_probe
    with pytest.raises(ValidationError, match="vm.max_map_count") as refused:
        scorer.warmup(all=True, limits=limits, backends=["prefill_extend"])
    assert refused.value.code == "shape_set_too_large" and refused.value.param == "limits"
    assert f"{total} executables" in str(refused.value)
    assert len(compiles) == guard.warmup_probe


def test_drops_while_other_threads_score_lose_nothing(scorers, rng):
    """Four threads scoring new shapes on three backends at once, the mark low enough that
    nearly every call drops the executables under the others: every call completes and equals
    the reference backend."""
    vocab = scorers(CASE).config.vocab_size
    requests = [
        (
            random_tokens(rng, int(rng.integers(1, 120)), vocab),
            [random_tokens(rng, int(n), vocab) for n in rng.integers(1, 40, rng.integers(1, 12))],
            ("prefill_extend", "packed_dense", "serial")[i % 3],
        )
        for i in range(8)
    ]
    guard = limit_with_room(60)
    scorer = guarded(scorers(CASE), guard)  # its own executables: none kept from another test
    dropped = guard.dropped
    results, errors = {}, []

    def work(first: int) -> None:
        try:
            for i in range(first, len(requests), 4):
                query, items, backend = requests[i]
                results[i] = scorer.score(query, items, [1, 2], backend=backend).logprobs
        except Exception as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    threads = [threading.Thread(target=work, args=(first,)) for first in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors and len(results) == len(requests)
    assert guard.dropped >= dropped + 2
    for i, (query, items, _) in enumerate(requests):
        expected = scorer.score(query, items, [1, 2], backend="reference").logprobs
        np.testing.assert_allclose(results[i], expected, atol=1e-4, rtol=0)


def test_one_scorers_limit_never_drops_another_scorers_executables(scorers, rng):
    """Scorer A past its mark drops its own executables; scorer B on the same model, warm,
    keeps every one of its: B's next call compiles nothing. (Before guards were per scorer,
    A's drop was `jax.clear_caches()`, and B compiled its steps again.)"""
    base = scorers(CASE)
    vocab = base.config.vocab_size
    query = random_tokens(rng, 40, vocab)
    items = [random_tokens(rng, int(n), vocab) for n in rng.integers(1, 12, 5)]
    b = guarded(base, executables.Guard(map_limit=lambda: 10**12))  # never past its mark
    first = b.score(query, items, [1, 2], backend="prefill_extend")
    held = b.engine.executables.held
    assert held > 0
    # A is past its mark whatever the maps its compiles add: a compile may reuse maps that
    # executables dropped by an earlier test freed, so "room for 50" was not always passed.
    a = guarded(base, executables.Guard(map_limit=lambda: 1))
    compiles = compile_events_kept()
    a.score(query, items, [1, 2], backend="prefill_extend")
    assert compiles and a.engine.executables.dropped == 1 and a.engine.executables.held == 0
    assert b.engine.executables.held == held and b.engine.executables.dropped == 0
    built = len(compiles)
    b.get_backend("prefill_extend").cache.clear()  # the same steps as the first call
    again = b.score(query, items, [1, 2], backend="prefill_extend")
    assert len(compiles) == built
    np.testing.assert_array_equal(again.logprobs, first.logprobs)


def compile_events_kept() -> list[str]:
    """A list that grows by one entry per compile, JAX's caches left as they are."""
    from jax import monitoring

    events: list[str] = []
    monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_: (
            events.append(event) if event == executables.COMPILE_EVENT else None
        )
    )
    return events
