"""A request batcher for services: concurrent callers share device steps.

A ranking service receives many small concurrent requests, each a query and a page of items. Run
one by one, each is a device step of a few hundred tokens on a chip built for far more. The
`Batcher` collects requests from any number of threads or event loops and hands them to the
scorer together, the shape of Ray Serve's `@serve.batch` and TEI's queue: a bounded queue, one
worker thread, a future back to each caller.

    with Batcher(scorer, max_wait_ms=2.0) as batcher:
        result = batcher.score(query=q, items=items, labels=[" yes", " no"])  # from any thread
        result = await batcher.score_async(query=q, items=items, labels=[" yes", " no"])

A request is validated when it is submitted (as `scorer.prepare` does), in the caller's thread,
so a bad input raises at its caller and never reaches a batch. The worker runs each batch as one
`scorer.run` call per backend named in it; a failure there fails the requests of that call only,
and the worker goes on with the next batch.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

from tpuscore.api import validation
from tpuscore.api.errors import ValidationError
from tpuscore.api.requests import ScoreRequest
from tpuscore.api.results import ScoreResult
from tpuscore.backends import registry

logger = logging.getLogger(__name__)

# Query plus item tokens per batch. 8192 holds about 20 requests of SGLang's benchmark geometry
# (a 300-token query, 10 items of 10 tokens): enough to fill an accelerator step, while one batch
# still finishes in tens of milliseconds there. The backends split a batch into steps by their own
# memory budgets, so this bounds the wait of a batch's last request, not device memory.
DEFAULT_MAX_BATCH_TOKENS = 8192


class Overloaded(RuntimeError):
    """The batcher already holds `max_pending` unfinished requests: the submission is refused at
    once instead of queueing without bound. Retry later; a server answers 503."""

    def __init__(self, max_pending: int):
        super().__init__(
            f"the batcher already holds max_pending={max_pending} unfinished requests; "
            "retry later or raise max_pending"
        )
        self.max_pending = max_pending


@dataclasses.dataclass(frozen=True)
class _Pending:
    request: ScoreRequest
    backend: str | None
    tokens: int
    future: Future
    enqueued: float  # time.monotonic()


class Batcher:
    """Coalesces concurrent `score` calls on one scorer into shared `scorer.run` calls.

    A batch closes when it holds `max_batch_tokens` query and item tokens (default
    `DEFAULT_MAX_BATCH_TOKENS`; a larger request runs alone) or when its oldest request has
    waited `max_wait_ms`; `max_wait_ms=0` runs whatever is queued as soon as the worker is free.
    `max_pending` bounds the requests accepted and not yet finished (queued or running); past
    it a submission raises `Overloaded`.

    Each caller gets what `scorer.score` would return for its request alone: bit-identical when
    its batch holds no other request with the same query, labels and item_first, and within
    1e-5 (float32) when it does (`scorer.run` then scores their items in one backend call, with
    other padding). Requests naming different backends (`backend=`) run in separate calls.

    Close it (`close()` or a `with` block): that finishes every accepted request, then refuses
    new ones. Its worker is a daemon thread, so an unclosed batcher does not block exit.
    """

    def __init__(
        self,
        scorer: Any,
        *,
        max_wait_ms: float = 2.0,
        max_batch_tokens: int | None = None,
        max_pending: int = 1024,
    ):
        if isinstance(max_wait_ms, bool) or not isinstance(max_wait_ms, (int, float)):
            raise ValueError(f"max_wait_ms must be a number of milliseconds, got {max_wait_ms!r}")
        if not max_wait_ms >= 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms!r}")
        if max_batch_tokens is None:
            max_batch_tokens = DEFAULT_MAX_BATCH_TOKENS
        for name, value in (("max_batch_tokens", max_batch_tokens), ("max_pending", max_pending)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.scorer = scorer
        self.max_wait_ms = float(max_wait_ms)
        self.max_batch_tokens = max_batch_tokens
        self.max_pending = max_pending
        self._queue: collections.deque[_Pending] = collections.deque()
        self._queued_tokens = 0
        self._pending = 0  # accepted and not finished: queued or running
        self._closed = False
        self._cond = threading.Condition()
        self._worker = threading.Thread(target=self._serve, name="tpuscore-batcher", daemon=True)
        self._worker.start()

    @property
    def pending(self) -> int:
        """Requests accepted and not yet finished (queued or running)."""
        return self._pending

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, **score_kwargs: Any) -> Future[ScoreResult]:
        """Validate a request (`scorer.score`'s keyword arguments) and queue it.

        Returns:
            A future of the request's `ScoreResult`, or of the error its backend step raised.

        Raises:
            ValidationError: a bad request or an unknown backend, as `scorer.score` raises it.
            Overloaded: `max_pending` requests are already unfinished.
            RuntimeError: the batcher is closed.
        """
        self._check_open()
        backend = score_kwargs.pop("backend", None)
        query, items, options = validation.request_arguments(score_kwargs)
        request = self.scorer.engine.prepare(query, items, options)
        name = self.scorer.engine.backend_name(backend)
        if name != registry.AUTO:  # "auto" picks per group, at run time, a backend that can
            registry.check_capabilities(name, request.item_first)
        tokens = len(request.query) + sum(map(len, request.items))
        future: Future[ScoreResult] = Future()
        with self._cond:
            self._check_open()
            if self._pending >= self.max_pending:
                raise Overloaded(self.max_pending)
            self._pending += 1
            self._queue.append(_Pending(request, backend, tokens, future, time.monotonic()))
            self._queued_tokens += tokens
            self._cond.notify()
        return future

    def score(self, **score_kwargs: Any) -> ScoreResult:
        """`scorer.score(**score_kwargs)`, sharing device steps with concurrent callers; blocks
        until the result is ready. Safe from any thread. Raises as `submit` does, or the error of
        the backend step that ran the request."""
        return self.submit(**score_kwargs).result()

    async def score_async(self, **score_kwargs: Any) -> ScoreResult:
        """`score` for asyncio: validation runs in the caller's event loop thread, the scoring in
        the batcher's worker while the loop serves other tasks."""
        return await asyncio.wrap_future(self.submit(**score_kwargs))

    def close(self) -> None:
        """Finish every accepted request, then stop; later submissions raise RuntimeError.
        Blocks until the queue is drained. Calling it again does nothing."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if threading.current_thread() is not self._worker:
            self._worker.join()

    def __enter__(self) -> Batcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Batcher is closed and accepts no new requests")

    # -- the worker ----------------------------------------------------------------------------

    def _serve(self) -> None:
        while (batch := self._next_batch()) is not None:
            start = time.perf_counter()
            outcomes = self._run(batch)
            with self._cond:
                self._pending -= len(batch)  # before callers wake, so they may submit at once
            for pending, (result, error) in zip(batch, outcomes, strict=True):
                if error is not None:
                    pending.future.set_exception(error)
                elif result is not None:
                    pending.future.set_result(result)
            logger.debug(
                "batch of %d requests, %d tokens, in %.1f ms",
                len(batch),
                sum(p.tokens for p in batch),
                1e3 * (time.perf_counter() - start),
            )

    def _next_batch(self) -> list[_Pending] | None:
        """Wait for requests, then until the batch is full or its oldest has waited max_wait_ms
        (not at all once closed); None when closed and drained."""
        with self._cond:
            while not self._queue:
                if self._closed:
                    return None
                self._cond.wait()
            deadline = self._queue[0].enqueued + self.max_wait_ms / 1e3
            while not self._closed and self._queued_tokens < self.max_batch_tokens:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            batch, tokens = [], 0
            while self._queue and (
                not batch or tokens + self._queue[0].tokens <= self.max_batch_tokens
            ):
                batch.append(self._queue.popleft())
                tokens += batch[-1].tokens
            self._queued_tokens -= tokens
            return batch

    def _run(self, batch: list[_Pending]) -> list[tuple[ScoreResult | None, Exception | None]]:
        """(result, error) per request: one `scorer.run` per backend named in the batch. A
        request its caller cancelled meanwhile gets (None, None) and is not run."""
        outcomes: list[tuple[ScoreResult | None, Exception | None]] = [(None, None)] * len(batch)
        by_backend: dict[str | None, list[int]] = {}
        for i, pending in enumerate(batch):
            if pending.future.set_running_or_notify_cancel():
                by_backend.setdefault(pending.backend, []).append(i)
        for backend, members in by_backend.items():
            requests = [batch[i].request for i in members]
            try:
                results = self.scorer.run(requests, backend=backend)
            except ValidationError:
                # The plan refused a request before anything ran (a backend unregistered since
                # submission, say): run each alone, so that only its caller gets the error.
                for i in members:
                    outcomes[i] = self._run_alone(batch[i])
                continue
            except Exception as error:  # the step failed: its callers get the error
                logger.warning("a batch of %d requests failed: %r", len(members), error)
                for i in members:
                    outcomes[i] = (None, error)
                continue
            for i, result in zip(members, results, strict=True):
                outcomes[i] = (result, None)
        return outcomes

    def _run_alone(self, pending: _Pending) -> tuple[ScoreResult | None, Exception | None]:
        try:
            return self.scorer.run([pending.request], backend=pending.backend)[0], None
        except Exception as error:
            return None, error
