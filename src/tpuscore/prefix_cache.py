"""A cross-request cache of query K/V: LRU under a byte budget, keyed by exact token sequences.

A recommender scores the same user context against page after page of candidates; caching the
context's K/V turns every page after the first into item work only. Entries are immutable, so a
reader keeps using an entry that another thread evicts meanwhile.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import attrs
import numpy as np


@attrs.frozen
class Reuse:
    """The longest cached prefix of a token sequence: `value` holds the first `length` tokens'
    state (possibly of a longer cached sequence); `exact` when the whole sequence was cached."""

    value: Any
    length: int
    exact: bool


class PrefixCache:
    """Values keyed by token sequences (int32 arrays). Thread-safe.

    `lookup` finds the entry sharing the longest common prefix with a sequence: a causal model's
    state for the first n tokens of any cached sequence is exactly the state of those n tokens.
    """

    def __init__(self, budget_bytes: int):
        if not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be an int >= 0, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self._entries: collections.OrderedDict[bytes, tuple[np.ndarray, Any, int]] = (
            collections.OrderedDict()
        )
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.partial_hits = self.misses = 0

    @property
    def bytes(self) -> int:
        """Bytes held now; never above the budget."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def peek(self, tokens: np.ndarray) -> int:
        """How many leading tokens of `tokens` a lookup would reuse (len(tokens) on an exact hit, 0
        on a miss), without counting a hit or a miss or touching the LRU order: a read-only probe
        for planning."""
        tokens = np.asarray(tokens, np.int32)
        with self._lock:
            if tokens.tobytes() in self._entries:
                return len(tokens)
            return max((_common_prefix(c, tokens) for c, _, _ in self._entries.values()), default=0)

    def lookup(self, tokens: np.ndarray) -> Reuse | None:
        """The cached entry with the longest common prefix with tokens, or None."""
        tokens = np.asarray(tokens, np.int32)
        with self._lock:
            exact = self._entries.get(tokens.tobytes())
            if exact is not None:
                self._entries.move_to_end(tokens.tobytes())
                self.hits += 1
                return Reuse(exact[1], len(tokens), exact=True)
            best, best_len = None, 0
            for key, (cached, _, _) in self._entries.items():
                n = _common_prefix(cached, tokens)
                if n > best_len:
                    best, best_len = key, n
            if best is None:
                self.misses += 1
                return None
            self._entries.move_to_end(best)
            self.partial_hits += 1
            return Reuse(self._entries[best][1], best_len, exact=False)

    def put(self, tokens: np.ndarray, value: Any, nbytes: int) -> None:
        """Insert value for tokens, evicting least recently used entries to stay in budget. A value
        larger than the whole budget is not kept."""
        tokens = np.array(tokens, np.int32)
        key = tokens.tobytes()
        with self._lock:
            if key in self._entries:
                self._bytes -= self._entries.pop(key)[2]
            if nbytes > self.budget_bytes:
                return
            while self._bytes + nbytes > self.budget_bytes:
                self._bytes -= self._entries.popitem(last=False)[1][2]
            self._entries[key] = (tokens, value, nbytes)
            self._bytes += nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n
