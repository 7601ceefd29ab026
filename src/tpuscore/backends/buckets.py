"""Shape buckets: every length and count a jitted step sees is rounded up to one.

XLA compiles once per input shape, so a stream of requests of arbitrary geometry compiles a
bounded number of times.
"""

from __future__ import annotations

MIN_TOKEN_BUCKET = 16
MIN_LABEL_BUCKET = 16  # gathering a few more labels costs nothing; a recompile does


def bucket_tokens(n: int, minimum: int = MIN_TOKEN_BUCKET) -> int:
    """Smallest bucket that holds n: minimum * {1, 1.5, 2, 3}, then quarter steps between powers
    of two (64, 80, 96, 112, 128, 160, ... for minimum 16). Padding is at most a third of the
    bucket, and at most a fifth past 4 * minimum: there a step's time is its tokens' matmuls, so
    padding is paid in full (100-token items run in 112, not 128), and each extra bucket costs
    only a compile (docs/benchmarks.md, "Finer token buckets")."""
    size = minimum
    while size < n:
        if size < 4 * minimum:
            size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
        else:
            size += pow2_floor(size) // 4
    return size


def bucket_count(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def bucket_prefix(n: int) -> int:
    """Positions a cached query's K/V holds: the smallest power of two >= max(n, 16). Coarser
    than `bucket_tokens` (at most half padding, not a third) because every extend step's shape
    carries it: each bucket here multiplies the extend steps a scorer can compile."""
    return bucket_count(n, MIN_TOKEN_BUCKET)


def row_buckets(low: int, high: int, data: int = 1) -> list[int]:
    """The padded row counts of steps of low..high rows (as `Layout.rows` pads them): the powers
    of two from bucket_count(low) to bucket_count(high), each rounded up to a multiple of data."""
    counts, rows = set(), bucket_count(low)
    while low <= high and rows <= bucket_count(high):
        counts.add(-(-rows // data) * data)
        rows *= 2
    return sorted(counts)


def pow2_floor(n: int) -> int:
    """Largest power of two <= max(n, 1)."""
    return 1 << (max(n, 1).bit_length() - 1)
