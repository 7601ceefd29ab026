"""What a `Batcher` admits, before anything is tokenized: its options checked (`check_options`,
`OptionError`), a submission past its bounds refused (`Overloaded`), and a request's tokens
estimated from its text (`estimate_tokens`)."""

from __future__ import annotations

import math
from typing import Any

from tpuscore.api import bounds
from tpuscore.api.argument_checks import listed
from tpuscore.api.chunking import Chunking
from tpuscore.api.errors import ValidationError

# Bytes of text per token in the admission estimate: English BPE text averages about 4 bytes a
# token. An estimate only; the exact count replaces it once the request is tokenized.
ESTIMATE_BYTES_PER_TOKEN = 4
# Threads that tokenize `score_async` requests. Tokenizers release the GIL while they encode, so
# two keep an event loop responsive while using the spare cores; more only queue behind the GIL.
DEFAULT_TOKENIZE_WORKERS = 2


class Overloaded(RuntimeError):
    """The batcher already holds `max_pending` unfinished requests (or `max_queued_tokens`
    tokens): the submission is refused at once instead of queueing without bound. Retry later;
    a server answers 503."""

    def __init__(self, max_pending: int, reason: str | None = None):
        super().__init__(
            reason
            or f"the batcher already holds max_pending={max_pending} unfinished requests; "
            "retry later or raise max_pending"
        )
        self.max_pending = max_pending


class OptionError(ValueError):
    """A `Batcher` option out of its range; `option` names it (the serve command names its flag)."""

    def __init__(self, option: str, message: str):
        super().__init__(f"{option} {message}")
        self.option, self.message = option, message


# Counts whose None means the default (max_queued_tokens: no bound).
_DEFAULTED = ("max_batch_tokens", "max_request_step_tokens", "max_queued_tokens")


def check_options(
    *,
    max_wait_ms: Any = 2.0,
    max_batch_tokens: Any = None,
    max_pending: Any = 1024,
    max_request_step_tokens: Any = None,
    max_queued_tokens: Any = None,
    request_timeout_s: Any = None,
    tokenize_workers: Any = DEFAULT_TOKENIZE_WORKERS,
) -> None:
    """Raise `OptionError` for the first `Batcher` option out of its range (None: its default)."""
    if isinstance(max_wait_ms, bool) or not isinstance(max_wait_ms, (int, float)):
        raise OptionError("max_wait_ms", f"must be a number of milliseconds, got {max_wait_ms!r}")
    if not 0 <= max_wait_ms < math.inf:
        raise OptionError("max_wait_ms", f"must be >= 0 and finite, got {max_wait_ms!r}")
    for name, value in (
        ("max_batch_tokens", max_batch_tokens),
        ("max_pending", max_pending),
        ("max_request_step_tokens", max_request_step_tokens),
        ("max_queued_tokens", max_queued_tokens),
        ("tokenize_workers", tokenize_workers),
    ):
        if value is None and name in _DEFAULTED:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise OptionError(name, f"must be an int >= 1, got {value!r}")
    if request_timeout_s is not None and not is_positive_seconds(request_timeout_s):
        raise OptionError(
            "request_timeout_s",
            f"must be a positive number of seconds or None, got {request_timeout_s!r}",
        )


def estimate_tokens(query: Any, items: Any, chunking: Any = None) -> int:
    """A request's query and item tokens, estimated without tokenizing: exact for token ids,
    UTF-8 bytes / `ESTIMATE_BYTES_PER_TOKEN` for text; 0 for what validation will refuse. With
    `chunking`, each item is a document and counts its chunks' tokens (overlapping chunks hold
    a token more than once: a stride of 1 holds it up to window times)."""
    plan = _chunking(chunking)

    def size(value: Any) -> int:
        if isinstance(value, str):
            n = len(value) if value.isascii() else len(value.encode("utf-8", "replace"))
            return math.ceil(n / ESTIMATE_BYTES_PER_TOKEN)
        return bounds.length(value)

    total = size(query)
    items = listed(items)  # a numpy column is read as its list, as validation reads it
    if isinstance(items, (list, tuple)):
        total += sum(size(i) if plan is None else plan.tokens(size(i)) for i in items)
    return total


def _chunking(value: Any) -> Chunking | None:
    """The request's chunking, or None where it has none or validation will refuse it."""
    if value is None:
        return None
    try:
        return Chunking.of(value)
    except ValidationError:
        return None


def is_positive_seconds(value: Any) -> bool:
    return (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and value > 0
    )
