"""Packed layouts: the query and several items in one sequence, each item isolated from the others.

No delimiter tokens: item boundaries are known in token space. Each item's RoPE positions restart
at the query length, and the segment mask (`kernels.segment.mask`) lets it see the query and
itself only, so it is scored on exactly the tokens serial scoring sees. Query [q0 q1], items
[a0 a1], [] and [b0], bucket 8:

    index       0   1   2   3   4   5   6   7
    token       q0  q1  a0  a1  b0  pad pad pad
    position    0   1   2   3   2   0   0   0
    seg_start   0   0   2   2   4   5   6   7
    scored at   a: 3, the empty item: 1 (the query's last token), b: 4

Padding rows are segments of their own, so every row has a key to attend to.

Several packed sequences, each with its own query, go in the batch axis (`stack`): one per row,
with `prefix_len` and `seg_start` per row. Padding rows are all padding: prefix_len 0 and each
token a segment of its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import attrs
import numpy as np

from tpuscore.backends.buckets import bucket_count
from tpuscore.backends.contract import ScoreBatch

NO_SLOT = -1  # score_index of a slot no item fills; a row's filled slots come first


@attrs.frozen
class PackedChunk:
    """One packed sequence: tokens, positions and seg_start [T]; score_index [I] (the position
    whose next token is scored, per item, padded with NO_SLOT); rows: which batch rows it scores."""

    tokens: np.ndarray
    positions: np.ndarray
    seg_start: np.ndarray
    prefix_len: int
    score_index: np.ndarray
    rows: np.ndarray


def pack(batch: ScoreBatch, rows: np.ndarray, length: int) -> PackedChunk:
    """Pack the query and the batch rows `rows` into `length` tokens (at least as many as they
    hold), scoring bucket_count(len(rows)) positions."""
    Q, rows = batch.query_len, np.asarray(rows, dtype=np.intp)
    lens = batch.item_lens[rows]
    ends = Q + np.cumsum(lens)  # each item's end; the rows' items run back to back from Q
    starts, end = ends - lens, int(ends[-1]) if len(rows) else Q
    tokens = np.zeros(length, np.int32)
    positions = np.zeros(length, np.int32)
    seg_start = np.arange(length, dtype=np.int32)  # padding: a segment of its own
    tokens[:Q], positions[:Q], seg_start[:Q] = batch.query[:Q], np.arange(Q), 0
    items = batch.items[rows]
    tokens[Q:end] = items[np.arange(items.shape[1]) < lens[:, None]]  # row-major: in order
    seg_start[Q:end] = np.repeat(starts, lens)
    positions[Q:end] = np.arange(Q, end) - seg_start[Q:end] + Q
    score_index = np.full(bucket_count(len(rows)), NO_SLOT, np.int32)
    score_index[: len(rows)] = ends - 1
    score_index[: len(rows)][lens == 0] = Q - 1  # an empty item: scored after the query
    return PackedChunk(tokens, positions, seg_start, Q, score_index, rows)


def plan(batch: ScoreBatch, max_tokens: int, max_items: int | None = None) -> Iterator[np.ndarray]:
    """Split the batch's items, in order, into chunks of at most max_tokens query + item tokens
    and at most max_items items (batch rows per chunk). An item too long to share a chunk gets
    one of its own."""
    Q, lens = batch.query_len, batch.item_lens[: batch.num_items]
    start, used = 0, Q
    for i, n in enumerate(lens):
        full = max_items is not None and i - start >= max_items
        if i > start and (used + n > max_tokens or full):
            yield np.arange(start, i)
            start, used = i, Q
        used += int(n)
    if start < len(lens):
        yield np.arange(start, len(lens))


def balanced(batch: ScoreBatch, count: int) -> list[np.ndarray]:
    """The batch's items, in order, in `count` chunks of about equal item tokens (each chunk's
    end where the running total of tokens first reaches its share); fewer where items are too
    few or too long to make that many."""
    lens = batch.item_lens[: batch.num_items]
    ends = np.cumsum(lens)
    shares = ends[-1] * np.arange(1, count) / count
    cuts = np.unique(np.searchsorted(ends, shares, side="left") + 1)
    cuts = cuts[(cuts > 0) & (cuts < len(lens))]
    return np.split(np.arange(len(lens)), cuts)


@attrs.frozen
class PackedRows:
    """Packed sequences in the batch axis: tokens, positions, seg_start [B, T]; prefix_len [B];
    score_index [B, I] (padded with NO_SLOT). Rows past the chunks given are padding."""

    tokens: np.ndarray
    positions: np.ndarray
    seg_start: np.ndarray
    prefix_len: np.ndarray
    score_index: np.ndarray


def stack(chunks: Sequence[PackedChunk], rows: int, slots: int) -> PackedRows:
    """The chunks (all of one length T, none scoring more than `slots` items) as the first rows
    of `rows` packed rows, scoring `slots` positions per row."""
    T = len(chunks[0].tokens)
    tokens = np.zeros((rows, T), np.int32)
    positions = np.zeros((rows, T), np.int32)
    seg_start = np.broadcast_to(np.arange(T, dtype=np.int32), (rows, T)).copy()
    prefix_len = np.zeros(rows, np.int32)
    score_index = np.full((rows, slots), NO_SLOT, np.int32)
    for r, chunk in enumerate(chunks):
        tokens[r], positions[r], seg_start[r] = chunk.tokens, chunk.positions, chunk.seg_start
        prefix_len[r] = chunk.prefix_len
        score_index[r, : len(chunk.score_index)] = chunk.score_index
    return PackedRows(tokens, positions, seg_start, prefix_len, score_index)
