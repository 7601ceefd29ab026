"""tpuscore.Batcher: concurrent callers share scorer.run calls and each gets its own result."""

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from helpers import random_tokens
from tpuscore import Batcher, Overloaded, ValidationError, backends

CASE = "qwen3_qknorm"
WAIT_S = 60  # a bound on waits that only a hang reaches


class Spy:
    """The scorer, recording the size of each `run` call that scores something. With a gate, the
    first such call waits until the gate opens, so that the requests submitted meanwhile queue
    up behind it."""

    def __init__(self, scorer, gate: threading.Event | None = None):
        self.scorer = scorer
        self.gate = gate
        self.runs: list[int] = []
        self.running = threading.Event()

    def __getattr__(self, name):  # prepare, engine: the scorer's
        return getattr(self.scorer, name)

    def run(self, requests, *, backend=None):
        if requests:
            self.runs.append(len(requests))
            self.running.set()
            if self.gate is not None and len(self.runs) == 1:
                assert self.gate.wait(WAIT_S)
        return self.scorer.run(requests, backend=backend)


def _requests(rng, scorer, n: int, *, serial: bool = True) -> list[dict]:
    """n requests of score's keyword arguments: mostly their own query, every eighth sharing one
    query and labels (so that they can meet in one backend call), one as text, and with serial,
    every fifth naming backend="serial". Lengths vary within one shape bucket (at most 16 tokens
    a sequence), so that little compiles."""
    vocab = scorer.config.vocab_size
    shared = random_tokens(rng, 12, vocab)
    requests = []
    for i in range(n):
        request = {
            "query": shared if i % 8 == 0 else random_tokens(rng, int(rng.integers(8, 13)), vocab),
            "items": [random_tokens(rng, int(k), vocab) for k in rng.integers(1, 5, size=3)],
            "label_token_ids": [3, 5] if i % 8 == 0 else random_tokens(rng, 2, vocab),
        }
        if serial and i % 5 == 1:
            request["backend"] = "serial"
        requests.append(request)
    requests[3] = {"query": "The quick brown fox", "items": [" jumps", " ran"], "labels": [" the"]}
    return requests


def assert_as_alone(batched, alone) -> None:
    """A batched result against its request scored alone: a batch mixes queries in its device
    steps, so the padded shapes differ and float32 rounding may too (docs/backends.md's guarantee:
    within 1e-5)."""
    np.testing.assert_allclose(batched, alone, atol=1e-5, rtol=0)


def _assert_sequential(results, requests, sequential) -> None:
    """Each result equals its request scored alone, within the batch-composition bound. Under
    auto a shared run may take another backend than the request alone (the cost model prices
    the whole batch): still rounding only."""
    for result, alone in zip(results, sequential, strict=True):
        assert result.logprobs.shape == alone.logprobs.shape
        if alone.backend == "serial":  # named, or item_first: never moved
            assert result.backend == "serial"
        assert_as_alone(result.logprobs, alone.logprobs)


@pytest.fixture
def scorer(scorers):
    return scorers(CASE)


def test_threads_get_their_sequential_results_from_shared_runs(scorer, rng):
    requests = _requests(rng, scorer, 64)
    sequential = [scorer.score(**r) for r in requests]
    spy = Spy(scorer, gate := threading.Event())
    with Batcher(spy, max_wait_ms=20) as batcher, ThreadPoolExecutor(max_workers=64) as pool:
        futures = [pool.submit(lambda r: batcher.score(**r), r) for r in requests]
        deadline = time.monotonic() + WAIT_S
        while batcher.pending < 64 and time.monotonic() < deadline:  # all accepted
            time.sleep(0.01)
        gate.set()
        results = [f.result(WAIT_S) for f in futures]
    _assert_sequential(results, requests, sequential)
    assert sum(spy.runs) == 64 and len(spy.runs) < 64 / 4, spy.runs  # coalesced


def test_asyncio_tasks_get_their_sequential_results_from_shared_runs(scorer, rng):
    requests = _requests(rng, scorer, 64)
    sequential = [scorer.score(**r) for r in requests]
    spy = Spy(scorer)

    async def main(batcher):
        return await asyncio.gather(*(batcher.score_async(**r) for r in requests))

    with Batcher(spy, max_wait_ms=20) as batcher:
        results = asyncio.run(main(batcher))
    _assert_sequential(results, requests, sequential)
    assert sum(spy.runs) == 64 and len(spy.runs) < 64 / 4, spy.runs


def test_past_max_pending_a_submission_is_refused_at_once(scorer, rng):
    requests = _requests(rng, scorer, 4)
    spy = Spy(scorer, gate := threading.Event())
    with Batcher(spy, max_pending=3) as batcher:
        futures = [batcher.submit(**r) for r in requests[:3]]
        start = time.monotonic()
        with pytest.raises(Overloaded, match="max_pending=3"):
            batcher.submit(**requests[3])
        assert time.monotonic() - start < 1.0 and isinstance(Overloaded(3), RuntimeError)
        gate.set()
        for future, request in zip(futures, requests[:3], strict=True):
            assert_as_alone(future.result(WAIT_S).logprobs, scorer.score(**request).logprobs)
        again = batcher.score(**requests[3])  # room again
        assert_as_alone(again.logprobs, scorer.score(**requests[3]).logprobs)


def test_close_finishes_what_was_accepted_then_refuses(scorer, rng):
    requests = _requests(rng, scorer, 6)
    spy = Spy(scorer, gate := threading.Event())
    batcher = Batcher(spy, max_wait_ms=0)
    futures = [batcher.submit(**r) for r in requests]
    assert spy.running.wait(WAIT_S)  # the first run holds the rest in the queue
    closer = threading.Thread(target=batcher.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive() and not any(f.done() for f in futures[1:])  # close waits
    with pytest.raises(RuntimeError, match="closed"):
        batcher.submit(**requests[0])
    gate.set()
    closer.join(WAIT_S)
    assert not closer.is_alive() and all(f.done() for f in futures)
    for future, request in zip(futures, requests, strict=True):
        assert_as_alone(future.result().logprobs, scorer.score(**request).logprobs)
    with pytest.raises(RuntimeError, match="closed"):
        batcher.score(**requests[0])
    batcher.close()  # again: nothing happens
    with Batcher(scorer) as scoped:
        scoped.score(**requests[0])
    assert scoped.closed


class Failing:
    """A backend whose every step fails."""

    def __init__(self, model, options):
        pass

    def score(self, batch):
        raise RuntimeError("injected backend failure")


def test_a_backend_failure_reaches_only_the_callers_of_its_step(scorer, rng):
    backends.register("batcher_failing", Failing)
    requests = _requests(rng, scorer, 7, serial=False)
    spy = Spy(scorer, gate := threading.Event())
    with Batcher(spy) as batcher:
        first = batcher.submit(**requests[0])
        assert spy.running.wait(WAIT_S)  # the rest queue up behind the first run: one batch
        failing = [batcher.submit(**r, backend="batcher_failing") for r in requests[1:4]]
        others = [batcher.submit(**r) for r in requests[4:]]
        gate.set()
        for future in failing:
            with pytest.raises(RuntimeError, match="injected backend failure"):
                future.result(WAIT_S)
        for future, request in zip([first, *others], [requests[0], *requests[4:]], strict=True):
            assert_as_alone(future.result(WAIT_S).logprobs, scorer.score(**request).logprobs)
        assert spy.runs[1:] == [3, 3]  # one batch, one run per backend
        after = batcher.score(**requests[1])  # the worker keeps serving
        assert_as_alone(after.logprobs, scorer.score(**requests[1]).logprobs)


def test_a_bad_request_fails_only_its_caller(scorer, rng):
    requests = _requests(rng, scorer, 5, serial=False)
    vocab = scorer.config.vocab_size
    spy = Spy(scorer, gate := threading.Event())
    with Batcher(spy) as batcher:
        first = batcher.submit(**requests[0])
        assert spy.running.wait(WAIT_S)
        with pytest.raises(ValidationError) as bad_label:  # at submission, in the caller
            batcher.submit(**{**requests[1], "label_token_ids": [vocab]})
        assert bad_label.value.code == "token_id_exceeds_vocab"
        with pytest.raises(ValidationError) as bad_backend:
            batcher.submit(**requests[1], backend="no_such_backend")
        assert bad_backend.value.code == "unknown_backend"
        with pytest.raises(ValidationError) as unsupported:  # prefill_extend: no item_first
            batcher.submit(**requests[2], item_first=True, backend="prefill_extend")
        assert unsupported.value.code == "unsupported_option"
        others = [batcher.submit(**r, backend="prefill_extend") for r in requests[3:]]
        gate.set()
        for future, request in zip([first, *others], [requests[0], *requests[3:]], strict=True):
            expected = scorer.score(**{**request, "backend": "prefill_extend"})
            assert_as_alone(future.result(WAIT_S).logprobs, expected.logprobs)


def test_a_request_the_plan_refuses_after_submission_fails_only_its_caller(scorer, rng):
    """A backend registered again without item_first while an item_first request waits: the
    batch's plan refuses it, and only its caller gets the error."""
    serial = {"factory": backends.SerialBackend, "options": backends.SerialOptions}
    backends.register("batcher_changing", **serial)
    requests = _requests(rng, scorer, 4, serial=False)
    spy = Spy(scorer, gate := threading.Event())
    try:
        with Batcher(spy) as batcher:
            first = batcher.submit(**requests[0])
            assert spy.running.wait(WAIT_S)
            item_first = batcher.submit(**requests[1], item_first=True, backend="batcher_changing")
            others = [batcher.submit(**r, backend="batcher_changing") for r in requests[2:]]
            backends.register("batcher_changing", **serial, item_first=False)
            gate.set()
            with pytest.raises(ValidationError) as refused:
                item_first.result(WAIT_S)
            assert refused.value.code == "unsupported_option"
            expected = scorer.score(**requests[0])
            assert_as_alone(first.result(WAIT_S).logprobs, expected.logprobs)
            for future, request in zip(others, requests[2:], strict=True):
                expected = scorer.score(**request, backend="serial")
                assert_as_alone(future.result(WAIT_S).logprobs, expected.logprobs)
    finally:
        backends.register("batcher_changing", **serial)


def test_max_batch_tokens_bounds_a_batch(scorer, rng):
    vocab = scorer.config.vocab_size
    requests = [
        {
            "query": random_tokens(rng, 10, vocab),
            "items": [random_tokens(rng, 5, vocab)] * 2,
            "label_token_ids": [3, 5],
        }
        for _ in range(7)
    ]  # 20 tokens each
    spy = Spy(scorer, gate := threading.Event())
    with Batcher(spy, max_batch_tokens=45, max_wait_ms=50) as batcher:
        first = batcher.submit(**requests[0])
        assert spy.running.wait(WAIT_S)
        futures = [first, *(batcher.submit(**r) for r in requests[1:])]
        gate.set()
        for future, request in zip(futures, requests, strict=True):
            expected = scorer.score(**request)
            assert_as_alone(future.result(WAIT_S).logprobs, expected.logprobs)
    assert spy.runs == [1, 2, 2, 2], spy.runs


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_wait_ms": -1}, "max_wait_ms must be >= 0"),
        ({"max_wait_ms": "2"}, "max_wait_ms must be a number"),
        ({"max_batch_tokens": 0}, "max_batch_tokens must be an int >= 1"),
        ({"max_pending": 2.5}, "max_pending must be an int >= 1"),
    ],
)
def test_bad_options_name_the_option(scorer, options, message):
    with pytest.raises(ValueError, match=message):
        Batcher(scorer, **options)


@pytest.mark.parametrize(
    "request_, param",
    [
        ({"query": [1], "label_token_ids": [1]}, "items"),
        ({"items": [[1]], "label_token_ids": [1]}, "query"),
        ({"query": [1], "items": [[1]], "label_token_ids": [1], "lables": ["x"]}, "lables"),
    ],
)
def test_a_request_missing_or_unknown_argument_is_a_validation_error(scorer, request_, param):
    with Batcher(scorer) as batcher:
        with pytest.raises(ValidationError) as raised:
            batcher.submit(**request_)
        assert (raised.value.code, raised.value.param) == ("invalid_argument", param)
        assert batcher.pending == 0
