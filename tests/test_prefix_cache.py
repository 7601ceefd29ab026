"""The cross-request query K/V cache: exact keys, longest-prefix reuse, LRU under a byte budget."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from helpers import random_tokens
from tpuscore import Scorer
from tpuscore.backends.prefill_extend.prefix_cache import PrefixCache

ATOL = 1e-4


def _fresh(scorers, case="llama_gqa_untied", **options) -> Scorer:
    base = scorers(case)
    return Scorer(
        base.config, base.params, base.tokenizer, backend_options={"prefill_extend": options}
    )


def _cache(scorer: Scorer) -> PrefixCache:
    return scorer.get_backend("prefill_extend").cache


def test_lookup_finds_the_longest_common_prefix():
    cache = PrefixCache(1000)
    cache.put(np.array([1, 2, 3, 4]), "a", 10)
    cache.put(np.array([1, 2, 7]), "b", 10)
    cache.put(np.array([9]), "c", 10)
    exact = cache.lookup(np.array([1, 2, 3, 4]))
    assert (exact.value, exact.length, exact.exact) == ("a", 4, True)
    for query, value, length in [
        ([1, 2, 3, 4, 5, 6], "a", 4),  # extends a cached sequence
        ([1, 2, 3, 8], "a", 3),  # diverges from it
        ([1, 2, 7, 7], "b", 3),
        ([1, 2], "a", 2),  # a prefix of cached sequences (either holds its state)
    ]:
        reuse = cache.lookup(np.array(query))
        assert reuse.length == length and not reuse.exact
        assert length == 2 or reuse.value == value
    assert cache.lookup(np.array([5, 1, 2])) is None
    assert cache.lookup(np.array([], np.int32)) is None


def test_keys_are_exact_token_sequences():
    cache = PrefixCache(1000)
    cache.put(np.array([1, 2]), "short", 10)
    cache.put(np.array([1, 2, 0]), "padded", 10)  # not the same key as [1, 2]
    assert cache.lookup(np.array([1, 2])).value == "short"
    assert cache.lookup(np.array([1, 2, 0])).value == "padded"
    assert len(cache) == 2


def test_least_recently_used_goes_first_and_the_budget_holds(rng):
    cache = PrefixCache(30)
    for token in (1, 2, 3):
        cache.put(np.array([token]), token, 10)
    cache.lookup(np.array([1]))  # 1 is now the most recently used
    cache.put(np.array([4]), 4, 10)
    assert cache.lookup(np.array([2])) is None  # 2 was the least recently used
    assert {cache.lookup(np.array([t])).value for t in (1, 3, 4)} == {1, 3, 4}
    cache.put(np.array([5]), 5, 31)  # larger than the whole budget: not kept
    assert cache.lookup(np.array([5])) is None and cache.bytes == 30
    for _ in range(200):
        cache.put(rng.integers(0, 50, size=3), None, int(rng.integers(1, 25)))
        assert cache.bytes <= 30


def test_a_hit_is_bit_identical_to_the_miss(scorers, rng):
    scorer = _fresh(scorers)
    vocab = scorer.config.vocab_size
    query = random_tokens(rng, 70, vocab)
    items = [random_tokens(rng, int(n), vocab) for n in rng.integers(0, 20, size=12)]
    miss = scorer.score(query, items, [1, 2, 3], backend="prefill_extend")
    hit = scorer.score(query, items, [1, 2, 3], backend="prefill_extend")
    cache = _cache(scorer)
    assert (cache.misses, cache.hits) == (1, 1)
    np.testing.assert_array_equal(hit.logprobs, miss.logprobs)
    assert hit.num_tokens == sum(map(len, items)) == miss.num_tokens - len(query)


def test_a_query_sharing_a_cached_prefix_prefills_only_the_rest(scorers, rng):
    scorer = _fresh(scorers, "qwen3_qknorm")
    vocab = scorer.config.vocab_size
    instruction = random_tokens(rng, 60, vocab)
    items = [random_tokens(rng, int(n), vocab) for n in rng.integers(0, 15, size=6)]
    item_tokens = sum(map(len, items))
    first_text = random_tokens(rng, 20, vocab)
    scorer.score(instruction + first_text, items, [7], backend="prefill_extend")
    other_text = random_tokens(rng, 35, vocab)
    while other_text[0] == first_text[0]:  # else the shared prefix is a token longer
        other_text = random_tokens(rng, 35, vocab)
    for query, prefilled in [
        (instruction + other_text, 35),  # same instruction, other user text
        (instruction[:40], 1),  # a prefix of a cached query: only its last token is recomputed
    ]:
        result = scorer.score(query, items, [7], backend="prefill_extend")
        expected = scorer.score(query, items, [7], backend="serial")
        np.testing.assert_allclose(result.logprobs, expected.logprobs, atol=ATOL, rtol=0)
        assert result.num_tokens == prefilled + item_tokens
    assert _cache(scorer).partial_hits == 2


@pytest.mark.slow  # long
def test_eviction_keeps_the_budget_and_the_scores(scorers, rng):
    probe = _fresh(scorers)
    vocab = probe.config.vocab_size
    probe.score(random_tokens(rng, 40, vocab), [[1]], [2], backend="prefill_extend")
    entry = _cache(probe).bytes  # every 40-token query takes the same bytes
    scorer = _fresh(scorers, prefix_cache_bytes=int(2.5 * entry))
    # Distinct first tokens: each query is prefilled from scratch, never from another's prefix.
    queries = [[first, *random_tokens(rng, 39, vocab)] for first in range(6)]
    items = [random_tokens(rng, int(n), vocab) for n in rng.integers(0, 15, size=5)]
    first_scores = []
    for query in queries:
        result = scorer.score(query, items, [2, 3], backend="prefill_extend")
        expected = scorer.score(query, items, [2, 3], backend="serial")
        np.testing.assert_allclose(result.logprobs, expected.logprobs, atol=ATOL, rtol=0)
        first_scores.append(result.logprobs)
        assert _cache(scorer).bytes <= 2.5 * entry and len(_cache(scorer)) <= 2
    again = scorer.score(queries[0], items, [2, 3], backend="prefill_extend")  # evicted long ago
    assert again.num_tokens == 40 + sum(map(len, items))
    np.testing.assert_array_equal(again.logprobs, first_scores[0])


@pytest.mark.slow  # long
@pytest.mark.parametrize("budget_entries", [1.5, 10])
def test_threads_get_exactly_their_sequential_results(scorers, rng, budget_entries):
    probe = _fresh(scorers, "qwen2_bias")
    vocab = probe.config.vocab_size
    probe.score(random_tokens(rng, 30, vocab), [[1]], [2], backend="prefill_extend")
    budget = int(budget_entries * _cache(probe).bytes)
    queries = [[first, *random_tokens(rng, 29, vocab)] for first in range(6)]
    requests = [
        (queries[i % 6], [random_tokens(rng, int(n), vocab) for n in rng.integers(0, 12, size=4)])
        for i in range(12)
    ]
    sequential = [
        _fresh(scorers, "qwen2_bias").score(q, items, [4, 5], backend="prefill_extend").logprobs
        for q, items in requests
    ]
    scorer = _fresh(scorers, "qwen2_bias", prefix_cache_bytes=budget)
    with ThreadPoolExecutor(max_workers=4) as pool:
        for _ in range(2):
            futures = [
                pool.submit(scorer.score, q, items, [4, 5], backend="prefill_extend")
                for q, items in requests
            ]
            for future, expected in zip(futures, sequential, strict=True):
                np.testing.assert_array_equal(future.result().logprobs, expected)
    assert _cache(scorer).bytes <= budget


def test_peek_reports_the_reusable_prefix_without_touching_stats_or_lru_order():
    cache = PrefixCache(budget_bytes=30)
    cache.put(np.array([1, 2, 3]), "a", 10)
    cache.put(np.array([7, 8]), "b", 10)
    assert cache.peek(np.array([1, 2, 3])) == 3  # exact
    assert cache.peek(np.array([1, 2, 9, 9])) == 2  # longest common prefix
    assert cache.peek(np.array([5])) == 0
    assert (cache.hits, cache.partial_hits, cache.misses) == (0, 0, 0)
    cache.put(np.array([4]), "c", 10)
    cache.put(np.array([5]), "d", 10)  # evicts the least recently used: [1, 2, 3], unmoved by peek
    assert cache.peek(np.array([1, 2, 3])) == 0 and cache.peek(np.array([7, 8])) == 2
