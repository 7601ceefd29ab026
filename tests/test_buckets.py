"""Bucketing: a stream of arbitrary request geometries compiles a bounded number of times."""

import pytest

from helpers import compile_events, random_tokens
from tpuscore.backends import serial
from tpuscore.backends.buckets import (
    MIN_LABEL_BUCKET,
    MIN_TOKEN_BUCKET,
    bucket_count,
    bucket_packed_tokens,
    bucket_tokens,
)
from tpuscore.backends.contract import make_batch


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 24, 25, 100, 3000])
def test_token_buckets_hold_n_with_at_most_a_third_padding(n):
    b = bucket_tokens(n)
    assert b >= max(n, 1)
    assert b == MIN_TOKEN_BUCKET or b <= 1.5 * n


@pytest.mark.parametrize("n", [1, 100, 256, 257, 400, 449, 1000, 2050, 3000])
def test_packed_rows_past_256_tokens_pad_at_most_a_ninth_on_a_cpu(n):
    fine = bucket_packed_tokens(n, fine=True)
    assert fine >= n and (fine <= 256 or fine <= n * 9 / 8)
    assert fine <= bucket_tokens(n, fine=True)  # never coarser than the token ladder
    assert bucket_packed_tokens(n) == bucket_tokens(n)  # accelerators: the coarse ladder
    assert bucket_packed_tokens(400, fine=True) == 416  # SGLang's row: 448 on the token ladder


def test_count_buckets_are_powers_of_two():
    assert [bucket_count(n) for n in (0, 1, 2, 3, 5, 64, 65)] == [1, 1, 2, 4, 8, 64, 128]
    assert bucket_count(2, minimum=16) == 16


@pytest.mark.slow  # compiles every bucket of a stream
def test_request_stream_compiles_once_per_bucket(scorers, rng):
    scorer = scorers("qwen3_qknorm")
    vocab = scorer.config.vocab_size
    requests = []
    for _ in range(16):
        query = random_tokens(rng, int(rng.integers(0, 200)), vocab)
        items = [
            random_tokens(rng, int(n), vocab) for n in rng.integers(1, 50, rng.integers(1, 40))
        ]
        labels = random_tokens(rng, int(rng.integers(1, 7)), vocab)
        requests.append((query, items, labels))

    runner = scorer.get_backend("serial")
    compiles = compile_events()
    shapes = []
    for query, items, labels in requests:
        shapes += runner.score(make_batch(query, items, labels, False)).stats.shapes
    first_pass = len(compiles)
    distinct = {s.shape for s in shapes}
    # Each distinct bucket shape compiles once, however many requests hit it ...
    assert first_pass == len(distinct)
    # ... and every shape is a bucket, so the count has a bound that no request stream can pass.
    longest = max(len(q) + max(map(len, items)) for q, items, _ in requests)
    token_buckets = {bucket_tokens(n, fine=True) for n in range(1, longest + 1)}  # a CPU's ladder
    row_buckets = {bucket_count(n) for n in range(1, serial.MAX_ROWS + 1)}
    label_buckets = {bucket_count(n, MIN_LABEL_BUCKET) for n in range(1, 7)}
    assert len(label_buckets) == 1
    for rows, length, labels in distinct:
        assert length in token_buckets and rows in row_buckets and labels in label_buckets
    assert first_pass <= len(token_buckets) * len(row_buckets) * len(label_buckets)
    for query, items, labels in requests:  # the same stream again compiles nothing
        scorer.score(query, items, labels, backend="serial")
    assert len(compiles) == first_pass
