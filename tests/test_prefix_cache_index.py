"""The prefix cache's radix-tree index at scale: the same answers, LRU order and byte budget as a
scan of every entry, and lookups whose cost does not grow with the number of entries (counted in
tree nodes visited, not timed)."""

import collections

import numpy as np

from tpuscore.backends.prefill_extend import prefix_cache
from tpuscore.backends.prefill_extend.prefix_cache import PrefixCache


class LinearScan:
    """The cache before its index (the test oracle): every lookup scans every entry for the
    longest common prefix. It does not pick among entries that tie for that length; `use` moves
    the one the cache under test picked, after the test checks it is among them."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.entries: collections.OrderedDict[bytes, tuple[np.ndarray, int, int]] = (
            collections.OrderedDict()
        )
        self.bytes = 0
        self.hits = self.partial_hits = self.misses = 0

    def best(self, tokens: np.ndarray) -> tuple[int, bool, set[int]]:
        """(length, exact, the values of every entry reaching that length); no side effects."""
        key = tokens.tobytes()
        if key in self.entries:
            return len(tokens), True, {self.entries[key][1]}
        lengths = {k: _common_prefix(c, tokens) for k, (c, _, _) in self.entries.items()}
        length = max(lengths.values(), default=0)
        if length == 0:
            return 0, False, set()
        return length, False, {self.entries[k][1] for k, n in lengths.items() if n == length}

    def use(self, value: int, exact: bool) -> None:
        key = next(k for k, (_, v, _) in self.entries.items() if v == value)
        self.entries.move_to_end(key)
        if exact:
            self.hits += 1
        else:
            self.partial_hits += 1

    def put(self, tokens: np.ndarray, value: int, nbytes: int) -> None:
        key = tokens.tobytes()
        if key in self.entries:
            self.bytes -= self.entries.pop(key)[2]
        if nbytes > self.budget_bytes:
            return
        while self.bytes + nbytes > self.budget_bytes:
            self.bytes -= self.entries.popitem(last=False)[1][2]
        self.entries[key] = (tokens, value, nbytes)
        self.bytes += nbytes


def _check_lookup(cache: PrefixCache, oracle: LinearScan, tokens: np.ndarray) -> None:
    """cache.lookup answers as the scan does, and both move the same entry to the MRU end."""
    length, exact, values = oracle.best(tokens)
    reuse = cache.lookup(tokens)
    if length == 0 and not exact:
        assert reuse is None
        oracle.misses += 1
    else:
        assert (reuse.length, reuse.exact) == (length, exact)
        assert reuse.value in values
        oracle.use(reuse.value, exact)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _lru_keys(cache: PrefixCache) -> list[bytes]:
    """The cache's keys, least recently used first (white-box: the order has no public view)."""
    return list(cache._entries)


def _sequences(rng, n: int, heads: list[np.ndarray], vocab: int) -> list[np.ndarray]:
    """n distinct sequences of 50-200 tokens; most start with one of the shared heads, the rest
    of each is random."""
    out, seen = [], set()
    while len(out) < n:
        length = int(rng.integers(50, 201))
        head = heads[int(rng.integers(len(heads)))] if rng.random() < 0.8 else []
        tail = rng.integers(0, vocab, size=max(0, length - len(head)), dtype=np.int32)
        tokens = np.concatenate([head[:length], tail]).astype(np.int32)
        if tokens.tobytes() not in seen:
            seen.add(tokens.tobytes())
            out.append(tokens)
    return out


def _query(rng, cached: list[np.ndarray], vocab: int, kind: int) -> np.ndarray:
    """A lookup of one of five kinds: exact, extending a cached sequence, leaving one part way,
    a prefix of one, and unrelated."""
    seq = cached[int(rng.integers(len(cached)))]
    cut = int(rng.integers(0, len(seq) + 1))
    fresh = rng.integers(0, vocab, size=int(rng.integers(1, 40)), dtype=np.int32)
    kinds = [
        lambda: seq,
        lambda: np.concatenate([seq, fresh]),
        lambda: np.concatenate([seq[:cut], fresh]),
        lambda: seq[:cut],
        lambda: fresh,
    ]
    return kinds[kind % len(kinds)]()


def _queries(rng, cached: list[np.ndarray], vocab: int, n: int) -> list[np.ndarray]:
    return [_query(rng, cached, vocab, i) for i in range(n)]


def test_random_operations_match_a_linear_scan(rng):
    """Results, stats, LRU order and bytes equal the scan's after every put, lookup and peek,
    under a budget tight enough that entries are evicted all along."""
    vocab = 6  # small: sequences share and leave each other's prefixes often
    stems = [rng.integers(0, vocab, size=int(n), dtype=np.int32) for n in (5, 30, 120)]
    heads = [stem[:cut] for stem in stems for cut in range(1, len(stem) + 1)]  # cut anywhere
    cache, oracle = PrefixCache(budget_bytes=400), LinearScan(400)
    pool = _sequences(rng, 60, heads, vocab)
    for step in range(1500):
        op = rng.random()
        if op < 0.45:
            tokens = pool[int(rng.integers(len(pool)))]
            if rng.random() < 0.3:  # also sequences that are prefixes of others
                tokens = tokens[: int(rng.integers(0, len(tokens) + 1))]
            nbytes = int(rng.integers(1, 120)) if rng.random() < 0.97 else 401
            cache.put(tokens, step, nbytes)
            oracle.put(tokens, step, nbytes)
        else:
            cached = [c for c, _, _ in oracle.entries.values()] or pool
            tokens = _query(rng, cached, vocab, int(rng.integers(5)))
            if op < 0.6:
                assert cache.peek(tokens) == oracle.best(tokens)[0]
            else:
                _check_lookup(cache, oracle, tokens)
        assert _lru_keys(cache) == list(oracle.entries)
        assert cache.bytes == oracle.bytes <= 400 and len(cache) == len(oracle.entries)
        assert (cache.hits, cache.partial_hits, cache.misses) == (
            oracle.hits,
            oracle.partial_hits,
            oracle.misses,
        )
    cache.clear()
    assert len(cache) == cache.bytes == 0 and cache.peek(pool[0]) == 0


class CountedChildren(dict):
    """A node's children, counting every read of them: one per node a walk visits."""

    visits = 0

    def get(self, key, default=None):
        CountedChildren.visits += 1
        return super().get(key, default)

    def values(self):
        CountedChildren.visits += 1
        return super().values()

    def items(self):
        CountedChildren.visits += 1
        return super().items()

    def __iter__(self):
        CountedChildren.visits += 1
        return super().__iter__()


class CountedEntries(collections.OrderedDict):
    """The cache's entries, counting walks over them (a scan would walk them all)."""

    walks = 0

    def __iter__(self):
        CountedEntries.walks += 1
        return super().__iter__()

    def items(self):
        CountedEntries.walks += 1
        return super().items()

    def values(self):
        CountedEntries.walks += 1
        return super().values()


class CountedNode(prefix_cache._Node):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.children = CountedChildren()


def _visits(cache: PrefixCache, queries: list[np.ndarray]) -> np.ndarray:
    """Nodes each lookup visits."""
    counts = []
    for tokens in queries:
        CountedChildren.visits = 0
        cache.lookup(tokens)
        counts.append(CountedChildren.visits)
    return np.array(counts)


def _depth(node) -> int:
    """Nodes on the longest path down from node (the root counts one)."""
    return 1 + max((_depth(child) for child in node.children.values()), default=0)


def test_ten_thousand_entries_answer_as_a_scan_and_visit_as_few_nodes_as_a_hundred(
    rng, monkeypatch
):
    """A service's shape: a few system prompts, a few hundred users' contexts after them, and
    each request's own text after that. The index is white-box counted: each step down the
    tree is one `children.get`, so a lookup's cost is the nodes it visits."""
    monkeypatch.setattr(prefix_cache, "_Node", CountedNode)
    vocab = 50_000
    systems = [rng.integers(0, vocab, size=int(rng.integers(5, 40)), dtype=np.int32)]
    systems += [rng.integers(0, vocab, size=20, dtype=np.int32) for _ in range(7)]
    users = [
        np.concatenate([systems[i % 8], rng.integers(0, vocab, size=30, dtype=np.int32)])
        for i in range(300)
    ]
    sequences = _sequences(rng, 10_000, systems + users, vocab)
    big, small = PrefixCache(budget_bytes=10**9), PrefixCache(budget_bytes=10**9)
    oracle = LinearScan(10**9)
    for i, tokens in enumerate(sequences):
        big.put(tokens, i, 1000)
        oracle.put(tokens, i, 1000)
        if i < 100:
            small.put(tokens, i, 1000)
    assert len(big) == 10_000 and big.bytes == 10_000 * 1000
    assert isinstance(big._tree.root, CountedNode)

    # Exactness against the scan on a sample (the scan itself is slow at this size).
    for tokens in _queries(rng, sequences, vocab, 10):
        assert big.peek(tokens) == oracle.best(tokens)[0]
        _check_lookup(big, oracle, tokens)
    assert _lru_keys(big) == list(oracle.entries)

    # Cost: a lookup visits at most the nodes of one path down the tree, never one per entry
    # (a scan compares with all 10,000), and 100 times the entries leave the average visits
    # per lookup well under twice what they are with 100 entries.
    queries = _queries(rng, sequences, vocab, 500)
    big._entries = CountedEntries(big._entries)
    big_visits = _visits(big, queries)
    assert CountedEntries.walks == 0
    small_visits = _visits(small, _queries(rng, sequences[:100], vocab, 500))
    assert big_visits.max() <= _depth(big._tree.root) < 20
    assert big_visits.mean() < 2 * small_visits.mean(), (big_visits.mean(), small_visits.mean())
