"""Shape buckets: every length and count a jitted step sees is rounded up to one.

XLA compiles once per input shape, so a stream of requests of arbitrary geometry compiles a
bounded number of times.
"""

from __future__ import annotations

MIN_TOKEN_BUCKET = 16
MIN_LABEL_BUCKET = 16  # gathering a few more labels costs nothing; a recompile does


def bucket_tokens(n: int, minimum: int = MIN_TOKEN_BUCKET) -> int:
    """Smallest of minimum * {1, 1.5, 2, 3, 4, 6, ...} that holds n: at most 1/3 padding."""
    size = minimum
    while size < n:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size


def bucket_count(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def pow2_floor(n: int) -> int:
    """Largest power of two <= max(n, 1)."""
    return 1 << (max(n, 1).bit_length() - 1)
