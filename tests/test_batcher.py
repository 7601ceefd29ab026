"""tpuscore.Batcher: concurrent callers share scorer.run calls and each gets its own result."""

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from helpers import random_tokens
from tpuscore import Batcher, Overloaded, ValidationError, backends
from tpuscore.tasks.chunking import ChunkedResult

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
        # submit returns once its request is queued: all are, before the gate opens
        submitted = [pool.submit(lambda r: batcher.submit(**r), r) for r in requests]
        futures = [f.result(WAIT_S) for f in submitted]
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
    spy = Recorder(scorer, gate := threading.Event())
    with Batcher(spy, max_pending=3) as batcher:
        futures = [batcher.submit(**r) for r in requests[:3]]
        with pytest.raises(Overloaded, match="max_pending=3"):  # while the worker is held
            batcher.submit(**requests[3])
        assert len(spy.prepared_in) == 3 and isinstance(Overloaded(3), RuntimeError)
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
    closing, join = threading.Event(), batcher._worker.join

    def joining(*args):  # close() refuses new requests, then waits for the worker here
        closing.set()
        return join(*args)

    batcher._worker.join = joining
    closer = threading.Thread(target=batcher.close)
    closer.start()
    assert closing.wait(WAIT_S)
    assert not any(f.done() for f in futures)  # close waits for them
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


class Failing(backends.PerGroupBackend):
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


def assert_documents_as_alone(batched, alone) -> None:
    """A chunked result against its request scored alone: every chunk's scores within the
    batch-composition bound, so the documents' aggregates too, and the same best chunks (the
    tiny model's chunk scores differ by far more than that bound)."""
    assert isinstance(batched, ChunkedResult)
    assert_as_alone(batched.chunks.logprobs, alone.chunks.logprobs)
    np.testing.assert_allclose(batched.scores, alone.scores, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(batched.best_chunk, alone.best_chunk)
    assert batched.best_span == alone.best_span and batched.spans == alone.spans


def test_a_chunked_request_gets_the_documents_result_whole_or_split_over_batches(scorer, rng):
    """`chunking` through the Batcher: each chunked request's result is `score(chunking=)`'s,
    whether it shares a run with other requests (threads and asyncio) or its chunks run over
    several batches (past max_request_step_tokens); a bad chunking fails its caller at once."""
    vocab = scorer.config.vocab_size
    query = random_tokens(rng, 8, vocab)
    chunked = [
        {
            "query": query if i else random_tokens(rng, 6, vocab),
            "items": [  # one of 25 tokens: 6 chunks, so past the split Batcher's 40-token cap
                random_tokens(rng, int(n), vocab) for n in [25, *rng.integers(1, 30, size=3)]
            ],
            "label_token_ids": [3, 5],
            "chunking": {"window": 6, "stride": 4, "aggregate": aggregate},
        }
        for i, aggregate in enumerate(("max", "mean", "first"))
    ]
    chunked.append({**chunked[0], "query": "The quick brown fox", "labels": [" the", " a"],
                    "items": ["jumps over the lazy dog", "sat"]})  # fmt: skip
    del chunked[-1]["label_token_ids"]
    plain = _requests(rng, scorer, 4, serial=False)[1:]  # its text request among them
    alone = [scorer.score(**r) for r in chunked + plain]
    spy = Spy(scorer, gate := threading.Event())
    with Batcher(spy, max_wait_ms=20) as batcher:
        first = batcher.submit(**plain[0])
        assert spy.running.wait(WAIT_S)
        futures = [first] + [batcher.submit(**r) for r in plain[1:] + chunked]
        gate.set()
        results = [f.result(WAIT_S) for f in futures]
        with pytest.raises(ValidationError) as bad:
            batcher.submit(**{**chunked[0], "chunking": {"window": 0}})
        assert (bad.value.code, batcher.pending) == ("invalid_chunking", 0)
    assert spy.runs == [1, 6], spy.runs  # the rest of them in one run
    for result, expected in zip(results[3:], alone[:4], strict=True):
        assert_documents_as_alone(result, expected)
    _assert_sequential(results[:3], plain, alone[4:])

    async def main(batcher):
        return await asyncio.gather(*(batcher.score_async(**r) for r in chunked))

    spy = Spy(scorer)
    with Batcher(spy, max_wait_ms=0, max_request_step_tokens=40) as batcher:
        results = asyncio.run(main(batcher))
    assert sum(spy.runs) >= len(chunked) + 2  # chunks of a request in several batches
    for result, expected in zip(results, alone[:4], strict=True):
        assert_documents_as_alone(result, expected)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"max_wait_ms": -1}, "max_wait_ms must be >= 0"),
        ({"max_wait_ms": "2"}, "max_wait_ms must be a number"),
        ({"max_batch_tokens": 0}, "max_batch_tokens must be an int >= 1"),
        ({"max_pending": 2.5}, "max_pending must be an int >= 1"),
        ({"max_request_step_tokens": 0}, "max_request_step_tokens must be an int >= 1"),
        ({"max_queued_tokens": -3}, "max_queued_tokens must be an int >= 1"),
        ({"request_timeout_s": 0}, "request_timeout_s must be a positive number"),
        ({"request_timeout_s": float("inf")}, "request_timeout_s must be a positive number"),
    ],
)
def test_bad_options_name_the_option(scorer, options, message):
    with pytest.raises(ValueError, match=message):
        Batcher(scorer, **options)


# -- deadlines, cancellation, fairness, admission (issue 25) -----------------------------------


class Recorder(Spy):
    """The Spy, also recording the requests of each scoring run and the threads that tokenized
    (prepare_request). With a prepare_gate, tokenization waits until it opens; `preparing` is
    set as one starts."""

    def __init__(self, scorer, gate=None):
        super().__init__(scorer, gate)
        self.ran: list[list] = []  # per run: its requests
        self.prepared_in: list[threading.Thread] = []
        self.prepare_gate: threading.Event | None = None
        self.preparing = threading.Event()

    def prepare_request(self, request, *, backend=None):
        self.prepared_in.append(threading.current_thread())
        self.preparing.set()
        if (gate := self.prepare_gate) is not None:
            assert gate.wait(WAIT_S)
        return self.scorer.prepare_request(request, backend=backend)

    def run(self, requests, *, backend=None):
        if requests:
            self.ran.append(list(requests))
        return super().run(requests, backend=backend)

    def queries_run(self) -> list:
        return [r.query for run in self.ran for r in run]


def _queries(run: list) -> list:
    return [r.query for r in run]


def _scored(recorder, request: dict) -> bool:
    return any(q == request["query"] for q in recorder.queries_run())


def test_a_request_past_its_deadline_fails_and_is_never_scored(scorer, rng):
    from tpuscore.serving.batcher import DeadlineExceeded

    requests = _requests(rng, scorer, 4, serial=False)
    spy = Recorder(scorer, gate := threading.Event())
    with Batcher(spy, max_wait_ms=0, request_timeout_s=0.3) as batcher:
        first = batcher.submit(**requests[0], timeout_s=WAIT_S)
        assert spy.running.wait(WAIT_S)  # the gate holds the worker in the first run
        late = batcher.submit(**requests[1])  # the batcher's default: 0.3 s
        later = batcher.submit(**requests[2], timeout_s=0.5)
        with pytest.raises(DeadlineExceeded, match="0.3 s"):
            late.result(WAIT_S)
        with pytest.raises(DeadlineExceeded):
            later.result(WAIT_S)
        assert len(spy.ran) == 1 and not gate.is_set()  # at their deadline, the worker held
        assert batcher.pending == 1  # only the running one
        gate.set()
        assert_as_alone(first.result(WAIT_S).logprobs, scorer.score(**requests[0]).logprobs)
        on_time = batcher.score(**requests[3], timeout_s=WAIT_S)
        assert_as_alone(on_time.logprobs, scorer.score(**requests[3]).logprobs)
    assert not _scored(spy, requests[1]) and not _scored(spy, requests[2])
    assert isinstance(DeadlineExceeded(1.0), TimeoutError)
    with Batcher(scorer) as batcher, pytest.raises(ValidationError) as bad:
        batcher.submit(**requests[0], timeout_s=0)
    assert bad.value.code == "invalid_argument" and bad.value.param == "timeout_s"


def test_a_cancelled_request_is_never_scored(scorer, rng):
    requests = _requests(rng, scorer, 5, serial=False)  # [3] is text
    spy = Recorder(scorer, gate := threading.Event())

    async def abandon(batcher):
        spy.preparing.clear()
        task = asyncio.ensure_future(batcher.score_async(**requests[2]))
        assert await asyncio.to_thread(spy.preparing.wait, WAIT_S)  # behind the gated run
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with Batcher(spy, max_wait_ms=0) as batcher:
        first = batcher.submit(**requests[0])
        assert spy.running.wait(WAIT_S)
        cancelled = batcher.submit(**requests[1])
        assert cancelled.cancel() and batcher.pending == 1
        asyncio.run(abandon(batcher))
        assert batcher.pending == 1
        gate.set()
        first.result(WAIT_S)
        batcher.score(**requests[4])
    assert not _scored(spy, requests[1]) and not _scored(spy, requests[2])
    assert _scored(spy, requests[4])


def test_a_small_request_is_not_held_behind_a_huge_one(scorer, rng):
    """A 1,000-item request runs over many batches; small requests sent while it runs each
    finish within a few runs of their arrival, long before the huge one ends, and every result
    equals its request scored alone (tests/unit/test_batcher_scheduling.py pins the order)."""
    vocab = scorer.config.vocab_size
    huge = {
        "query": random_tokens(rng, 12, vocab),
        "items": [random_tokens(rng, int(k), vocab) for k in rng.integers(1, 5, size=1000)],
        "label_token_ids": [3, 5],
    }
    small = _requests(rng, scorer, 4, serial=False)
    small[3] = {**small[2], "query": random_tokens(rng, 9, vocab)}  # token ids only
    expected = [scorer.score(**request).logprobs for request in small]
    spy = Recorder(scorer)
    with Batcher(spy, max_wait_ms=0, max_batch_tokens=160) as batcher:
        big = batcher.submit(**huge)
        assert spy.running.wait(WAIT_S)
        for request, alone in zip(small, expected, strict=True):
            future = batcher.submit(**request)  # returns once queued
            arrived = len(spy.ran)
            result = future.result(WAIT_S)
            query = request["query"]
            scored_in = next(n for n, run in enumerate(spy.ran, 1) if query in _queries(run))
            # The run under way, one dispatched before it queued, one of the huge one's chunks
            # queued before it: then its own.
            assert scored_in <= arrived + 3, (arrived, scored_in)
            assert_as_alone(result.logprobs, alone)
        assert not big.done()  # the small ones all went through while it ran
        result = big.result(WAIT_S)
    assert_as_alone(result.logprobs, scorer.score(**huge).logprobs)
    huge_runs = [run for run in spy.ran if any(r.query == huge["query"] for r in run)]
    assert len(huge_runs) > 10  # split: at most 160 tokens of it per batch
    for run in huge_runs:
        chunk = next(r for r in run if r.query == huge["query"])
        assert len(chunk.query) + sum(map(len, chunk.items)) <= 160
    assert result.num_tokens >= sum(map(len, huge["items"]))


def test_admission_refuses_before_tokenizing(scorer, rng):
    text = {"query": "The quick brown fox", "items": [" jumps"] * 3, "labels": [" the"]}
    spy = Recorder(scorer, gate := threading.Event())
    with Batcher(spy, max_pending=3, max_queued_tokens=100, max_wait_ms=0) as batcher:
        first = batcher.submit(**text)
        assert spy.running.wait(WAIT_S)
        second = batcher.submit(**text)  # queued: ~10 tokens
        too_big = {**text, "items": ["word " * 100] * 2}  # ~250 tokens by its 1,000 bytes
        with pytest.raises(Overloaded, match="max_queued_tokens=100"):
            batcher.submit(**too_big)
        third = batcher.submit(**text)
        with pytest.raises(Overloaded, match="max_pending=3"):
            batcher.submit(**text)
        assert len(spy.prepared_in) == 3  # the refused ones were never tokenized
        gate.set()
        for future in (first, second, third):
            future.result(WAIT_S)
        alone = batcher.score(**too_big)  # nothing else queued: admitted whatever its size
        np.testing.assert_array_equal(alone.logprobs, scorer.score(**too_big).logprobs)


def test_a_deadline_passing_during_tokenization_answers_at_once(scorer):
    from tpuscore import DeadlineExceeded

    text = {"query": "The quick brown fox", "items": [" jumps"], "labels": [" the"]}
    spy = Recorder(scorer)
    spy.prepare_gate = gate = threading.Event()  # tokenization waits until the test opens it

    async def main(batcher):
        with pytest.raises(DeadlineExceeded):
            await batcher.score_async(**text, timeout_s=0.2)
        assert not gate.is_set()  # answered while still tokenizing
        gate.set()

    with Batcher(spy) as batcher:
        asyncio.run(main(batcher))
    assert spy.ran == []  # tokenized after its deadline: never queued, never scored


def test_score_async_tokenizes_off_the_event_loop(scorer):
    """Tokenization waits until a task on the event loop lets it go on: tokenized on the loop,
    it would block the loop and never be let go (the wait would fail)."""
    text = {"query": "The quick brown fox", "items": [" jumps", " ran"], "labels": [" the"]}
    spy = Recorder(scorer)
    spy.prepare_gate = gate = threading.Event()

    async def main(batcher):
        work = asyncio.gather(*(batcher.score_async(**text) for _ in range(2)))
        assert await asyncio.to_thread(spy.preparing.wait, WAIT_S)
        gate.set()  # the loop ran while a request was being tokenized
        return await work, threading.current_thread()

    with Batcher(spy) as batcher:
        results, loop_thread = asyncio.run(main(batcher))
    assert loop_thread not in spy.prepared_in and len(spy.prepared_in) == 2
    expected = scorer.score(**text).logprobs
    for result in results:
        assert_as_alone(result.logprobs, expected)


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
