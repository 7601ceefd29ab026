"""The backend contract: what the facade hands a backend and what a backend hands back.

A backend receives validated `ScoreBatch`es, padded to bucket shapes, one per group (a query with
its items and labels), and returns a `BackendOutput` per group: logprobs in the batch's padded
shape, a validity mask, and the stats of the device steps it ran. `score(batch)` scores one
group; `score_groups(batches)`, where a backend has it, scores several at once and may mix their
rows in one device step. Backends build their output through `BackendOutput.for_batch` (one
group) or `BackendOutput.for_groups` (several), which keep every step's result on device until
the end, so all steps of a call are dispatched before the host waits for any.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from tpuscore.backends.buckets import (
    MIN_LABEL_BUCKET,
    bucket_count,
    bucket_tokens,
    row_buckets,
)
from tpuscore.parallel.sharding import to_host


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


def stack_labels(label_ids: Sequence[np.ndarray], rows: int) -> np.ndarray:
    """Label ids per row [rows, C] for rows of different groups: row r gets label_ids[r], and all
    are padded with 0 to the widest (each is a label bucket already, so the width is one too).
    Rows past len(label_ids) are padding."""
    labels = np.zeros((rows, max(len(ids) for ids in label_ids)), np.int32)
    for r, ids in enumerate(label_ids):
        labels[r, : len(ids)] = ids
    return labels


@attrs.frozen
class ShapeLimits:
    """The requests a scorer's shape set covers: queries of at most `query_tokens` tokens, items
    of at most `item_tokens`, at most `labels` label ids, any number of items and requests per
    call. Items per step are the backends' own (their budgets and options)."""

    query_tokens: int
    item_tokens: int
    labels: int

    def label_widths(self) -> list[int]:
        """The label buckets (`make_batch`) of 1..labels labels."""
        return row_buckets(MIN_LABEL_BUCKET, bucket_count(self.labels, MIN_LABEL_BUCKET))


# A step shape: (jitted function, padded input shape), as `StepStats.shapes` records them.
Shape = tuple[str, tuple[int, ...]]


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

    @staticmethod
    def for_groups(batches: Sequence[ScoreBatch]) -> GroupsOutputBuilder:
        """A builder for the outputs of several groups whose steps may mix them."""
        return GroupsOutputBuilder(batches)


class GroupsOutputBuilder:
    """Collects a backend's steps for the groups (batches) of one call, where a step may score
    rows of several groups. Results stay on device until `build`, so the host dispatches every
    step before it waits for the first, and reads each step's result back once.

    Each group's stats count the steps it took part in, its own tokens and the chunks (packed
    rows or item batches) that scored its items; `steps` counts every step of the call once.
    """

    def __init__(self, batches: Sequence[ScoreBatch]):
        self._shapes = [(b.items.shape[0], b.label_ids.shape[0]) for b in batches]
        self._pending: list[list[tuple[np.ndarray, Any, Any]]] = [[] for _ in batches]
        self.stats = [StepStats() for _ in batches]
        self.steps = 0

    def step(self, name: str, shape: tuple[int, ...], tokens: Mapping[int, int]) -> None:
        """Count one device step of input `shape` in which group g ran tokens[g] real token
        positions (the groups it serves, tokens 0 for one that only reads its results)."""
        self.steps += 1
        shape = tuple(int(n) for n in shape)
        for g, n in tokens.items():
            stats = self.stats[g]
            stats.steps += 1
            stats.tokens += int(n)
            stats.shapes.append((name, shape))

    def scores(self, group: int, rows: np.ndarray, logprobs: Any, index: Any = ()) -> None:
        """The step just counted scored rows `rows` of batch `group`: logprobs[index] holds
        their logprobs [>= len(rows), >= C] (a device array, read back in `build`)."""
        self.stats[group].chunks += 1
        self._pending[group].append((np.asarray(rows), logprobs, index))

    def build(self) -> list[BackendOutput]:
        host: dict[int, np.ndarray] = {}  # each step's result read back once
        outputs = []
        for shape, pending, stats in zip(self._shapes, self._pending, self.stats, strict=True):
            logprobs = np.zeros(shape, np.float32)
            valid = np.zeros(shape[0], bool)
            for rows, out, index in pending:
                if id(out) not in host:
                    host[id(out)] = to_host(out)
                logprobs[rows] = host[id(out)][index][: len(rows), : shape[1]]
                valid[rows] = True
            outputs.append(BackendOutput(logprobs, valid, stats))
        return outputs


class OutputBuilder:
    """Collects a backend's steps for one batch (`GroupsOutputBuilder` with one group)."""

    def __init__(self, batch: ScoreBatch):
        self._groups = GroupsOutputBuilder([batch])
        self.stats = self._groups.stats[0]

    def step(self, name: str, shape: tuple[int, ...], tokens: int) -> None:
        """Count one device step of input `shape` that ran `tokens` real token positions."""
        self._groups.step(name, shape, {0: tokens})

    def scores(self, rows: np.ndarray, logprobs: Any) -> None:
        """The step just counted scored batch rows `rows`: its logprobs [>= len(rows), C]."""
        self._groups.scores(0, rows, logprobs)

    def build(self) -> BackendOutput:
        return self._groups.build()[0]
