"""The prefix cache's radix tree (backends/prefill_extend/prefix_cache.py): its literal shape
after inserts and removals, its invariant under any sequence of operations, and the cache's LRU,
budget and statistics rules. White-box where the shape is the point (`_tree`, `_entries`)."""

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from tpuscore.backends.prefill_extend.prefix_cache import PrefixCache, Reuse


def tokens(*ids: int) -> np.ndarray:
    return np.array(ids, np.int32)


def tree(cache: PrefixCache) -> str:
    """The tree, one node per line: its edge's tokens, `*` where a cached sequence ends."""

    def lines(node, depth):
        for child in sorted(node.children.values(), key=lambda n: edge(n)[0]):
            yield "  " * depth + " ".join(map(str, edge(child))) + (" *" if child.key else "")
            yield from lines(child, depth + 1)

    return "\n".join(lines(cache._tree.root, 0))


def edge(node) -> list[int]:
    return np.frombuffer(node.edge, np.int32).tolist()


def test_inserts_split_edges_and_removals_merge_them():
    cache = PrefixCache(budget_bytes=100)
    for seq in ([1, 2, 3, 4], [1, 2, 3, 5], [1, 2], [7]):
        cache.put(tokens(*seq), tuple(seq), 1)
    assert tree(cache) == "1 2 *\n  3\n    4 *\n    5 *\n7 *"
    cache.put(tokens(1, 2), "again", 1)  # re-put: the same shape, the newest value
    assert tree(cache) == "1 2 *\n  3\n    4 *\n    5 *\n7 *"
    assert cache.lookup(tokens(1, 2)) == Reuse("again", 2, exact=True)

    cache.put(tokens(1, 2), "too big", 101)  # over the budget: dropped, and the old one with it
    assert tree(cache) == "1 2 3\n  4 *\n  5 *\n7 *"  # "1 2" ends nothing: merged
    cache.put(tokens(1, 2, 3, 4), "big", 100)  # evicts everything else, least recent first
    assert tree(cache) == "1 2 3 4 *" and len(cache) == 1 and cache.bytes == 100


def test_lookups_reuse_the_longest_cached_prefix():
    cache = PrefixCache(budget_bytes=100)
    cache.put(tokens(1, 2, 3, 4), "abcd", 10)
    cache.put(tokens(1, 2, 9), "ab9", 10)
    assert cache.lookup(tokens(1, 2, 3, 4)) == Reuse("abcd", 4, exact=True)
    assert cache.lookup(tokens(1, 2, 3, 4, 5)) == Reuse("abcd", 4, exact=False)  # extends one
    assert cache.lookup(tokens(1, 2, 3, 8)) == Reuse("abcd", 3, exact=False)  # leaves one
    assert cache.lookup(tokens(1)).length == 1  # a prefix of both: either holds it
    assert cache.lookup(tokens(5, 1, 2)) is None
    assert cache.lookup(tokens()) is None
    assert (cache.hits, cache.partial_hits, cache.misses) == (1, 3, 2)


def test_peek_and_probe_change_neither_order_nor_counts():
    cache = PrefixCache(budget_bytes=20)
    cache.put(tokens(1), "one", 10)
    cache.put(tokens(2), "two", 10)
    assert cache.peek(tokens(1, 5)) == 1 and cache.peek(tokens(3)) == 0
    assert cache.probe(tokens(1)) == Reuse("one", 1, exact=True)
    assert (cache.hits, cache.partial_hits, cache.misses) == (0, 0, 0)
    cache.put(tokens(3), "three", 10)  # evicts "one": peeking did not make it recent
    assert cache.peek(tokens(1)) == 0 and cache.peek(tokens(2)) == 1
    cache.lookup(tokens(2))  # a lookup does
    cache.put(tokens(4), "four", 10)
    assert list(cache._entries) == [tokens(2).tobytes(), tokens(4).tobytes()]


@pytest.mark.parametrize("budget", [-1, 1.5, None, True])
def test_a_budget_is_a_non_negative_int(budget):
    if budget is True:  # a bool is an int to Python; it is accepted as 1 byte
        assert PrefixCache(budget).budget_bytes == 1
        return
    with pytest.raises(ValueError, match="prefix_cache_bytes must be an int >= 0"):
        PrefixCache(budget)


def test_a_zero_budget_keeps_nothing():
    cache = PrefixCache(budget_bytes=0)
    cache.put(tokens(1, 2), "x", 1)
    assert len(cache) == 0 and cache.lookup(tokens(1, 2)) is None and tree(cache) == ""
    cache.put(tokens(1, 2), "free", 0)
    assert cache.lookup(tokens(1, 2)) == Reuse("free", 2, exact=True)


def check_invariant(cache: PrefixCache) -> None:
    """Every node below the root ends a sequence or branches; each cached key ends at its node,
    spelled by the edges above it; the nodes number fewer than twice the entries."""
    nodes, stack = 0, [(cache._tree.root, b"")]
    while stack:
        node, spelled = stack.pop()
        for first, child in node.children.items():
            nodes += 1
            assert child.parent is node and child.edge[:4] == first and child.edge
            assert child.key is not None or len(child.children) >= 2
            if child.key is not None:
                assert child.key == spelled + child.edge
                assert cache._entries[child.key][2] is child
            stack.append((child, spelled + child.edge))
    assert nodes < 2 * max(len(cache), 1)
    assert sum(n for _, n, _ in cache._entries.values()) == cache.bytes <= cache.budget_bytes


OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "put", "lookup", "drop"]),
        st.lists(st.integers(0, 3), max_size=8),
        st.integers(0, 30),
    ),
    max_size=40,
)


@hypothesis.settings(max_examples=50, deadline=None)
@hypothesis.given(OPS)
def test_the_tree_keeps_its_invariant_under_any_operations(ops):
    cache = PrefixCache(budget_bytes=60)
    for op, seq, nbytes in ops:
        if op == "put":
            cache.put(tokens(*seq), nbytes, nbytes)
        elif op == "drop":  # an over-budget put drops the sequence's entry
            cache.put(tokens(*seq), None, 61)
        else:
            reuse = cache.lookup(tokens(*seq))
            if reuse is not None:  # some entry holds the reused tokens
                shared = tokens(*seq)[: reuse.length].tobytes()
                assert any(key.startswith(shared) for key in cache._entries)
                assert reuse.length == len(seq) if reuse.exact else 0 < reuse.length <= len(seq)
        check_invariant(cache)
    cache.clear()
    assert tree(cache) == "" and len(cache) == cache.bytes == 0


def test_entries_serve_their_own_adapter_only():
    """A query's K/V differ per LoRA adapter: an entry is found under its adapter alone, exact
    or as a prefix, and a partial hit's length counts the sequence's tokens only."""
    cache = PrefixCache(budget_bytes=100)
    cache.put(tokens(1, 2, 3), "base", 1)
    cache.put(tokens(1, 2, 3), "one", 1, adapter=1)
    assert cache.lookup(tokens(1, 2, 3)) == Reuse("base", 3, exact=True)
    assert cache.lookup(tokens(1, 2, 3), adapter=1) == Reuse("one", 3, exact=True)
    assert cache.lookup(tokens(1, 2, 3), adapter=2) is None
    assert cache.lookup(tokens(1, 2, 9), adapter=1) == Reuse("one", 2, exact=False)
    assert cache.lookup(tokens(9), adapter=1) is None
    assert cache.peek(tokens(1, 2), adapter=2) == 0
