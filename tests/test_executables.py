"""Compiled executables within the process's memory-map limit (`engine/executables.py`).

XLA:CPU maps about a hundred regions per step executable and Linux allows 65,530 maps by
default: without the guard a process crashes (SIGSEGV) after some 550 distinct step shapes. Here
the limit is lowered by patching `map_limit` to just above the maps in use, so a few compiles
cross it (`benchmarks/executable_limit.py` runs the real crash and the guard against it).
"""

import logging
import threading

import numpy as np
import pytest

from helpers import compile_events, random_tokens
from tpuscore import Scorer, ValidationError
from tpuscore.engine import executables

CASE = "llama_gqa_untied"


def limit_with_room(monkeypatch, maps: int) -> None:
    """Make the high-water mark `maps` above the maps in use now."""
    high_water = executables.map_count() + maps
    monkeypatch.setattr(executables, "map_limit", lambda: int(high_water / executables.HIGH_WATER))


def test_past_the_high_water_mark_the_executables_are_dropped_and_scores_stay(
    scorers, rng, monkeypatch, caplog
):
    """A call that compiles past the mark drops every executable (the maps fall back), says so,
    and the same request then compiles again and scores the same bits."""
    scorer = scorers(CASE)
    vocab = scorer.config.vocab_size
    query = random_tokens(rng, 40, vocab)
    items = [random_tokens(rng, int(n), vocab) for n in rng.integers(1, 12, 5)]
    guard = executables.guard()
    compiles = compile_events()  # clears JAX's caches: the call below builds its executables
    limit_with_room(monkeypatch, 50)  # under one step executable's maps (about a hundred)
    dropped = guard.dropped
    with caplog.at_level(logging.WARNING, logger=executables.__name__):
        first = scorer.score(query, items, [1, 2], backend="prefill_extend")
    assert compiles and guard.dropped == dropped + 1
    assert "dropped every compiled executable" in caplog.text
    # The same shapes again: kept, they would compile nothing. (The count is process-wide, so
    # another test's leftover thread may add to it: only growth is asserted.)
    built = len(compiles)
    scorer.get_backend("prefill_extend").cache.clear()  # the query runs cold again
    again = scorer.score(query, items, [1, 2], backend="prefill_extend")
    assert len(compiles) > built  # dropped: built again
    np.testing.assert_array_equal(again.logprobs, first.logprobs)
    assert guard.dropped == dropped + 2  # and past the mark again

    monkeypatch.undo()  # the real limit, far off: built again, nothing dropped
    built = len(compiles)
    scorer.get_backend("prefill_extend").cache.clear()
    scorer.score(query, items, [1, 2], backend="prefill_extend")
    assert len(compiles) > built and guard.dropped == dropped + 2


def test_nothing_compiled_nothing_checked(scorers, rng, monkeypatch):
    """Calls that compile nothing never read the maps, even past the mark."""
    scorer = scorers(CASE)
    query, items = random_tokens(rng, 20, scorer.config.vocab_size), [[5, 6], [7]]
    scorer.score(query, items, [1], backend="prefill_extend")  # compiled, checked
    reads = []
    monkeypatch.setattr(executables, "map_count", lambda: reads.append(1) or 10**9)
    assert not executables.guard().check()
    scorer.score(query, items, [1], backend="prefill_extend")
    assert reads == []


def test_without_proc_the_guard_does_nothing(monkeypatch):
    monkeypatch.setattr(executables, "MAPS", "/nonexistent/maps")
    monkeypatch.setattr(executables, "MAX_MAP_COUNT", "/nonexistent/max_map_count")
    assert executables.map_count() is None and executables.map_limit() is None
    guard = executables.guard()
    guard.compiles += 1  # as if a compile happened
    assert not guard.check()
    guard.check_warmup(total=10**6, done=8, maps_before=None)  # no refusal without figures


def test_warmup_refuses_a_shape_set_that_cannot_stay(scorers, monkeypatch):
    """Room for about ten executables, a set of dozens: refused after the first
    `WARMUP_PROBE` shapes (2 here: each compile costs a second), naming the limit, rather than
    compiling on towards a crash."""
    monkeypatch.setattr(executables, "WARMUP_PROBE", 2)
    base = scorers(CASE)
    options = {"prefill_extend": {"batch_items": 4, "prefill_chunk": 16}}
    scorer = Scorer(base.config, base.params, base.tokenizer, backend_options=options)
    limits = {"query_tokens": 64, "item_tokens": 8, "labels": 2}
    total = len(scorer.shapes(limits, backends=["prefill_extend"]))
    assert total > 3 * executables.WARMUP_PROBE
    compiles = compile_events()
    limit_with_room(monkeypatch, 1000)
    with pytest.raises(ValidationError, match="vm.max_map_count") as refused:
        scorer.warmup(all=True, limits=limits, backends=["prefill_extend"])
    assert refused.value.code == "shape_set_too_large" and refused.value.param == "limits"
    assert f"{total} executables" in str(refused.value)
    assert len(compiles) == executables.WARMUP_PROBE


def test_drops_while_other_threads_score_lose_nothing(scorers, rng, monkeypatch):
    """Four threads scoring new shapes on three backends at once, the mark low enough that
    nearly every call drops the executables under the others: every call completes and equals
    the reference backend."""
    scorer = scorers(CASE)
    vocab = scorer.config.vocab_size
    requests = [
        (
            random_tokens(rng, int(rng.integers(1, 120)), vocab),
            [random_tokens(rng, int(n), vocab) for n in rng.integers(1, 40, rng.integers(1, 12))],
            ("prefill_extend", "packed_dense", "serial")[i % 3],
        )
        for i in range(8)
    ]
    compile_events()  # clears JAX's caches: no shape here is kept from an earlier test
    limit_with_room(monkeypatch, 60)
    dropped = executables.guard().dropped
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
    assert executables.guard().dropped >= dropped + 2
    for i, (query, items, _) in enumerate(requests):
        expected = scorer.score(query, items, [1, 2], backend="reference").logprobs
        np.testing.assert_allclose(results[i], expected, atol=1e-4, rtol=0)
