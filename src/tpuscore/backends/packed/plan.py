"""The packed backends' plan: each group's items split into chunks, one packed row each, and the
chunks into device steps of rows of one length (`PackedPlanning.schedule`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import attrs
import numpy as np

from tpuscore.backends import work
from tpuscore.backends.buckets import PlatformBuckets, bucket_count, pow2_floor, split_rows
from tpuscore.backends.contract import Plan, ScoreBatch
from tpuscore.backends.packed import memory, packing
from tpuscore.models.model import Model

MAX_PACKED_TOKENS = 16384  # bounds the token buckets a stream of requests can compile
MAX_STEP_TOKENS = 1 << 16  # tokens in all rows of one step: bounds the row counts likewise
# Packed tokens per scored position: a row of T tokens scores up to about T / 12 items (`slots`),
# so its LM head costs a few percent of its layers. Rows of shorter items are padded longer.
SLOT_TOKENS = 12
EXTRA_CHUNKS = 4  # chunks past the fewest that `chunks` tries, to pad less


@attrs.frozen
class PackedStep:
    """One device step: `chunks` (group, batch rows of that group's items), one packed row each,
    padded to `rows` rows of `length` tokens; `tokens` real tokens per chunk."""

    length: int
    rows: int
    chunks: tuple[tuple[int, np.ndarray], ...]
    tokens: tuple[int, ...]


class PackedPlanning(PlatformBuckets):
    """The planning half of the packed backends (module doc)."""

    model: Model
    budget: int
    dense_mask: bool
    split_padding_tokens: int

    def plan(self, batches: Sequence[ScoreBatch]) -> Plan:
        """The `schedule` of these groups."""
        return Plan(tuple(batches), self.schedule(batches))

    def schedule(self, batches: Sequence[ScoreBatch]) -> list[PackedStep]:
        """The device steps that score these groups.

        Each group's items are split, in order, into chunks (`chunks`): the fewest that fit the
        budget's longest packed length, with no more items than their logits leave room for there
        (`chunk_limits`, `packing.plan`, `slots`), or a few more of equal tokens that pad less;
        each chunk is one packed row, its query first, of `length_for` its tokens and items.
        Rows are taken longest first: a step's length is the token bucket of its longest chunk,
        and it takes as many of the next chunks as fit that length's memory (a power of two of
        rows, the last step padded to one unless that padding would hold `split_padding_tokens`
        tokens: then the largest power of two below, `buckets.split_rows`), so chunks of similar
        length share a step.
        """
        chunks = [
            (g, rows, batch.query_len + int(batch.item_lens[rows].sum()))
            for g, batch in enumerate(batches)
            for rows in self.chunks(batch)
        ]
        lengths = [self.length_for(n, len(rows)) for _, rows, n in chunks]
        order = sorted(range(len(chunks)), key=lambda c: -lengths[c])  # stable
        chunks = [chunks[c] for c in order]
        steps, start = [], 0
        while start < len(chunks):
            length = lengths[order[start]]
            count = min(len(chunks) - start, self.rows(length))
            while count > 1 and self.step_bytes(chunks[start : start + count], length) > (
                self.budget
            ):
                count //= 2  # many items per row: the LM head's logits need room too
            count = split_rows(count, length, self.split_padding_tokens, self.model.layout.rows)
            taken = chunks[start : start + count]
            steps.append(
                PackedStep(
                    length=length,
                    rows=self.model.layout.rows(count),
                    chunks=tuple((g, rows) for g, rows, _ in taken),
                    tokens=tuple(n for _, _, n in taken),
                )
            )
            start += count
        return steps

    def chunks(self, batch: ScoreBatch) -> list[np.ndarray]:
        """A group's items in chunks (batch rows of each), one packed row each: the fewest that
        fill the longest packed length that fits the budget (`packing.plan`), or up to
        EXTRA_CHUNKS more of about equal tokens where their padded rows hold fewer tokens (one
        2,050-token row pads to 2,560; three of ~700, to 3 x 768)."""
        max_items = self.slots(self.max_tokens)
        fewest = list(packing.plan(batch, self.max_tokens, max_items))
        best, best_tokens = fewest, self.padded_tokens(batch, fewest)
        for count in range(len(fewest) + 1, len(fewest) + EXTRA_CHUNKS + 1):
            chunks = packing.balanced(batch, count)
            if len(chunks) != count or any(len(rows) > max_items for rows in chunks):
                break
            tokens = self.padded_tokens(batch, chunks)
            if tokens < best_tokens:
                best, best_tokens = chunks, tokens
        return best

    def padded_tokens(self, batch: ScoreBatch, chunks: Sequence[np.ndarray]) -> float:
        """The tokens these chunks' rows hold, each padded to its length (inf if one is longer
        than `max_tokens`)."""
        lengths = [
            self.length_for(batch.query_len + int(batch.item_lens[rows].sum()), len(rows))
            for rows in chunks
        ]
        return sum(lengths) if max(lengths) <= self.max_tokens else float("inf")

    def bucket(self, tokens: int) -> int:
        """The packed length that `tokens` real tokens are padded to: a packed-row bucket on
        this model's platform's ladder (`bucket_packed_tokens`, `fine_ladder`)."""
        return self.packed_bucket(tokens)

    def rows(self, length: int) -> int:
        """Packed rows per step at this length whose memory fits the budget on each device."""
        per_device = memory.packed_rows(
            self.model.config, length, self.budget, MAX_STEP_TOKENS, dense_mask=self.dense_mask
        )
        return per_device * self.model.layout.data

    def step_bytes(self, chunks, length: int) -> int:
        """Estimated peak memory on each device of one step packing these (group, rows, tokens)
        chunks."""
        layout = self.model.layout
        rows = layout.rows(len(chunks)) // layout.data
        return memory.packed_step_bytes(
            self.model.config, rows, length, self.slots(length), dense_mask=self.dense_mask
        )

    def length_for(self, tokens: int, items: int) -> int:
        """The packed length of a row of `tokens` real tokens scoring `items` items: the bucket
        of its tokens, or the first longer one whose `slots` hold its items (rows of many tiny
        items are padded rather than split)."""
        length = self.bucket(tokens)
        while self.slots(length) < items and length < self.max_tokens:
            length = self.bucket(length + 1)
        return length

    def slots(self, length: int) -> int:
        """Items a packed row of `length` tokens scores (padding included): one per
        SLOT_TOKENS tokens, rounded up to a power of two, within what the logits leave room for.
        A function of the length, so a step's item count adds no dimension to the shape set."""
        return min(self.chunk_limits[1], bucket_count(-(-length // SLOT_TOKENS)))

    @property
    def max_tokens(self) -> int:
        """The longest packed length (a bucket) whose memory, with one item's logits, fits the
        budget."""
        return self.chunk_limits[0]

    @property
    def chunk_limits(self) -> tuple[int, int]:
        """(max_tokens, the most items, a power of two, whose logits fit beside them)."""
        return self._chunk_limits(self.budget)

    @functools.lru_cache(maxsize=8)  # noqa: B019 (one entry per budget; backends live long)
    def _chunk_limits(self, budget: int) -> tuple[int, int]:
        config = self.model.config
        fits, length = self.bucket(1), self.bucket(1)
        while (
            length <= MAX_PACKED_TOKENS
            and self.memory_bytes(length) + work.logits_bytes(config, 1) <= budget
        ):
            fits, length = length, self.bucket(length + 1)
        room = budget - self.memory_bytes(fits)
        return fits, pow2_floor(room // work.logits_bytes(config, 1))

    def memory_bytes(self, length: int) -> int:
        """Estimated peak memory of one layer at this packed length."""
        return memory.packed_bytes(self.model.config, length, dense_mask=self.dense_mask)
