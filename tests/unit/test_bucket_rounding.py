"""Shape buckets (backends/buckets.py): the literal ladders every jitted step's sizes round up to,
and the padding bound each ladder promises."""

import hypothesis
import hypothesis.strategies as st

from tpuscore.backends.buckets import (
    MIN_LABEL_BUCKET,
    MIN_TOKEN_BUCKET,
    bucket_count,
    bucket_item_tokens,
    bucket_prefix,
    bucket_tokens,
    fine_ladder,
    pow2_floor,
    row_buckets,
)

TOKEN_LADDER = [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
FINE_LADDER = [
    16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512,
    640, 768, 896, 1024,
]  # fmt: skip


def test_token_buckets_climb_by_one_and_a_half_then_four_thirds():
    assert MIN_TOKEN_BUCKET == 16
    assert sorted({bucket_tokens(n) for n in range(0, 1025)}) == TOKEN_LADDER
    for low, high in zip(TOKEN_LADDER, TOKEN_LADDER[1:], strict=False):
        assert bucket_tokens(low) == low and bucket_tokens(low + 1) == high


def test_the_fine_ladder_climbs_by_quarter_doublings_past_four_minimums():
    assert sorted({bucket_tokens(n, fine=True) for n in range(0, 1025)}) == FINE_LADDER
    for low, high in zip(FINE_LADDER, FINE_LADDER[1:], strict=False):
        assert bucket_tokens(low, fine=True) == low and bucket_tokens(low + 1, fine=True) == high
    sizes = [bucket_tokens(n, minimum=8, fine=True) for n in (0, 8, 9, 12, 13, 17, 33, 41)]
    assert sizes == [8, 8, 12, 12, 16, 24, 40, 48]
    assert [bucket_item_tokens(n, fine=True) for n in (5, 32, 33, 100)] == [8, 32, 48, 112]
    assert [bucket_item_tokens(n) for n in (5, 32, 33, 100)] == [8, 32, 48, 128]


def test_only_cpu_steps_take_the_fine_ladder():
    assert fine_ladder("cpu")
    assert not fine_ladder("gpu") and not fine_ladder("tpu")


def test_token_buckets_take_their_minimum():
    assert [bucket_tokens(n, minimum=8) for n in (0, 8, 9, 12, 13, 17)] == [8, 8, 12, 12, 16, 24]


@hypothesis.given(st.integers(0, 10**7), st.booleans())
def test_a_token_bucket_holds_n_with_at_most_a_third_padding_and_a_fifth_when_fine(n, fine):
    b = bucket_tokens(n, fine=fine)
    assert b >= max(n, 1)
    assert b == MIN_TOKEN_BUCKET or 3 * (b - n) <= b  # padding at most a third of the bucket
    assert not fine or n <= 4 * MIN_TOKEN_BUCKET or 5 * (b - n) <= b  # a fifth past 64


@hypothesis.given(st.integers(0, 10**7), st.integers(1, 64))
def test_count_buckets_are_the_smallest_power_of_two_at_or_above(n, minimum):
    b = bucket_count(n, minimum)
    assert b >= max(n, minimum)
    if b > max(minimum, 1):
        assert b & (b - 1) == 0 and b // 2 < n


def test_count_label_and_prefix_buckets():
    assert [bucket_count(n) for n in (0, 1, 2, 3, 4, 5, 64, 65)] == [1, 1, 2, 4, 4, 8, 64, 128]
    assert [bucket_count(n, MIN_LABEL_BUCKET) for n in (1, 16, 17)] == [16, 16, 32]
    # A cached query's K/V: powers of two from 16, coarser than the token ladder (no 24, 48).
    assert [bucket_prefix(n) for n in (0, 1, 16, 17, 24, 33, 100)] == [16, 16, 16, 32, 32, 64, 128]


def test_row_buckets_are_the_padded_powers_of_two_between_low_and_high():
    assert row_buckets(1, 1) == [1]
    assert row_buckets(1, 8) == [1, 2, 4, 8]
    assert row_buckets(3, 9) == [4, 8, 16]
    assert row_buckets(1, 8, data=4) == [4, 8]  # 1 and 2 rows pad to one row per data shard
    assert row_buckets(1, 8, data=3) == [3, 6, 9]
    assert row_buckets(5, 4) == []


def test_pow2_floor():
    assert [pow2_floor(n) for n in (-3, 0, 1, 2, 3, 4, 1023, 1024)] == [1, 1, 1, 2, 2, 4, 512, 1024]
