"""What the facade hands a backend and what a backend hands back, padded to bucket shapes.

XLA compiles once per input shape, so every length and count is rounded up to a bucket: a stream
of requests of arbitrary geometry compiles a bounded number of times.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

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


@attrs.frozen
class ScoreBatch:
    """A validated request. Rows at or past `num_items` and labels past `num_labels` are padding.

    query [Q], items [I, L], item_lens [I], label_ids [C]; all int32, zero-padded.
    """

    query: np.ndarray
    query_len: int
    items: np.ndarray
    item_lens: np.ndarray
    num_items: int
    label_ids: np.ndarray
    num_labels: int
    item_first: bool

    def sequence(self, i: int) -> np.ndarray:
        """The tokens scored for item i: query + item, or item + query with item_first."""
        q, it = self.query[: self.query_len], self.items[i, : self.item_lens[i]]
        return np.concatenate([it, q] if self.item_first else [q, it])

    @property
    def sequence_lens(self) -> np.ndarray:
        """Scored-sequence length per real item [num_items]."""
        return self.query_len + self.item_lens[: self.num_items]


@attrs.frozen
class BackendOutput:
    """logprobs [I, C] float32 in the batch's padded shape; valid [I] marks rows that were scored.

    num_tokens counts the token positions the backend ran through the model (usage accounting).
    """

    logprobs: np.ndarray
    valid: np.ndarray
    num_tokens: int


def make_batch(
    query: Sequence[int], items: Sequence[Sequence[int]], label_ids: Sequence[int], item_first: bool
) -> ScoreBatch:
    """Pad validated token ids to bucket shapes."""
    n = len(items)
    lens = [len(it) for it in items]
    query_arr = np.zeros(bucket_tokens(len(query)), np.int32)
    query_arr[: len(query)] = query
    items_arr = np.zeros((bucket_count(n), bucket_tokens(max(lens, default=0))), np.int32)
    for i, it in enumerate(items):
        items_arr[i, : len(it)] = it
    item_lens = np.zeros(items_arr.shape[0], np.int32)
    item_lens[:n] = lens
    labels_arr = np.zeros(bucket_count(len(label_ids), MIN_LABEL_BUCKET), np.int32)
    labels_arr[: len(label_ids)] = label_ids
    return ScoreBatch(
        query=query_arr,
        query_len=len(query),
        items=items_arr,
        item_lens=item_lens,
        num_items=n,
        label_ids=labels_arr,
        num_labels=len(label_ids),
        item_first=item_first,
    )
