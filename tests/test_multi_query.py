"""Requests with different queries share device steps, and their scores do not depend on it.

The backends that mix queries (packed_dense, packed_segment, prefill_extend) get every group of a
call at once (`score_groups`). These tests count their jitted calls, hold them to serial, and
check batch invariance: a request's scores bit-identical whatever shares its step shapes, and
within float rounding of scoring it alone (docs/batch-invariance.md).
"""

import collections
import functools
import math

import jax
import numpy as np
import pytest

from helpers import ALONE_VS_BATCHED, random_tokens, seeded_rng
from tpuscore import Scorer, backends
from tpuscore.backends import BackendOutput
from tpuscore.backends.buckets import bucket_count, bucket_tokens
from tpuscore.backends.contract import make_batch
from tpuscore.backends.packed.memory import packed_step_bytes
from tpuscore.backends.packed.plan import SLOT_TOKENS
from tpuscore.backends.prefill_extend.memory import prefill_row_bytes
from tpuscore.backends.reference import last_token_logprobs

CASE = "qwen2_bias"  # one tiny checkpoint for every test here: compiled steps are shared
MIXING = ("packed_dense", "packed_segment", "prefill_extend")
STEPS = {  # the jitted step functions of each backend, by pass
    "packed_dense": {"packed": ("score_packed",)},
    "packed_segment": {"packed": ("score_packed",)},
    "prefill_extend": {
        "prefill": ("prefill", "prefill_rows"),
        "extend": ("score_items", "score_mixed_items"),
    },
}


def _count_calls(scorer: Scorer, backend: str) -> collections.Counter:
    """Count calls of the backend's jitted steps in this scorer's instance, per pass."""
    runner, calls = scorer.get_backend(backend), collections.Counter()
    for name, functions in STEPS[backend].items():
        for function in functions:
            original = getattr(runner, function)

            @functools.wraps(original)
            def counted(*args, _original=original, _pass=name, **kwargs):
                calls[_pass] += 1
                return _original(*args, **kwargs)

            setattr(runner, function, counted)
    return calls


def _request(rng, vocab: int, query_len: int, item_lens, labels) -> dict:
    return {
        "query": random_tokens(rng, query_len, vocab),
        "items": [random_tokens(rng, int(n), vocab) for n in item_lens],
        "label_token_ids": labels,
    }


@pytest.fixture(scope="module")
def sixty_four(scorers):
    """64 requests, each with its own short query, two short items and its own labels; and each
    request's logprobs from the reference backend."""
    rng = seeded_rng("test_multi_query.sixty_four")
    scorer = scorers(CASE)
    vocab = scorer.config.vocab_size
    requests = [
        _request(
            rng,
            vocab,
            int(rng.integers(2, 12)),
            rng.integers(1, 6, size=2),
            rng.choice(vocab, size=int(rng.integers(1, 4)), replace=False).tolist(),
        )
        for _ in range(64)
    ]
    requests[1]["query"] = []  # an empty query among the others
    requests[2]["items"][0] = []  # an empty item: scores its query's last token
    expected = scorer.score_batch(requests, backend="reference")
    return requests, [r.logprobs for r in expected]


@pytest.mark.parametrize("backend", MIXING)
def test_64_different_queries_share_device_steps(scorers, sixty_four, backend):
    base = scorers(CASE)
    requests, expected = sixty_four
    # A budget of 16 rows at the longest length, so the 64 requests need several steps.
    if backend == "prefill_extend":
        longest_query = max(len(r["query"]) for r in requests)
        one_row = prefill_row_bytes(base.config, bucket_tokens(longest_query), 16)
        options = {backend: {"activation_bytes": 16 * one_row}}
    else:
        longest = max(len(r["query"]) + sum(map(len, r["items"])) for r in requests)
        length = bucket_tokens(longest)
        if backend == "packed_segment":
            length = -(-length // 128) * 128  # whole kernel tiles
        slots = bucket_count(-(-length // SLOT_TOKENS))  # a row's item slots at this length
        one_row = packed_step_bytes(
            base.config, 1, length, slots, dense_mask=backend == "packed_dense"
        )
        options = {backend: {"activation_bytes": 16 * one_row}}
    scorer = Scorer(base.config, base.params, base.tokenizer, backend_options=options)
    calls = _count_calls(scorer, backend)
    results = scorer.score_batch(requests, backend=backend)
    for result, want in zip(results, expected, strict=True):
        np.testing.assert_allclose(result.logprobs, want, atol=1e-4, rtol=0)
    assert sum(r.num_tokens for r in results) == sum(
        len(r["query"]) + sum(map(len, r["items"])) for r in requests
    )  # each query once, each item once

    runner = scorer.get_backend(backend)
    if backend == "prefill_extend":
        prefill_rows = runner.prefill_batch_rows(bucket_tokens(longest_query), bucket_tokens(0))
        extend_rows = runner.batch_rows(8, row_prefix_len=bucket_tokens(longest_query))
        assert prefill_rows == 16
        assert calls["prefill"] <= math.ceil(63 / prefill_rows)  # one query is empty
        assert calls["extend"] <= math.ceil(128 / extend_rows)
        print(f"prefill steps {calls['prefill']}, extend steps {calls['extend']}")
    else:
        rows = runner.rows(length)
        assert 16 <= rows < 64
        assert calls["packed"] <= math.ceil(64 / rows)
        print(f"{calls['packed']} steps of up to {rows} rows")
    assert sum(calls.values()) < 64 // 2


@pytest.mark.parametrize("backend", MIXING)
def test_scores_do_not_depend_on_what_shares_the_step(scorers, rng, backend):
    """Same step shapes: not one bit changes, whatever the other rows hold. Alone (other
    shapes): within float32 rounding. Every request has the same geometry, so the shapes are."""
    base = scorers(CASE)
    vocab = base.config.vocab_size

    def request():
        return _request(rng, vocab, 10, (2, 5, 3), [1, 2])

    target = request()
    crowds = [[request() for _ in range(3)] for _ in range(2)]
    scorer = Scorer(base.config, base.params, base.tokenizer)
    cache = scorer.get_backend("prefill_extend").cache
    among = []
    for i, crowd in enumerate(crowds):
        cache.clear()
        requests = [*crowd[:i], target, *crowd[i:]]  # and in another row
        among.append(scorer.score_batch(requests, backend=backend)[i].logprobs)
    np.testing.assert_array_equal(among[0], among[1])
    cache.clear()
    alone = scorer.score(**target, backend=backend).logprobs
    np.testing.assert_allclose(alone, among[0], **ALONE_VS_BATCHED)
    differ = int((alone != among[0]).sum())
    print(
        f"alone vs among others: {differ}/{alone.size} differ, max {np.abs(alone - among[0]).max()}"
    )


@pytest.mark.parametrize("backend", MIXING)
def test_groups_with_one_query_and_other_labels(scorers, rng, backend):
    """Groups that share a query but not labels: one prefill, steps that mix their labels."""
    scorer = scorers(CASE)
    vocab = scorer.config.vocab_size
    query = random_tokens(rng, 17, vocab)
    requests = [
        _request(rng, vocab, 0, rng.integers(0, 9, size=3), labels)
        for labels in ([1, 2], [7], [3, 4, 5, 6])
    ]
    for r in requests:
        r["query"] = query
    batches = [make_batch(r["query"], r["items"], r["label_token_ids"], False) for r in requests]
    runner = Scorer(scorer.config, scorer.params, scorer.tokenizer).get_backend(backend)
    outputs = runner.score_groups(batches)
    for r, out in zip(requests, outputs, strict=True):
        expected = scorer.score(**r, backend="reference").logprobs
        got = out.logprobs[: len(r["items"]), : len(r["label_token_ids"])]
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
        assert out.valid[: len(r["items"])].all() and not out.valid[len(r["items"]) :].any()
    assert max(out.stats.steps for out in outputs) <= 2  # at most a prefill and one extend


class OneGroupAtATime(backends.PerGroupBackend):
    """A user backend with only `score(batch)`: the reference's scores, one group per call."""

    def __init__(self, model, options):
        self.config, self.params = model.config, jax.tree.map(np.asarray, model.weights)
        self.calls = 0

    def score(self, batch):
        self.calls += 1
        out = BackendOutput.for_batch(batch)
        for i in range(batch.num_items):
            sequence = batch.sequence(i)
            out.step("reference", sequence.shape, len(sequence))
            full = last_token_logprobs(self.config, self.params, sequence)
            out.scores([i], full[None, batch.label_ids])
        return out.build()


def test_a_backend_with_only_score_gets_one_call_per_group(scorers, rng):
    backends.register("one_group", OneGroupAtATime)
    base = scorers(CASE)
    scorer = Scorer(base.config, base.params, base.tokenizer)
    vocab = base.config.vocab_size
    requests = [_request(rng, vocab, n, (3, 1), [4, 5]) for n in (2, 6, 6)]
    requests[2]["query"] = requests[1]["query"]  # one group with request 1
    results = scorer.score_batch(requests, backend="one_group")
    assert scorer.get_backend("one_group").calls == 2
    for request, result in zip(requests, results, strict=True):
        expected = scorer.score(**request, backend="reference")
        np.testing.assert_allclose(result.logprobs, expected.logprobs, atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", MIXING)
def test_a_step_mixes_groups_padded_to_different_item_buckets(scorers, rng, backend):
    """Two queries' leftover items share a step whose item length is the longer group's bucket:
    the shorter group's items (padded only to its own bucket) are copied into it."""
    scorer = scorers(CASE)
    vocab = scorer.config.vocab_size
    requests = [
        _request(rng, vocab, 9, (3, 2), [1, 2]),  # item bucket 4
        _request(rng, vocab, 6, (18, 5), [1, 2]),  # item bucket 20
    ]
    results = Scorer(scorer.config, scorer.params, scorer.tokenizer).score_batch(
        requests, backend=backend
    )
    for r, got in zip(requests, results, strict=True):
        expected = scorer.score(**r, backend="reference").logprobs
        np.testing.assert_allclose(got.logprobs, expected, atol=1e-4, rtol=0)
