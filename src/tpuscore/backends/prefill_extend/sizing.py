"""How big prefill_extend's steps are: rows per extend and prefill step from the activation
budget, batch-invariant mode's fixed rows, and how many queries' K/V a mixed step may stack.
`Planning` (plan.py) asks; every answer is a function of a step's shape and the budgets, so
none adds a dimension to the shape set."""

from __future__ import annotations

from tpuscore.backends import work
from tpuscore.backends.buckets import PlatformBuckets, bucket_prefix, pow2_floor, split_rows
from tpuscore.backends.prefill_extend import memory
from tpuscore.backends.prefill_extend.prefix_cache import PrefixCache
from tpuscore.models.model import Model

MAX_BATCH_TOKENS = 4096  # item tokens per extend step, whatever the memory would allow
MAX_PREFILL_TOKENS = 16384  # query tokens per batched prefill step, likewise
INVARIANT_ROWS = 16  # items per extend step and device in batch-invariant mode, padding included


class Sizing(PlatformBuckets):
    """The step-size half of `Planning`."""

    model: Model
    cache: PrefixCache
    budget: int
    activation_bytes: int
    batch_items: int | None
    split_padding_tokens: int

    def unpadded_rows(self, count: int, item_len: int) -> int:
        """The items a step of `count` items takes: all of them, or where padding them to a row
        bucket would waste `split_padding_tokens` item tokens or more, the largest row bucket
        below (the rest go to the next steps, which are split again)."""
        return split_rows(count, item_len, self.split_padding_tokens, self.model.layout.rows)

    def batch_rows(self, item_len: int, row_prefix_len: int = 0) -> int:
        """Items per extend step: the override, or as many as the activation budget allows on
        each device at this item length (with a per-row prefix of row_prefix_len positions)."""
        if self.batch_items is not None:
            return self.batch_items
        per_device = memory.extend_batch_rows(
            self.model.config, item_len, self.budget, MAX_BATCH_TOKENS, row_prefix_len
        )
        return per_device * self.model.layout.data

    def prefill_batch_rows(self, length: int, base_len: int) -> int:
        """Queries per batched prefill step at this chunk length and cached-prefix length."""
        per_device = memory.prefill_rows(
            self.model.config, length, base_len, self.budget, MAX_PREFILL_TOKENS
        )
        return per_device * self.model.layout.data

    def invariant_rows(self, item_len: int) -> int:
        """Rows of every batch-invariant extend step at this item bucket: `batch_items` if set,
        else what the budget allows, at most INVARIANT_ROWS per device."""
        if self.batch_items is not None:
            return self.model.layout.rows(self.batch_items)
        per_device = self.batch_rows(item_len) // self.model.layout.data
        return min(per_device, INVARIANT_ROWS) * self.model.layout.data

    def query_cap(self, size: int) -> int:
        """Distinct queries a mixed extend step with K/V of `size` positions may hold: as many
        as the budget holds stacked (every layer of each), a power of two, at least 2."""
        return max(2, pow2_floor(self.budget // self.prefix_bytes(size)))

    def mixed_queries(self, rows: int, size: int) -> int:
        """The prefixes a mixed step of `rows` rows and K/V size `size` stacks: its rows, up to
        `query_cap`. A function of its shape, so it adds no dimension to the shape set."""
        return min(rows, self.query_cap(size))

    def prefix_bytes(self, query_len: int) -> int:
        """Bytes of one query's K/V (and last hidden state) as the cache holds it."""
        config, itemsize = self.model.config, self.model.dtype.itemsize
        return work.kv_bytes(config, bucket_prefix(query_len), itemsize) + 4 * config.hidden_size

    @property
    def held_budget(self) -> int:
        """What a wave's queries' K/V may hold: the larger of the cache and activation budgets."""
        return max(self.cache.budget_bytes, self.activation_bytes)
