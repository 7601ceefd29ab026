"""Shape buckets: every length and count a jitted step sees is rounded up to one.

XLA compiles once per input shape, so a stream of requests of arbitrary geometry compiles a
bounded number of times.
"""

from __future__ import annotations

from typing import Any

MIN_TOKEN_BUCKET = 16
MIN_LABEL_BUCKET = 16  # gathering a few more labels costs nothing; a recompile does
# `split_rows`' threshold on a CPU: a step's fixed cost there is mostly reading every weight
# once, worth about 30 tokens' compute, so padding of 128 tokens costs more than a step.
CPU_SPLIT_PADDING_TOKENS = 128


def bucket_tokens(n: int, minimum: int = MIN_TOKEN_BUCKET, *, fine: bool = False) -> int:
    """Smallest bucket that holds n: minimum * {1, 1.5, 2, 3, 4, 6, ...}, at most a third
    padding; fine (`fine_ladder`): past 4 * minimum, four steps to each doubling instead (64,
    80, 96, 112, 128, 160, ... for minimum 16), at most a fifth."""
    size = minimum
    while size < n:
        if fine and size >= 4 * minimum:
            size += pow2_floor(size) // 4
        else:
            size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size


def bucket_packed_tokens(n: int, *, fine: bool = False) -> int:
    """Packed-row lengths: `bucket_tokens`; fine, past 256, eight steps to each doubling (288,
    320, 352, ..., at most a ninth padding). A packed row's padding is paid by every layer's
    matmuls (SGLang's 400-token row ran in 448), and a packed length adds few shapes: one per
    row count and label width."""
    if not fine or n <= 256:
        return bucket_tokens(n, fine=fine)
    size = 256
    while size < n:
        size += pow2_floor(size) // 8
    return size


def bucket_item_tokens(n: int, *, fine: bool = False) -> int:
    """Item-length buckets: multiples of 4 up to 32, then `bucket_tokens` (fine: its fine
    ladder). Items are short and each padding token pays attention to the whole query: 20
    tokens padded to 24 waste a sixth."""
    return max(4, -(-n // 4) * 4) if n <= 32 else bucket_tokens(n, fine=fine)


def fine_ladder(platform: str) -> bool:
    """Whether steps on `platform` pad tokens to the fine ladder of `bucket_tokens`. On a CPU a
    step's time is its tokens' matmuls, so padding is paid in full (100-token items in 128, not
    112), and a shape more costs one compile (docs/benchmarks.md, "Finer token buckets").
    Accelerators keep the coarser ladder, whose shapes their profiles were calibrated on and
    whose compiles cost more, until a device run measures the finer one."""
    return platform == "cpu"


class PlatformBuckets:
    """Token and item buckets on the ladder of the model's platform (`fine_ladder`): what a
    backend's planning and shape set pad to."""

    model: Any  # a `Model`: its platform picks the ladder

    def token_bucket(self, n: int) -> int:
        """`bucket_tokens` of n on this model's platform's ladder."""
        return bucket_tokens(n, fine=fine_ladder(self.model.platform))

    def packed_bucket(self, n: int) -> int:
        """`bucket_packed_tokens` of n on this model's platform's ladder."""
        return bucket_packed_tokens(n, fine=fine_ladder(self.model.platform))

    def item_bucket(self, n: int) -> int:
        """`bucket_item_tokens` of n on this model's platform's ladder."""
        return bucket_item_tokens(n, fine=fine_ladder(self.model.platform))


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


def split_rows(count: int, row_tokens: int, threshold: int, padded_rows) -> int:
    """The rows a step of `count` rows of `row_tokens` tokens takes: all of them, or where
    padding them to `padded_rows(count)` (a row bucket) would add `threshold` tokens or more
    (0: never), the largest row bucket below (the rest go to the next steps, split again).
    The steps' row counts stay in the shape set; what padding cost becomes a step's fixed cost."""
    padding = (padded_rows(count) - count) * row_tokens
    if not threshold or padding < threshold:
        return count
    below = pow2_floor(count)
    return below if padded_rows(below) == below else count


def pow2_floor(n: int) -> int:
    """Largest power of two <= max(n, 1)."""
    return 1 << (max(n, 1).bit_length() - 1)
