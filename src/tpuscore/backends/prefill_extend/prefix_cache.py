"""A cross-request cache of query K/V: LRU under a byte budget, keyed by exact token sequences.

A recommender scores the same user context against page after page of candidates; caching the
context's K/V turns every page after the first into item work only. Entries are immutable, so a
reader keeps using an entry that another thread evicts meanwhile.

Longest-prefix lookups go through a radix tree over the cached token sequences (SGLang's
RadixCache shape): a lookup walks the query down the tree, one dict step per branch point and a
byte comparison per edge, so it costs O(query length) whatever the number of entries, where a scan
of every entry cost O(entries x query length). Every operation holds one lock, briefly. A radix tree
rather than vLLM's chained block hashes because the reuse length must be exact to the token: block
hashes find the longest matching block, and the tokens after it would need a scan of every entry
sharing that block.

Every operation takes the LoRA adapter the state was computed under (`adapter`, 0: none): a
query's K/V differ per adapter, so an entry serves lookups of its own adapter only. The adapter
heads the key as one negative token (-adapter), which no real token id can match: entries of
different adapters share no prefix in the tree, and the base model's keys are the tokens alone.
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


TOKEN = np.dtype(np.int32).itemsize  # bytes per token in a key


class _Node:
    """A radix tree node. `edge` holds the tokens from the parent to here (int32 bytes, as keys
    are), `children` maps the first token of each child's edge to the child, and `key` names the
    cached sequence that ends here (None if none does).

    Invariant, kept by `_Tree.remove`: a node other than the root that ends no sequence has at
    least two children, so every leaf ends a sequence and the tree has fewer than 2 x entries
    nodes.
    """

    __slots__ = ("children", "edge", "key", "parent")

    def __init__(self, edge: bytes, parent: _Node | None, key: bytes | None = None):
        self.edge = edge
        self.parent = parent
        self.children: dict[bytes, _Node] = {}
        self.key = key


class _Tree:
    """The radix tree over the cached sequences, walked over int32 bytes so that matching a whole
    edge is one C-level `startswith`. Not thread-safe: `PrefixCache` holds its lock."""

    def __init__(self):
        self.root = _Node(b"", None)

    def longest_prefix(self, key: bytes) -> tuple[int, _Node]:
        """(n, node): n is the longest common prefix, in tokens, of key with any cached sequence,
        and every sequence cached under node shares exactly n tokens with key. One node visited
        per branch point on key's path."""
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos : pos + TOKEN])
            if child is None:
                break
            node = child
            if not key.startswith(child.edge, pos):  # key leaves (or ends inside) this edge
                pos += _common_prefix(child.edge, key, pos)
                break
            pos += len(child.edge)
        return pos // TOKEN, node

    def insert(self, key: bytes) -> _Node:
        """Add the sequence (not cached yet) and return the node that now ends it."""
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos : pos + TOKEN])
            if child is None:
                leaf = _Node(key[pos:], node, key)
                node.children[key[pos : pos + TOKEN]] = leaf
                return leaf
            if key.startswith(child.edge, pos):
                matched = len(child.edge)
            else:  # split the edge where the new sequence leaves it (or ends)
                matched = _common_prefix(child.edge, key, pos)
                middle = _Node(child.edge[:matched], node)
                node.children[child.edge[:TOKEN]] = middle
                child.edge = child.edge[matched:]
                child.parent = middle
                middle.children[child.edge[:TOKEN]] = child
                child = middle
            pos += matched
            node = child
        node.key = key
        return node

    def remove(self, node: _Node) -> None:
        """Forget the sequence ending at node, then restore the invariant: a node ending nothing
        is dropped if it has no children, or merged into its child if it has one. The merge keeps
        the child's object, so the nodes that end other sequences never change."""
        node.key = None
        while node is not self.root and node.key is None and len(node.children) <= 1:
            parent = node.parent
            del parent.children[node.edge[:TOKEN]]
            if node.children:
                (child,) = node.children.values()
                child.edge = node.edge + child.edge
                child.parent = parent
                parent.children[child.edge[:TOKEN]] = child
                break
            node = parent

    def any_key(self, node: _Node) -> bytes:
        """A cached sequence under node (node itself if it ends one); the invariant makes every
        path down end at one."""
        while node.key is None:
            node = next(iter(node.children.values()))
        return node.key


class PrefixCache:
    """Values keyed by token sequences (int32 arrays). Thread-safe.

    `lookup` finds the entry sharing the longest common prefix with a sequence: a causal model's
    state for the first n tokens of any cached sequence is exactly the state of those n tokens.
    When several entries share that longest prefix, which one is returned is unspecified (each
    holds the same state for those tokens).
    """

    def __init__(self, budget_bytes: int):
        if not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be an int >= 0, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        # key -> (value, nbytes, the tree node ending the sequence), least recently used first.
        self._entries: collections.OrderedDict[bytes, tuple[Any, int, _Node]] = (
            collections.OrderedDict()
        )
        self._tree = _Tree()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.partial_hits = self.misses = 0

    @property
    def bytes(self) -> int:
        """Bytes held now; never above the budget."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def peek(self, tokens: np.ndarray, adapter: int = 0) -> int:
        """How many leading tokens of `tokens` a lookup would reuse (len(tokens) on an exact hit, 0
        on a miss), without counting a hit or a miss or touching the LRU order: a read-only probe
        for planning."""
        reuse = self.probe(tokens, adapter)
        return 0 if reuse is None else reuse.length

    def probe(self, tokens: np.ndarray, adapter: int = 0) -> Reuse | None:
        """What `lookup` would return now, without counting a hit or a miss or touching the LRU
        order: for pricing a plan that a lookup would make."""
        with self._lock:
            return self._find(np.asarray(tokens, np.int32), adapter)[0]

    def lookup(self, tokens: np.ndarray, adapter: int = 0) -> Reuse | None:
        """The entry of this adapter with the longest common prefix with tokens, or None."""
        with self._lock:
            reuse, key = self._find(np.asarray(tokens, np.int32), adapter)
            if reuse is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            if reuse.exact:
                self.hits += 1
            else:
                self.partial_hits += 1
            return reuse

    def _find(self, tokens: np.ndarray, adapter: int) -> tuple[Reuse | None, bytes | None]:
        """The longest cached prefix of tokens under the adapter and the key of the entry
        holding it. Holds no lock: the caller does."""
        key = _key(tokens, adapter)
        exact = self._entries.get(key)
        if exact is not None:
            return Reuse(exact[0], len(tokens), exact=True), key
        length, node = self._tree.longest_prefix(key)
        length -= adapter != 0  # the adapter's own token is no token of the sequence
        if length <= 0:
            return None, None
        best = self._tree.any_key(node)
        return Reuse(self._entries[best][0], length, exact=False), best

    def put(self, tokens: np.ndarray, value: Any, nbytes: int, adapter: int = 0) -> None:
        """Insert value for tokens under the adapter, evicting least recently used entries to
        stay in budget. A value larger than the whole budget is not kept (and replaces no entry:
        one already cached for tokens is dropped)."""
        key = _key(np.asarray(tokens, np.int32), adapter)
        with self._lock:
            if key in self._entries:
                self._forget(key)
            if nbytes > self.budget_bytes:
                return
            while self._bytes + nbytes > self.budget_bytes:
                self._forget(next(iter(self._entries)))
            self._entries[key] = (value, nbytes, self._tree.insert(key))
            self._bytes += nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._tree = _Tree()
            self._bytes = 0

    def _forget(self, key: bytes) -> None:
        _, nbytes, node = self._entries.pop(key)
        self._tree.remove(node)
        self._bytes -= nbytes


def _key(tokens: np.ndarray, adapter: int) -> bytes:
    """A cache key: the tokens' int32 bytes, after -adapter for an adapter's state."""
    head = np.array([-adapter], np.int32).tobytes() if adapter else b""
    return head + np.asarray(tokens, np.int32).tobytes()


def _common_prefix(edge: bytes, key: bytes, pos: int) -> int:
    """Bytes of edge that match key from byte pos on, a whole number of tokens: a binary search
    over the matched length, each probe one C-level comparison."""
    matched, most = 0, min(len(edge), len(key) - pos) // TOKEN  # in tokens
    while matched < most:
        mid = (matched + most + 1) // 2
        if key.startswith(edge[: mid * TOKEN], pos):
            matched = mid
        else:
            most = mid - 1
    return matched * TOKEN
