"""The Batcher's queue and its two threads: what happens to a request once it is queued.

`BatchQueue` is the half of `Batcher` (batcher.py) that runs behind its callers, mixed into it
as the endpoints' classes are mixed into `Service`: the queue's bookkeeping under the Batcher's
lock, the worker thread that takes each batch from the queue by tokens and runs it (one
`scorer.run` per backend), and the deadline thread that fails each request at its deadline.
`Batcher` owns the state it reads (declared below) and admits, prepares and queues requests.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import TYPE_CHECKING, Any

import attrs

from tpuscore.api.errors import ValidationError
from tpuscore.api.requests import ScoreRequest
from tpuscore.api.results import ScoreResult

if TYPE_CHECKING:
    from tpuscore.serving.batcher import Scoring

logger = logging.getLogger(__name__)


class DeadlineExceeded(TimeoutError):
    """A request's deadline passed before its result was ready. It was dropped without being
    scored (or, if a step was running it then, its result discarded). A server answers 504."""

    def __init__(self, timeout_s: float):
        super().__init__(
            f"the request was not scored within its timeout of {timeout_s:g} s; "
            "retry with a longer timeout or when the server is less loaded"
        )
        self.timeout_s = timeout_s


@dataclasses.dataclass(eq=False)
class Pending:
    """An accepted request: admitted, then prepared (tokenized) and queued until its last item is
    scored. `settled` turns true once, under the batcher's lock, when it leaves the batcher."""

    backend: str | None
    future: Future
    timeout_s: float | None
    deadline: float | None  # time.monotonic()
    estimate: int  # tokens reserved at admission, until the request is tokenized
    request: ScoreRequest | None = None
    # The result its caller gets from the request's (a chunked request's documents' from its
    # chunks'); None: the request's own.
    finish: Callable[[ScoreResult], Any] | None = None
    enqueued: float = 0.0  # time.monotonic() when it (or its remainder) last joined the queue
    done_items: int = 0
    parts: list[ScoreResult] = dataclasses.field(default_factory=list)
    settled: bool = False
    queued: bool = False

    @property
    def tokens_left(self) -> int:
        request = self.request
        return len(request.query) + sum(map(len, request.items[self.done_items :]))


class BatchQueue:
    """The queue's bookkeeping, the worker and the deadline thread of a `Batcher`, over the
    state `Batcher.__init__` sets up (declared here); the queue changes only under `_lock`."""

    scorer: Scoring
    max_wait_ms: float
    max_batch_tokens: int
    max_request_step_tokens: int
    on_batched: Callable[[float], None] | None
    _lock: threading.RLock
    _cond: threading.Condition  # the worker waits on it
    _timer: threading.Condition  # the deadline thread waits on it
    _queue: collections.deque[Pending]
    _queued_tokens: int
    _admitting: int
    _pending: int
    _deadlines: list[tuple[float, int, Pending]]
    _closed: bool
    _stopped: bool

    # -- the queue (under the lock) -------------------------------------------------------------

    def _enqueue(self, entry: Pending) -> None:
        entry.enqueued = time.monotonic()
        entry.queued = True
        self._queue.append(entry)
        self._queued_tokens += entry.tokens_left

    def _dequeue(self, entry: Pending) -> None:
        if entry.queued:
            entry.queued = False
            self._queue.remove(entry)
            self._queued_tokens -= entry.tokens_left

    def _settle(self, entry: Pending) -> bool:
        """Take the request out of the batcher, once: True for the caller that did (and then
        completes its future), False if it was already out."""
        with self._lock:
            if entry.settled:
                return False
            entry.settled = True
            self._pending -= 1
            self._dequeue(entry)
            self._cond.notify_all()
            return True

    def _expire(self, entry: Pending) -> None:
        if self._settle(entry):
            logger.info("a request passed its %g s deadline: dropped", entry.timeout_s)
            complete(entry.future, error=DeadlineExceeded(entry.timeout_s))

    def _expire_due(self) -> None:
        """The deadline thread: fails each request at its deadline, whatever the worker does."""
        with self._lock:
            while not self._stopped:
                now = time.monotonic()
                while self._deadlines and self._deadlines[0][0] <= now:
                    self._expire(heapq.heappop(self._deadlines)[2])
                while self._deadlines and self._deadlines[0][2].settled:
                    heapq.heappop(self._deadlines)
                # A wait past TIMEOUT_MAX (a timeout of centuries) raises OverflowError.
                due = self._deadlines[0][0] - now if self._deadlines else None
                self._timer.wait(None if due is None else min(due, threading.TIMEOUT_MAX))

    # -- the worker ----------------------------------------------------------------------------

    def _serve(self) -> None:
        while (batch := self._next_batch()) is not None:
            start = time.perf_counter()
            outcomes = self._run(batch)
            for (entry, chunk), (result, error) in zip(batch, outcomes, strict=True):
                if error is not None:
                    if self._settle(entry):
                        complete(entry.future, error=error)
                elif result is not None:
                    self._advance(entry, len(chunk.items), result)
            logger.debug(
                "batch of %d requests, %d tokens, in %.1f ms",
                len(batch),
                sum(step_tokens(chunk) for _, chunk in batch),
                1e3 * (time.perf_counter() - start),
            )

    def _advance(self, entry: Pending, num_items: int, result: ScoreResult) -> None:
        """A batch scored the next num_items of the request: finish it, or queue its remainder
        at the end of the queue (unless it was settled while its batch ran)."""
        with self._lock:
            if entry.settled:
                return
            entry.parts.append(result)
            entry.done_items += num_items
            if entry.done_items < len(entry.request.items):
                self._enqueue(entry)
                self._cond.notify_all()
                return
        if self._settle(entry):  # before its caller wakes, so that it may submit at once
            try:
                result = ScoreResult.concat(entry.parts)
                if entry.finish is not None:
                    result = entry.finish(result)
            except Exception as error:  # its caller's, not the worker's: it serves on
                complete(entry.future, error=error)
                return
            complete(entry.future, result=result)

    def _next_batch(self) -> list[tuple[Pending, ScoreRequest]] | None:
        """Wait for requests, then until the batch is full or its oldest has waited max_wait_ms
        (not at all once closed); None when closed and drained. Takes each request's next
        chunk in queue order, dropping those past their deadline."""
        with self._lock:
            while True:
                self._drop_expired()
                if self._queue:
                    break
                if self._closed and not self._admitting:
                    return None
                self._cond.wait()
            deadline = self._queue[0].enqueued + self.max_wait_ms / 1e3
            while not self._closed and self._queued_tokens < self.max_batch_tokens:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, threading.TIMEOUT_MAX))
            self._drop_expired()
            batch: list[tuple[Pending, ScoreRequest]] = []
            room = self.max_batch_tokens
            now = time.monotonic()
            for entry in list(self._queue):
                chunk = self._chunk(entry, room, first=not batch)
                if chunk is None:
                    break
                self._dequeue(entry)
                if entry.done_items == 0 and self.on_batched is not None:
                    self.on_batched(now - entry.enqueued)
                batch.append((entry, chunk))
                room -= step_tokens(chunk)
            return batch

    def _drop_expired(self) -> None:
        now = time.monotonic()
        for entry in [e for e in self._queue if e.deadline is not None and e.deadline <= now]:
            self._expire(entry)

    def _chunk(self, entry: Pending, room: int, *, first: bool) -> ScoreRequest | None:
        """The request's next items that fit the batch's room and the per-request cap (at least
        one when the batch is empty); None when they do not fit. A request within the cap is
        never split, so it keeps the exact scores of running alone."""
        request, start = entry.request, entry.done_items
        left = entry.tokens_left
        if left <= self.max_request_step_tokens and (first or left <= room):
            items = request.items[start:]
        elif left <= self.max_request_step_tokens:
            return None
        else:
            limit = min(room, self.max_request_step_tokens)
            end, tokens = start, len(request.query)
            while end < len(request.items) and tokens + len(request.items[end]) <= limit:
                tokens += len(request.items[end])
                end += 1
            if end == start:
                if not first:
                    return None
                end = start + 1
            items = request.items[start:end]
        if start == 0 and len(items) == len(request.items):
            return request
        return attrs.evolve(request, items=items)

    def _run(
        self, batch: list[tuple[Pending, ScoreRequest]]
    ) -> list[tuple[ScoreResult | None, Exception | None]]:
        """(result, error) per chunk: one `scorer.run` per backend named in the batch. Every
        chunk runs: its request was live when the batch was dispatched, and one settled since
        (cancelled, past its deadline) has its result discarded by `_advance`, so that whether
        a request is scored never depends on how far the worker got when it was cancelled."""
        outcomes: list[tuple[ScoreResult | None, Exception | None]] = [(None, None)] * len(batch)
        by_backend: dict[str | None, list[int]] = {}
        for i, (entry, _) in enumerate(batch):
            by_backend.setdefault(entry.backend, []).append(i)
        for backend, members in by_backend.items():
            requests = [batch[i][1] for i in members]
            try:
                results = self.scorer.run(requests, backend=backend)
            except ValidationError:
                # The plan refused a request before anything ran (a backend unregistered since
                # submission, say): run each alone, so that only its caller gets the error.
                for i in members:
                    outcomes[i] = self._run_alone(batch[i][1], backend)
                continue
            except Exception as error:  # the step failed: its callers get the error
                logger.warning("a batch of %d requests failed: %r", len(members), error)
                for i in members:
                    outcomes[i] = (None, error)
                continue
            for i, result in zip(members, results, strict=True):
                outcomes[i] = (result, None)
        return outcomes

    def _run_alone(
        self, request: ScoreRequest, backend: str | None
    ) -> tuple[ScoreResult | None, Exception | None]:
        try:
            return self.scorer.run([request], backend=backend)[0], None
        except Exception as error:
            return None, error


def step_tokens(request: ScoreRequest) -> int:
    return len(request.query) + sum(map(len, request.items))


def complete(future: Future, *, result: Any = None, error: BaseException | None = None) -> None:
    """Finish a future unless its caller cancelled it meanwhile."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
