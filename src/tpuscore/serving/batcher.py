"""A request batcher for services: concurrent callers share device steps, within bounds.

A ranking service receives many small concurrent requests, each a query and a page of items. Run
one by one, each is a device step of a few hundred tokens on a chip built for far more. The
`Batcher` collects requests from any number of threads or event loops and hands them to the
scorer together, the shape of Ray Serve's `@serve.batch` and TEI's queue: a bounded queue, one
worker thread, a future back to each caller.

    with Batcher(scorer, max_wait_ms=2.0, request_timeout_s=30) as batcher:
        result = batcher.score(query=q, items=items, labels=[" yes", " no"])  # from any thread
        result = await batcher.score_async(query=q, items=items, labels=[" yes", " no"])

A long-lived service bounds everything it holds, and spends no work on a request nobody waits for:

- Admission before cost: a submission is refused (`Overloaded`) on queue depth and on a token
  estimate from the text's byte length, before anything is tokenized. Then the request is
  validated and tokenized (`scorer.prepare_request`): in the caller's thread for `submit` and
  `score`, in a small bounded thread pool for `score_async`, so an event loop keeps serving
  meanwhile. A bad input raises at its caller and never reaches a batch.
- Deadlines and cancellation: a request carries a deadline (`timeout_s`, default the batcher's
  `request_timeout_s`). At its deadline its future fails with `DeadlineExceeded`; a caller may
  cancel its future (`score_async` does when its task is cancelled, as on a client disconnect).
  The outcome depends only on the order of that and the dispatch of the request's next step
  (the worker taking it from the queue, under the batcher's lock): before, the request leaves
  the queue and is never scored; after, the dispatched step is finished with its batch and its
  result discarded, and no later step of it is dispatched.
- Fairness: the worker schedules by tokens. Each batch takes at most `max_request_step_tokens`
  of one request's query and item tokens, and a request with items left goes back to the end
  of the queue, so a 4,096-item request runs as a series of steps between which small requests
  run: a small request waits at most about two batches, not the whole large request.
- A failure is contained: the worker runs each batch as one `scorer.run` call per backend named
  in it, and a failure there fails the requests of that call only.

This module is the callers' side (construction, admission, preparation, close); the queue's
bookkeeping, the worker and the deadline thread are `batch_queue.py`'s.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from tpuscore.api.errors import ValidationError
from tpuscore.api.requests import ScoreRequest
from tpuscore.api.results import ScoreResult
from tpuscore.serving.admission import (
    DEFAULT_TOKENIZE_WORKERS,
    Overloaded,
    check_options,
    estimate_tokens,
    is_positive_seconds,
)
from tpuscore.serving.batch_queue import BatchQueue, Pending, complete
from tpuscore.serving.batch_queue import DeadlineExceeded as DeadlineExceeded
from tpuscore.tasks.chunking import ChunkedRequest, ChunkedResult

# Query plus item tokens per batch. 8192 holds about 20 requests of SGLang's benchmark geometry
# (a 300-token query, 10 items of 10 tokens): enough to fill an accelerator step, while one batch
# still finishes in tens of milliseconds there. The backends split a batch into steps by their own
# memory budgets, so this bounds the wait of a batch's last request, not device memory.
DEFAULT_MAX_BATCH_TOKENS = 8192


class Scoring(Protocol):
    """What the Batcher needs of a `Scorer`: prepare a request given as a mapping of `score`'s
    arguments (a `ChunkedRequest` where it has `chunking`: the Batcher runs its chunks and reads
    them back as its documents'), and run prepared requests together. Any object with these two
    calls will do (the scheduling tests run a fake one that compiles nothing)."""

    def prepare_request(
        self, request: Mapping[str, Any], *, backend: str | None = None
    ) -> ScoreRequest | ChunkedRequest: ...

    def run(
        self, requests: Sequence[ScoreRequest], *, backend: str | None = None
    ) -> list[ScoreResult]: ...


class Batcher(BatchQueue):
    """Coalesces concurrent `score` calls on one scorer into shared `scorer.run` calls.

    A batch closes when it holds `max_batch_tokens` query and item tokens (default
    `DEFAULT_MAX_BATCH_TOKENS`) or when its oldest request has waited `max_wait_ms`;
    `max_wait_ms=0` runs whatever is queued as soon as the worker is free. One request gives a
    batch at most `max_request_step_tokens` (default `max_batch_tokens`) of its tokens, a whole
    number of its items (at least one); a larger request runs over several batches, rejoining
    the end of the queue after each.

    `max_pending` bounds the requests accepted and not yet finished (tokenizing, queued or
    running); `max_queued_tokens` (default no bound) the tokens they hold, estimated from the
    text's byte length until tokenized. Past either a submission raises `Overloaded`, before its
    text is tokenized; a request is never refused for tokens when nothing else is queued.
    `request_timeout_s` (default None: none) is every request's deadline unless a call gives its
    own `timeout_s`.

    Each caller gets what `scorer.score` would return for its request alone, within the
    batch-composition bound (docs/batch-invariance.md: |batched - alone| <= 5e-5 + 1e-5 x |alone|
    in float32): a batch's requests share device steps, whose row counts and padding change
    float32 rounding (a request batched with six others of different queries moved by up to
    9.5e-7 on a tiny model). Bit-identical when it runs alone, in one batch, or on a scorer built
    with `batch_invariant=True`. Requests naming different backends (`backend=`) run in separate
    calls. A request run over several batches reports the backends that ran it joined by "+"
    when they differ, and the tokens of every batch (its query once per batch).

    Close it (`close()` or a `with` block): that finishes every accepted request, then refuses
    new ones. Its threads are daemons, so an unclosed batcher does not block exit.
    """

    def __init__(
        self,
        scorer: Scoring,
        *,
        max_wait_ms: float = 2.0,
        max_batch_tokens: int | None = None,
        max_pending: int = 1024,
        max_request_step_tokens: int | None = None,
        max_queued_tokens: int | None = None,
        request_timeout_s: float | None = None,
        tokenize_workers: int = DEFAULT_TOKENIZE_WORKERS,
    ):
        check_options(
            max_wait_ms=max_wait_ms,
            max_batch_tokens=max_batch_tokens,
            max_pending=max_pending,
            max_request_step_tokens=max_request_step_tokens,
            max_queued_tokens=max_queued_tokens,
            request_timeout_s=request_timeout_s,
            tokenize_workers=tokenize_workers,
        )
        if max_batch_tokens is None:
            max_batch_tokens = DEFAULT_MAX_BATCH_TOKENS
        if max_request_step_tokens is None:
            max_request_step_tokens = max_batch_tokens
        self.scorer = scorer
        self.max_wait_ms = float(max_wait_ms)
        self.max_batch_tokens = max_batch_tokens
        self.max_pending = max_pending
        self.max_request_step_tokens = max_request_step_tokens
        self.max_queued_tokens = max_queued_tokens
        self.request_timeout_s = request_timeout_s
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)  # the worker waits on it
        self._timer = threading.Condition(self._lock)  # the deadline thread waits on it
        self._queue: collections.deque[Pending] = collections.deque()
        self._queued_tokens = 0  # tokens left of the queued requests
        self._admitting = 0  # accepted requests not yet tokenized
        self._admitting_tokens = 0  # their estimates
        self._pending = 0  # accepted and not settled
        self._reserved_tokens = 0  # estimates of the work run beside the batches (`reserve`)
        self._deadlines: list[tuple[float, int, Pending]] = []  # a heap
        self._sequence = itertools.count()
        self._closed = False
        self._stopped = False  # the worker has drained the queue: the deadline thread ends
        self._tokenize_workers = tokenize_workers
        self._tokenizer_pool: ThreadPoolExecutor | None = None
        # Called, under the lock, with a request's seconds in the queue when its first items
        # enter a batch (the server's queue-time metric); must be quick.
        self.on_batched: Callable[[float], None] | None = None
        self._worker = threading.Thread(target=self._serve, name="tpuscore-batcher", daemon=True)
        self._reaper = threading.Thread(
            target=self._expire_due, name="tpuscore-batcher-deadlines", daemon=True
        )
        self._worker.start()
        self._reaper.start()

    @property
    def pending(self) -> int:
        """Requests accepted and not yet finished (tokenizing, queued or running)."""
        return self._pending

    def counts(self) -> tuple[int, int]:
        """(waiting, running): requests accepted and not in the running batch (tokenizing or
        queued, a split request's remainder too), and those the running batch holds."""
        with self._lock:
            waiting = self._admitting + len(self._queue)
            return waiting, max(self._pending - waiting, 0)

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(
        self, *, timeout_s: float | None = None, **score_kwargs: Any
    ) -> Future[ScoreResult | ChunkedResult]:
        """Admit a request (`scorer.score`'s keyword arguments, `chunking` too), validate it and
        queue it. A chunked request's chunks are its items here (its batches, its share of a
        batch) and its result is `score(chunking=)`'s `ChunkedResult`.

        Args:
            timeout_s: seconds from now until the request's deadline (default the batcher's
                `request_timeout_s`).

        Returns:
            A future of the request's `ScoreResult`, or of the error its backend step raised, or
            of `DeadlineExceeded`. Cancel it to drop the request: it is then never scored,
            unless its next step was already dispatched (then that result is discarded).

        Raises:
            ValidationError: a bad request, an unknown backend or a bad timeout_s, as
                `scorer.score` raises it.
            Overloaded: `max_pending` requests (or `max_queued_tokens` tokens) are already
                unfinished.
            RuntimeError: the batcher is closed.
        """
        entry = self._admit(score_kwargs, timeout_s)
        self._prepare(entry, score_kwargs)
        return entry.future

    def score(
        self, *, timeout_s: float | None = None, **score_kwargs: Any
    ) -> ScoreResult | ChunkedResult:
        """`scorer.score(**score_kwargs)`, sharing device steps with concurrent callers; blocks
        until the result is ready. Safe from any thread. Raises as `submit` does, or the error of
        the backend step that ran the request, or `DeadlineExceeded`."""
        return self.submit(timeout_s=timeout_s, **score_kwargs).result()

    async def score_async(
        self, *, timeout_s: float | None = None, **score_kwargs: Any
    ) -> ScoreResult | ChunkedResult:
        """`score` for asyncio: admission runs in the event loop, tokenization in the batcher's
        tokenizer threads and scoring in its worker while the loop serves other tasks. Cancelling
        the awaiting task (a server does when its client disconnects) drops the request."""
        entry = self._admit(score_kwargs, timeout_s)
        loop = asyncio.get_running_loop()
        prepared = loop.run_in_executor(self._tokenizers(), self._prepare, entry, score_kwargs)
        prepared.add_done_callback(_retrieved)  # its error is the future's too
        try:
            # The future finishes on a bad request too, and at its deadline even while the
            # request is being tokenized.
            return await asyncio.wrap_future(entry.future)
        except asyncio.CancelledError:
            entry.future.cancel()
            raise

    def reserve(self, tokens: int) -> Callable[[], None]:
        """A place for work run beside the batches (a server's /v1/completions request, which
        scores its prompts itself): counted under max_pending, its ~tokens under
        max_queued_tokens, and as running, until the returned release is called (once; a later
        call does nothing). Raises Overloaded and RuntimeError as `submit` does."""
        with self._lock:
            self._check_open()
            self._check_room(tokens)
            self._pending += 1
            self._reserved_tokens += tokens
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if not released:
                    released = True
                    self._pending -= 1
                    self._reserved_tokens -= tokens

        return release

    def close(self) -> None:
        """Finish every accepted request, then stop; later submissions raise RuntimeError.
        Blocks until the queue is drained. Calling it again does nothing."""
        with self._lock:
            self._closed = True
            self._cond.notify_all()
        if threading.current_thread() is self._worker:
            return
        self._worker.join()
        with self._lock:
            self._stopped = True
            self._timer.notify_all()
        self._reaper.join()
        if self._tokenizer_pool is not None:
            self._tokenizer_pool.shutdown(wait=False)

    def __enter__(self) -> Batcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Batcher is closed and accepts no new requests")

    # -- admission, then preparation -----------------------------------------------------------

    def _admit(self, score_kwargs: dict[str, Any], timeout_s: Any) -> Pending:
        """The cheap checks, before any tokenization: open, queue depth, the token estimate,
        timeout_s. Reserves the request's place and starts its deadline."""
        self._check_open()
        if timeout_s is None:
            timeout_s = self.request_timeout_s
        elif not is_positive_seconds(timeout_s):
            raise ValidationError(
                "invalid_argument",
                f"timeout_s must be a positive number of seconds, got {timeout_s!r}",
                "timeout_s",
            )
        estimate = estimate_tokens(
            score_kwargs.get("query"), score_kwargs.get("items"), score_kwargs.get("chunking")
        )
        with self._lock:
            self._check_open()
            self._check_room(estimate)
            now = time.monotonic()
            deadline = None if timeout_s is None else now + timeout_s
            entry = Pending(score_kwargs.get("backend"), Future(), timeout_s, deadline, estimate)
            self._pending += 1
            self._admitting += 1
            self._admitting_tokens += estimate
            if deadline is not None:
                heapq.heappush(self._deadlines, (deadline, next(self._sequence), entry))
                if self._deadlines[0][2] is entry:
                    self._timer.notify()
        entry.future.add_done_callback(lambda _: self._settle(entry))  # a caller's cancel()
        return entry

    def _check_room(self, estimate: int) -> None:
        """Under the lock: Overloaded past max_pending, or past max_queued_tokens with estimate
        more tokens (a first request is never refused for its size alone)."""
        if self._pending >= self.max_pending:
            raise Overloaded(self.max_pending)
        held = self._queued_tokens + self._admitting_tokens + self._reserved_tokens
        if self.max_queued_tokens is not None and held and held + estimate > self.max_queued_tokens:
            raise Overloaded(
                self.max_pending,
                f"the batcher holds about {held} tokens; this request's ~{estimate} would "
                f"pass max_queued_tokens={self.max_queued_tokens}; retry later",
            )

    def _prepare(self, entry: Pending, score_kwargs: dict[str, Any]) -> None:
        """Validate and tokenize the request, then queue it unless it was settled meanwhile
        (cancelled, or past its deadline). A bad request releases its place and raises."""
        try:
            kwargs = {k: v for k, v in score_kwargs.items() if k != "backend"}
            request = self.scorer.prepare_request(kwargs, backend=entry.backend)
        except BaseException as error:
            self._prepared(entry)
            if self._settle(entry):  # score_async awaits the future: it raises there too
                complete(entry.future, error=error)
            raise
        with self._lock:
            self._prepared(entry)
            if not entry.settled:
                if isinstance(request, ChunkedRequest):  # runs as its chunks, read back whole
                    entry.request, entry.finish = request.request, request.documents
                else:
                    entry.request = request
                self._enqueue(entry)

    def _prepared(self, entry: Pending) -> None:
        """Release the admission estimate of a request that is tokenized (or failed to be)."""
        with self._lock:
            self._admitting -= 1
            self._admitting_tokens -= entry.estimate
            self._cond.notify_all()  # the worker waits for admitting requests when closed

    def _tokenizers(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._tokenizer_pool is None:
                self._tokenizer_pool = ThreadPoolExecutor(
                    self._tokenize_workers, thread_name_prefix="tpuscore-tokenize"
                )
            return self._tokenizer_pool


def _retrieved(future: asyncio.Future) -> None:
    """Mark a tokenization's outcome as seen: its caller reads the request's future instead,
    and asyncio would log an error nobody retrieved."""
    if not future.cancelled():
        future.exception()
