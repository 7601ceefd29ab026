"""The Batcher's scheduling over a fake scorer that compiles nothing: what runs together, in
which order, what is split and joined, and what a cancel or a deadline does to a request, each
asserted by counts, order and events, never by the clock."""

import asyncio
import threading

import attrs
import numpy as np
import pytest

from tpuscore import Batcher, DeadlineExceeded, Overloaded, ValidationError
from tpuscore.api.requests import ScoreRequest
from tpuscore.api.results import ScoreResult

WAIT_S = 60  # a bound on waits that only a hang reaches


def logits(query: list[int], item: list[int], labels: list[int]) -> list[float]:
    """The fake model's scores of one item: distinct per query, item and label."""
    base = sum(query) * 1e-3 + sum(item) + 0.5 * len(item)
    return [base + 0.25 * label for label in labels]


class FakeScorer:
    """`Batcher`'s `Scoring` protocol over a fake model: requests are token ids, `run` records
    each call's requests and backend; `hold(n)` makes the n-th run (from 1) wait until released.
    A request with `"classes": k` is a k-class classification request (no labels)."""

    def __init__(self):
        self.runs: list[tuple[str | None, list[ScoreRequest]]] = []
        self.prepared: list[ScoreRequest] = []
        self.changed = threading.Condition()
        self.holds: dict[int, threading.Event] = {}
        self.prepare_gate: threading.Event | None = None  # prepare waits for it
        self.preparing = threading.Event()  # set as a prepare starts
        self.permits: threading.Semaphore | None = None  # each run takes one before it returns

    def hold(self, run: int) -> threading.Event:
        self.holds[run] = threading.Event()
        return self.holds[run]

    def prepare_request(self, request, *, backend=None):
        if backend == "nope":
            raise ValidationError("unknown_backend", "no backend 'nope'", "backend")
        unknown = set(request) - {"query", "items", "label_token_ids", "apply_softmax", "classes"}
        if unknown:
            raise ValidationError("invalid_argument", f"unknown {sorted(unknown)}", min(unknown))
        self.preparing.set()
        if (gate := self.prepare_gate) is not None:
            assert gate.wait(WAIT_S)
        classes = request.get("classes", 0)
        prepared = ScoreRequest(
            list(request["query"]),
            [list(item) for item in request["items"]],
            list(range(classes)) if classes else list(request["label_token_ids"]),
            False,
            bool(request.get("apply_softmax", False)),
            classification=bool(classes),
        )
        with self.changed:
            self.prepared.append(prepared)
            self.changed.notify_all()
        return prepared

    def run(self, requests, *, backend=None):
        with self.changed:
            self.runs.append((backend, list(requests)))
            number = len(self.runs)
            self.changed.notify_all()
        if number in self.holds:
            assert self.holds[number].wait(WAIT_S)
        if self.permits is not None:
            assert self.permits.acquire(timeout=WAIT_S)
        if backend == "failing":
            raise RuntimeError("injected backend failure")
        return [
            ScoreResult(
                np.reshape(
                    [logits(r.query, item, r.label_ids) for item in r.items],
                    (len(r.items), len(r.label_ids)),
                ),
                backend or "fake",
                len(r.query) + sum(map(len, r.items)),
                r.apply_softmax,
                r.classification,
            )
            for r in requests
        ]

    def wait_runs(self, n: int) -> None:
        """Until the n-th run has started."""
        self.wait_for(lambda: len(self.runs) >= n)

    def wait_for(self, predicate) -> None:
        with self.changed:
            assert self.changed.wait_for(predicate, WAIT_S), (self.runs, self.prepared)

    def queries_run(self) -> list[list[int]]:
        return [r.query for _, run in self.runs for r in run]


def request(query, sizes, labels=(1, 2), **options) -> dict:
    return {
        "query": list(query),
        "items": [[7 + i] * n for i, n in enumerate(sizes)],
        "label_token_ids": list(labels),
        **options,
    }


def expected(req: dict) -> np.ndarray:
    labels = list(range(req["classes"])) if "classes" in req else req["label_token_ids"]
    return np.array([logits(req["query"], it, labels) for it in req["items"]], np.float32)


def test_requests_queued_behind_a_run_share_the_next_one():
    fake = FakeScorer()
    released = fake.hold(1)
    with Batcher(fake, max_wait_ms=0) as batcher:
        first = batcher.submit(**request([1], [2]))
        fake.wait_runs(1)
        queued = [batcher.submit(**request([10 + i], [1, 2])) for i in range(10)]
        released.set()
        for future, i in zip(queued, range(10), strict=True):
            np.testing.assert_array_equal(
                future.result(WAIT_S).logprobs, expected(request([10 + i], [1, 2]))
            )
        first.result(WAIT_S)
    assert [len(run) for _, run in fake.runs] == [1, 10]  # coalesced into one run


def test_max_batch_tokens_bounds_each_batch():
    fake = FakeScorer()
    released = fake.hold(1)
    with Batcher(fake, max_wait_ms=0, max_batch_tokens=45) as batcher:
        futures = [batcher.submit(**request([1] * 10, [5, 5]))]  # 20 tokens each
        fake.wait_runs(1)
        futures += [batcher.submit(**request([i] * 10, [5, 5])) for i in range(2, 8)]
        released.set()
        for future in futures:
            future.result(WAIT_S)
    assert [len(run) for _, run in fake.runs] == [1, 2, 2, 2]


@pytest.mark.parametrize("classes", [0, 1, 3])
@pytest.mark.parametrize("softmax", [False, True])
def test_a_split_request_is_joined_into_what_one_run_gives(classes, softmax):
    """Over its per-step cap a request runs in chunks, each within the cap and a whole number
    of its items, and its parts join into the unsplit result: a classification request keeps
    its kind (scores are logits or class probabilities, not exp(logits))."""
    options = {"classes": classes} if classes else {}
    req = request([3, 4], [3, 1, 4, 1, 5, 2, 6], apply_softmax=softmax, **options)
    if classes:
        del req["label_token_ids"]
    fake = FakeScorer()
    with Batcher(fake, max_wait_ms=0, max_request_step_tokens=8) as batcher:
        split = batcher.score(**req)
    alone = fake.run([fake.prepared[0]])[0]
    chunks = [r for _, run in fake.runs[:-1] for r in run]
    assert len(chunks) > 1
    assert all(len(c.query) + sum(map(len, c.items)) <= 8 for c in chunks)
    assert [it for c in chunks for it in c.items] == req["items"]  # in order, each once
    assert (split.classification, split.apply_softmax) == (bool(classes), softmax)
    np.testing.assert_array_equal(split.logprobs, alone.logprobs)
    np.testing.assert_array_equal(split.scores, alone.scores)
    assert split.num_tokens == sum(len(c.query) + sum(map(len, c.items)) for c in chunks)


def test_small_requests_are_not_held_behind_a_huge_one():
    """A small request queued while a step of a huge one runs is scored in the next run: the
    huge one's remainder rejoins the queue behind it. Each run waits for a permit, so the test
    decides when each step ends."""
    fake = FakeScorer()
    fake.permits = threading.Semaphore(0)
    huge = request([9] * 4, [2] * 400)
    with Batcher(fake, max_wait_ms=0, max_batch_tokens=40) as batcher:
        big = batcher.submit(**huge)
        fake.wait_runs(1)
        for i in range(5):
            arrived = len(fake.runs)  # that run is waiting for its permit
            small = request([100 + i], [1, 2])
            future = batcher.submit(**small)
            fake.permits.release(2)  # the run it queued behind, then one more
            np.testing.assert_array_equal(future.result(WAIT_S).logprobs, expected(small))
            runs_with = [
                n for n, (_, run) in enumerate(fake.runs, 1) if small["query"] in run_queries(run)
            ]
            assert runs_with == [arrived + 1], (arrived, runs_with)
            fake.wait_runs(arrived + 2)
        assert not big.done()  # the small ones all went through while it ran
        fake.permits.release(10**6)
        np.testing.assert_array_equal(big.result(WAIT_S).logprobs, expected(huge))
    huge_chunks = [r for _, run in fake.runs for r in run if r.query == huge["query"]]
    assert len(huge_chunks) > 10
    assert all(len(c.query) + sum(map(len, c.items)) <= 40 for c in huge_chunks)


def run_queries(run: list[ScoreRequest]) -> list[list[int]]:
    return [r.query for r in run]


def test_requests_cancelled_while_queued_are_never_scored():
    """Eight requests whose callers leave while they wait behind a long run: all dropped, none
    scored, every time (their cancel precedes their dispatch)."""
    fake = FakeScorer()
    released = fake.hold(1)
    with Batcher(fake, max_wait_ms=0) as batcher:
        long = batcher.submit(**request([1], [50]))
        fake.wait_runs(1)
        left = [batcher.submit(**request([20 + i], [1])) for i in range(8)]
        stays = batcher.submit(**request([30], [1]))
        assert all(f.cancel() for f in left) and batcher.pending == 2
        released.set()
        long.result(WAIT_S)
        stays.result(WAIT_S)
    assert not any([20 + i] in fake.queries_run() for i in range(8))
    assert [len(run) for _, run in fake.runs] == [1, 1] and batcher.pending == 0


def test_async_callers_cancelled_before_dispatch_are_never_scored():
    """The server's path: a task cancelled (its client disconnected) while its request is being
    tokenized, or queued, is never scored."""
    fake = FakeScorer()
    released = fake.hold(1)

    async def main(batcher):
        fake.prepare_gate, fake.preparing = threading.Event(), threading.Event()
        tokenizing = asyncio.ensure_future(batcher.score_async(**request([40], [1])))
        assert await asyncio.to_thread(fake.preparing.wait, WAIT_S)
        tokenizing.cancel()
        gate, fake.prepare_gate = fake.prepare_gate, None
        gate.set()  # tokenized after its caller left: never queued
        queued = [
            asyncio.ensure_future(batcher.score_async(**request([50 + i], [1]))) for i in range(8)
        ]
        await asyncio.to_thread(fake.wait_for, lambda: len(fake.prepared) == 10)
        for task in queued:
            task.cancel()
        results = await asyncio.gather(tokenizing, *queued, return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in results)

    with Batcher(fake, max_wait_ms=0) as batcher:
        first = batcher.submit(**request([1], [5]))
        fake.wait_runs(1)
        asyncio.run(main(batcher))
        assert batcher.pending == 1
        released.set()
        first.result(WAIT_S)
        batcher.score(**request([60], [1]))
    assert [r[0] for r in fake.queries_run()] == [1, 60]


def test_a_request_cancelled_after_dispatch_is_scored_once_and_discarded():
    """Cancelled while its step runs: that step finishes (its batch-mates get their results),
    its result is discarded, and no later step of it is dispatched."""
    fake = FakeScorer()
    released = fake.hold(1)
    with Batcher(fake, max_wait_ms=0, max_request_step_tokens=6) as batcher:
        split = batcher.submit(**request([1], [2, 2, 2, 2]))  # chunks of two items
        fake.wait_runs(1)
        assert split.cancel() and batcher.pending == 0
        released.set()
        after = batcher.score(**request([2], [1]))
    assert [r.query for _, run in fake.runs for r in run] == [[1], [2]]  # one chunk, then next
    np.testing.assert_array_equal(after.logprobs, expected(request([2], [1])))


def test_a_cancel_between_dispatch_and_run_still_runs_the_step(monkeypatch):
    """The dispatch decides: a cancel that lands after the worker took the batch from the queue
    but before it called the scorer does not drop the request from its step (whose outcome
    would then hang on thread timing), it only discards the result."""
    fake = FakeScorer()
    released = fake.hold(1)
    with Batcher(fake, max_wait_ms=0) as batcher:
        original = batcher._run

        def dispatched(batch):
            if len(fake.runs) == 1:  # the batch after the held run: cancel its requests now
                for entry, _ in batch:
                    entry.future.cancel()
            return original(batch)

        monkeypatch.setattr(batcher, "_run", dispatched)
        first = batcher.submit(**request([1], [5]))
        fake.wait_runs(1)
        cancelled = [batcher.submit(**request([70 + i], [1])) for i in range(8)]
        released.set()
        first.result(WAIT_S)
        batcher.score(**request([80], [1]))
    assert all(f.cancelled() for f in cancelled)
    assert [len(run) for _, run in fake.runs] == [1, 8, 1]  # dispatched, so run, then dropped


def test_a_deadline_passing_in_the_queue_fails_it_unscored():
    fake = FakeScorer()
    released = fake.hold(1)
    with Batcher(fake, max_wait_ms=0) as batcher:
        first = batcher.submit(**request([1], [5]))
        fake.wait_runs(1)
        late = batcher.submit(**request([90], [1]), timeout_s=0.01)
        with pytest.raises(DeadlineExceeded):
            late.result(WAIT_S)  # while the worker is still held in the first run
        assert len(fake.runs) == 1 and batcher.pending == 1
        released.set()
        first.result(WAIT_S)
    assert [90] not in fake.queries_run()


def test_a_deadline_past_the_platforms_longest_wait_keeps_the_deadline_thread():
    """A timeout longer than a thread can wait (threading.TIMEOUT_MAX, some 292 years) is no
    deadline in practice; it must not kill the thread that enforces everyone else's."""
    fake = FakeScorer()
    released = fake.hold(1)
    with Batcher(fake, max_wait_ms=0) as batcher:
        far = batcher.submit(**request([1], [5]), timeout_s=1e300)
        fake.wait_runs(1)
        late = batcher.submit(**request([90], [1]), timeout_s=0.01)
        with pytest.raises(DeadlineExceeded):
            late.result(WAIT_S)  # while the worker is still held in the first run
        released.set()
        far.result(WAIT_S)
    assert [90] not in fake.queries_run()


class WatchedCondition:
    """A Batcher's condition, noting when its worker begins a timed wait (for a batch to fill)."""

    def __init__(self, condition: threading.Condition):
        self.condition, self.timed_wait = condition, threading.Event()

    def wait(self, timeout=None):
        if timeout is not None:
            self.timed_wait.set()
        return self.condition.wait(timeout)

    def __getattr__(self, name):
        return getattr(self.condition, name)


def test_a_max_wait_past_the_platforms_longest_wait_keeps_the_worker():
    """max_wait_ms longer than a thread can wait still runs a batch once it is full (the worker
    thread survives its wait); an infinite one is refused."""
    with pytest.raises(ValueError, match="max_wait_ms"):
        Batcher(FakeScorer(), max_wait_ms=float("inf"))
    fake = FakeScorer()
    with Batcher(fake, max_wait_ms=1e13, max_batch_tokens=8) as batcher:
        batcher._cond = watched = WatchedCondition(batcher._cond)
        small = batcher.submit(**request([1], [1]))  # 2 tokens: the worker waits for more
        assert watched.timed_wait.wait(WAIT_S)
        full = batcher.submit(**request([2], [3, 4]))  # 8: the batches fill, and run
        np.testing.assert_array_equal(small.result(WAIT_S).logprobs, expected(request([1], [1])))
        np.testing.assert_array_equal(full.result(WAIT_S).logprobs, expected(request([2], [3, 4])))


def test_a_deadline_passing_during_tokenization_answers_before_it_ends():
    fake = FakeScorer()
    fake.prepare_gate = gate = threading.Event()

    async def main(batcher):
        with pytest.raises(DeadlineExceeded):
            await batcher.score_async(**request([3], [1]), timeout_s=0.01)
        assert not gate.is_set()  # answered while still tokenizing
        gate.set()

    with Batcher(fake) as batcher:
        asyncio.run(main(batcher))
    assert fake.runs == []


def test_admission_refuses_past_max_pending_and_queued_tokens_before_preparing():
    fake = FakeScorer()
    released = fake.hold(1)
    with Batcher(fake, max_pending=3, max_queued_tokens=20, max_wait_ms=0) as batcher:
        futures = [batcher.submit(**request([1], [5]))]
        fake.wait_runs(1)
        futures.append(batcher.submit(**request([2], [5])))  # 6 tokens queued
        with pytest.raises(Overloaded, match="max_queued_tokens=20"):
            batcher.submit(**request([3], [30]))
        futures.append(batcher.submit(**request([4], [5])))
        with pytest.raises(Overloaded, match="max_pending=3"):
            batcher.submit(**request([5], [1]))
        assert len(fake.prepared) == 3  # the refused ones were never prepared
        released.set()
        for future in futures:
            future.result(WAIT_S)
        batcher.score(**request([3], [30]))  # nothing else queued: admitted whatever its size


def test_admission_reads_a_numpy_column_and_counts_overlapping_chunks_before_preparing():
    """A numpy column of items is estimated as its list, and a chunked request by its chunks'
    tokens (a stride of 1 holds a token up to window times): each refused past
    max_queued_tokens before it is prepared, as a list of its size is."""
    fake = FakeScorer()
    released = fake.hold(1)
    with Batcher(fake, max_queued_tokens=100, max_wait_ms=0) as batcher:
        futures = [batcher.submit(**request([1], [5]))]
        fake.wait_runs(1)
        futures.append(batcher.submit(**request([2], [5])))  # 6 tokens queued
        column = np.array(["word " * 80])  # 400 bytes: ~100 tokens
        with pytest.raises(Overloaded, match="max_queued_tokens=100"):
            batcher.submit(query=[1], items=column, label_token_ids=[1])
        document = list(range(1, 41))  # 40 tokens: 25 chunks of 16 with a stride of 1
        overlapping = {"window": 16, "stride": 1}
        with pytest.raises(Overloaded, match="max_queued_tokens=100"):
            batcher.submit(query=[1], items=[document], label_token_ids=[1], chunking=overlapping)
        assert len(fake.prepared) == 2  # the refused ones were never prepared
        released.set()
        for future in futures:
            future.result(WAIT_S)


def test_a_failure_reaches_only_the_callers_of_its_run_and_bad_input_only_its_caller():
    fake = FakeScorer()
    released = fake.hold(1)
    with Batcher(fake, max_wait_ms=0) as batcher:
        first = batcher.submit(**request([1], [5]))
        fake.wait_runs(1)
        failing = [batcher.submit(**request([i], [1]), backend="failing") for i in (2, 3)]
        others = [batcher.submit(**request([i], [1])) for i in (4, 5)]
        with pytest.raises(ValidationError) as bad:
            batcher.submit(**request([6], [1]), backend="nope")
        assert (bad.value.code, bad.value.loc) == ("unknown_backend", ("backend",))
        with pytest.raises(ValidationError) as unknown:
            batcher.submit(**request([6], [1]), colour=1)
        assert unknown.value.loc == ("colour",)
        released.set()
        for future in failing:
            with pytest.raises(RuntimeError, match="injected"):
                future.result(WAIT_S)
        for future in [first, *others]:
            future.result(WAIT_S)
        assert batcher.pending == 0
    assert sorted(len(run) for backend, run in fake.runs[1:]) == [2, 2]  # one run per backend


def test_close_finishes_what_was_accepted_then_refuses():
    fake = FakeScorer()
    released = fake.hold(1)
    batcher = Batcher(fake, max_wait_ms=0)
    futures = [batcher.submit(**request([i], [2])) for i in range(4)]
    fake.wait_runs(1)
    closing = threading.Event()
    original = batcher._worker.join

    def join(*args):  # close() has refused new requests and now waits for the worker
        closing.set()
        return original(*args)

    batcher._worker.join = join
    closer = threading.Thread(target=batcher.close)
    closer.start()
    assert closing.wait(WAIT_S)
    with pytest.raises(RuntimeError, match="closed"):
        batcher.submit(**request([9], [1]))
    assert not any(f.done() for f in futures)  # accepted, not yet finished
    released.set()
    closer.join(WAIT_S)
    assert not closer.is_alive()
    for future, i in zip(futures, range(4), strict=True):
        np.testing.assert_array_equal(future.result().logprobs, expected(request([i], [2])))
    batcher.close()  # again: nothing happens


def test_an_empty_request_and_equal_parts_keep_their_shape():
    fake = FakeScorer()
    with Batcher(fake, max_wait_ms=0) as batcher:
        empty = batcher.score(**request([1], []))
    assert empty.logprobs.shape == (0, 2)
    parts = [attrs.evolve(ScoreResult.empty(2, False), backend="x")] * 2
    assert ScoreResult.concat(parts).logprobs.shape == (0, 2)
