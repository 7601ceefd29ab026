"""The backend contract: what the facade hands a backend and what a backend hands back.

A backend receives a validated `ScoreBatch`, padded to bucket shapes, and returns a
`BackendOutput`: logprobs in the batch's padded shape, a validity mask, and the stats of the
device steps it ran. Backends build their output through `BackendOutput.for_batch`, which keeps
every step's result on device until the end, so all steps of a call are dispatched before the
host waits for any.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from tpuscore.buckets import MIN_LABEL_BUCKET, bucket_count, bucket_tokens


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


@attrs.define
class StepStats:
    """What a backend ran for one batch.

    steps: jitted device calls; chunks: item batches or packed chunks among them; tokens: token
    positions run through the model (usage accounting); shapes: (step name, padded input shape)
    of every step, the shapes XLA compiles for.
    """

    steps: int = 0
    chunks: int = 0
    tokens: int = 0
    shapes: list[tuple[str, tuple[int, ...]]] = attrs.Factory(list)


@attrs.frozen
class BackendOutput:
    """logprobs [I, C] float32 in the batch's padded shape; valid [I]: rows that were scored."""

    logprobs: np.ndarray
    valid: np.ndarray
    stats: StepStats

    @property
    def num_tokens(self) -> int:
        return self.stats.tokens

    @staticmethod
    def for_batch(batch: ScoreBatch) -> OutputBuilder:
        """A builder for this batch's output: record each step, then `build()`."""
        return OutputBuilder(batch)


class OutputBuilder:
    """Collects a backend's steps for one batch. Results stay on device until `build`, so the
    host dispatches every step before it waits for the first."""

    def __init__(self, batch: ScoreBatch):
        self._shape = (batch.items.shape[0], batch.label_ids.shape[0])
        self._pending: list[tuple[np.ndarray, Any]] = []
        self.stats = StepStats()

    def step(self, name: str, shape: tuple[int, ...], tokens: int) -> None:
        """Count one device step of input `shape` that ran `tokens` real token positions."""
        self.stats.steps += 1
        self.stats.tokens += tokens
        self.stats.shapes.append((name, tuple(int(n) for n in shape)))

    def scores(self, rows: np.ndarray, logprobs: Any) -> None:
        """The step just counted scored batch rows `rows`: its logprobs [>= len(rows), C]."""
        self.stats.chunks += 1
        self._pending.append((np.asarray(rows), logprobs))

    def build(self) -> BackendOutput:
        logprobs = np.zeros(self._shape, np.float32)
        valid = np.zeros(self._shape[0], bool)
        for rows, out in self._pending:
            logprobs[rows] = np.asarray(out)[: len(rows)]
            valid[rows] = True
        return BackendOutput(logprobs, valid, self.stats)
