"""Warm start: warmup compiles what a geometry's requests meet, and a persistent compilation cache
lets a new process skip compiling."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from helpers import compile_events, random_tokens
from tpuscore import Scorer


def test_a_warmed_geometry_compiles_nothing_when_requests_arrive(scorers, rng):
    base = scorers("qwen3_qknorm")
    scorer = Scorer(base.config, base.params, base.tokenizer)
    vocab = scorer.config.vocab_size
    scorer.score([0] + random_tokens(rng, 39, vocab), [[1]], [2])  # a user entry in the cache
    cache = scorer.get_backend("prefill_extend").cache
    before = (len(cache), cache.bytes, cache.hits, cache.partial_hits, cache.misses)

    compiles = compile_events()
    warmed = scorer.warmup([(37, 5, 6), (100, 20, 3)])
    assert [w.backend for w in warmed] == ["prefill_extend"] * 2
    assert all(w.steps >= 2 and w.seconds > 0 for w in warmed)  # a prefill and an extend each
    assert len(compiles) > 0
    compiled = len(compiles)
    assert (len(cache), cache.bytes, cache.hits, cache.partial_hits, cache.misses) == before

    # The same buckets. Distinct first tokens: no query reuses part of another from the cache,
    # which would prefill only its tail, in a shorter bucket.
    for first, (query_len, count, item_len) in enumerate([(37, 5, 6), (33, 6, 5), (99, 17, 3)]):
        items = [random_tokens(rng, item_len, vocab) for _ in range(count)]
        query = [first + 1] + random_tokens(rng, query_len - 1, vocab)
        scorer.score(query, items, [3, 4])
    scorer.warmup([(37, 5, 6)])  # already compiled: costs nothing to compile
    assert len(compiles) == compiled


def test_warmup_takes_named_backends_and_refuses_a_bad_geometry(scorers):
    scorer = scorers("qwen2_bias")
    warmed = scorer.warmup([(8, 3, 4)], backends=["serial", "packed_dense"])
    assert [w.backend for w in warmed] == ["serial", "packed_dense"]
    with pytest.raises(ValueError, match="num_items > 0"):
        scorer.warmup([(8, 0, 4)])


FIRST_REQUEST = textwrap.dedent(
    """
    import json, sys
    from jax import monitoring
    events = []
    monitoring.register_event_listener(lambda event, **_: events.append(event))
    from tpuscore import Scorer
    scorer = Scorer.from_pretrained(sys.argv[1], dtype="float32")
    result = scorer.score([5, 6, 7], [[8, 9], [10]], [11, 12])
    print(json.dumps({
        "misses": events.count("/jax/compilation_cache/cache_misses"),
        "hits": events.count("/jax/compilation_cache/cache_hits"),
        "logprobs": result.logprobs.tolist(),
    }))
    """
)


def test_a_new_process_loads_its_executables_from_the_cache(checkpoint_dir, tmp_path):
    env = {**os.environ, "TPUSCORE_COMPILATION_CACHE": str(tmp_path / "cache")}

    def first_request() -> dict:
        out = subprocess.run(
            [sys.executable, "-c", FIRST_REQUEST, str(checkpoint_dir("llama_gqa_untied"))],
            env=env, capture_output=True, text=True, timeout=300, check=True,
        )  # fmt: skip
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold, warm = first_request(), first_request()
    assert cold["misses"] > 0 and os.listdir(tmp_path / "cache")  # compiled, and kept
    assert warm["misses"] == 0 and warm["hits"] >= cold["misses"]  # nothing compiled again
    np.testing.assert_array_equal(warm["logprobs"], cold["logprobs"])
