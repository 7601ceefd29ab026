"""Warm start: warmup compiles what a geometry's requests meet, and a persistent compilation cache
lets a new process skip compiling."""

import json
import os
import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest

from helpers import compile_events, random_tokens
from tpuscore import Scorer, ValidationError
from tpuscore.engine import compilation_cache


def test_a_warmed_geometry_compiles_nothing_when_requests_arrive(scorers, rng):
    base = scorers("qwen3_qknorm")
    scorer = Scorer(base.config, base.params, base.tokenizer)
    vocab = scorer.config.vocab_size
    scorer.score([0] + random_tokens(rng, 39, vocab), [[1]], [2])  # a user entry in the cache
    cache = scorer.get_backend("prefill_extend").cache
    before = (len(cache), cache.bytes, cache.hits, cache.partial_hits, cache.misses)

    compiles = compile_events()
    warmed = scorer.warmup([(37, 5, 6), (100, 20, 3)], backends=["prefill_extend"])
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
        scorer.score(query, items, [3, 4], backend="prefill_extend")
    scorer.warmup([(37, 5, 6)], backends=["prefill_extend"])  # already compiled: costs nothing
    assert len(compiles) == compiled

    # auto warms the backend the cost model picks for the geometry.
    (auto,) = scorer.warmup([(20, 4, 5)])
    compiled = len(compiles)
    query, items = [9] + random_tokens(rng, 19, vocab), [random_tokens(rng, 5, vocab)] * 4
    assert scorer.score(query, items, [3, 4]).backend == auto.backend
    assert len(compiles) == compiled


def test_warmup_takes_named_backends_and_refuses_a_bad_geometry(scorers):
    scorer = scorers("qwen2_bias")
    warmed = scorer.warmup([(8, 3, 4)], backends=["serial", "packed_dense"])
    assert [w.backend for w in warmed] == ["serial", "packed_dense"]
    with pytest.raises(ValueError, match="num_items > 0"):
        scorer.warmup([(8, 0, 4)])


def test_warmup_checks_every_geometry_before_any_runs(scorers):
    scorer = scorers("qwen2_bias")
    limit = scorer.config.max_position_embeddings
    refused = {
        (8, 0, 4): ("invalid_geometry", "geometries[1]"),
        (8, 2.0, 4): ("invalid_geometry", "geometries[1]"),
        (8, 2): ("invalid_geometry", "geometries[1]"),
        (-1, 2, 4): ("invalid_geometry", "geometries[1]"),
        (0, 3, 0): ("empty_sequence", "geometries[1].items"),
        (limit, 1, 1): ("sequence_too_long", "geometries[1].items"),
    }
    compiles = compile_events()
    for bad, (code, param) in refused.items():
        with pytest.raises(ValidationError) as error:
            scorer.warmup([(8, 3, 4), bad])  # the good geometry first: it must not run either
        assert (error.value.code, error.value.param) == (code, param), bad
    with pytest.raises(ValidationError) as error:
        scorer.warmup([(8, 3, 4)], backends=["nonesuch"])
    assert error.value.code == "unknown_backend"
    assert compiles == []


def test_a_geometry_past_the_bounds_is_refused_before_its_request_is_built(scorers):
    """(10**9, 2, 3) built 10**9 token ids (tens of GB: the process was OOM-killed) only for
    prepare to refuse them; such geometries are refused on their numbers."""
    scorer = scorers("qwen2_bias")
    refused = {
        (10**7, 2, 3): ("sequence_too_long", "geometries[0].items"),
        (4, 10**6, 3): ("too_many_items", "geometries[0].items"),
    }
    errors = {}
    tracemalloc.start()
    try:
        for geometry in refused:
            with pytest.raises(ValidationError) as error:
                scorer.warmup([geometry])
            errors[geometry] = (error.value.code, error.value.param)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**24, f"{peak} bytes allocated to refuse them"
    assert errors == refused


@pytest.fixture
def jax_cache_settings():
    """Start from JAX's default cache settings (no directory: conftest.py gives the run one) and
    put the run's back after a test that turns the cache on."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as jax_cache

    names = (
        "jax_compilation_cache_dir",
        "jax_compilation_cache_max_size",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    before = {name: getattr(jax.config, name) for name in names}
    jax.config.update("jax_compilation_cache_dir", None)
    jax_cache.reset_cache()
    yield
    for name, value in before.items():
        jax.config.update(name, value)
    jax_cache.reset_cache()


def test_the_latest_cache_directory_is_the_one_written(tmp_path, monkeypatch, jax_cache_settings):
    import jax

    monkeypatch.delenv(compilation_cache.ENV, raising=False)
    assert compilation_cache.enable() is None  # neither argument nor environment: off
    assert jax.config.jax_compilation_cache_dir is None
    monkeypatch.setenv(compilation_cache.ENV, str(tmp_path / "from_env"))
    for name in ("from_env", "given"):
        path = compilation_cache.enable(tmp_path / name if name == "given" else None)
        assert path == str(tmp_path / name)
        scale = len(os.listdir(tmp_path)) + 7  # a new constant: a new executable
        jax.jit(lambda x, scale=scale: x * scale)(np.ones(3)).block_until_ready()
        assert os.listdir(tmp_path / name), name  # written here, not to the first directory


# Which jax.monitoring event means what, in jax 0.10.2 (jax/_src/compiler.py, pxla.py):
# - "/jax/core/compile/backend_compile_duration" (what helpers.compile_events counts) times
#   `compile_or_get_cached`: once per executable obtained, whether XLA compiled it or it was
#   loaded from the persistent cache;
# - "/jax/compilation_cache/cache_hits": once per executable loaded from the persistent cache;
# - "/jax/compilation_cache/cache_misses": once per executable written to the cache, after XLA
#   compiled it (a compile under JAX's time or size floors is neither written nor counted).
# So XLA compilations = backend_compile_duration events - cache hits.
FIRST_REQUEST = textwrap.dedent(
    """
    import json, sys
    from jax import monitoring
    events = []
    monitoring.register_event_listener(lambda event, **_: events.append(event))
    monitoring.register_event_duration_secs_listener(lambda event, _s, **_: events.append(event))
    from tpuscore import Scorer, ValidationError
    from tpuscore.engine import compilation_cache
    scorer = Scorer.from_pretrained(sys.argv[1], dtype="float32")
    result = scorer.score([5, 6, 7], [[8, 9], [10]], [11, 12])
    print(json.dumps({
        "executables": events.count("/jax/core/compile/backend_compile_duration"),
        "misses": events.count("/jax/compilation_cache/cache_misses"),
        "hits": events.count("/jax/compilation_cache/cache_hits"),
        "logprobs": result.logprobs.tolist(),
    }))
    """
)


@pytest.mark.slow  # a subprocess
def test_a_new_process_loads_its_executables_from_the_cache(checkpoint_dir, tmp_path):
    env = {**os.environ, "TPUSCORE_COMPILATION_CACHE": str(tmp_path / "cache")}

    def first_request() -> dict:
        out = subprocess.run(
            [sys.executable, "-c", FIRST_REQUEST, str(checkpoint_dir("llama_gqa_untied"))],
            env=env, capture_output=True, text=True, timeout=300, check=True,
        )  # fmt: skip
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold, warm = first_request(), first_request()
    # Every executable compiled and written (none under a floor), and the next process compiles
    # none: each of its executables is loaded from the cache.
    assert cold["executables"] > 0 and cold["hits"] == 0
    assert cold["misses"] == cold["executables"] and os.listdir(tmp_path / "cache")
    assert warm["misses"] == 0 and warm["hits"] == warm["executables"] == cold["executables"]
    np.testing.assert_array_equal(warm["logprobs"], cold["logprobs"])
