"""prefill_extend's plan: a call's groups in waves whose queries' K/V are held at once, and each
wave's prefill and extend steps, planned when the wave comes (after the waves before it have
filled the prefix cache).

Every step's shape comes from a finite lattice (`shapes.py`): a query's K/V hold `bucket_prefix`
of its length (a power of two) from its first step, and a mixed step stacks as many prefixes as
its rows allow (`mixed_queries`).

In batch-invariant mode every step's shape and content depend on one query and its own items
alone: queries prefill one per step, in chunks at fixed boundaries, reusing the prefix cache only
on an exact hit (so a query's K/V never depend on what was cached); items are bucketed by their
own length and run in steps of one group with a fixed row count per item bucket, padding rows
included. A row's result then cannot depend on what else shares its call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence

import attrs
import numpy as np

from tpuscore.backends.buckets import MIN_TOKEN_BUCKET, bucket_prefix
from tpuscore.backends.contract import Plan, ScoreBatch
from tpuscore.backends.prefill_extend.prefix_cache import Reuse
from tpuscore.backends.prefill_extend.sizing import Sizing
from tpuscore.models.decoder import Prefix


@attrs.frozen
class ExtendStep:
    """One extend step: row r scores item rows[r] of group groups[r]; `size` rows in all (padding
    included), items padded to item_len tokens."""

    item_len: int
    groups: np.ndarray
    rows: np.ndarray
    size: int


@attrs.frozen
class PrefillRow:
    """Tokens [start, stop) of query `query` (an index into its wave's queries)."""

    query: int
    start: int
    stop: int


@attrs.frozen
class PrefillStep:
    """One prefill step: the next chunk of each row's query, padded to `length` tokens in `rows`
    rows (1: a lone query, prefilled in place). `base_len`: the positions of the K/V it
    continues (the empty prefix's, or its query's `size`); `size`: the positions its queries'
    K/V hold after it (`bucket_prefix` of their length, the same for every row)."""

    chunks: tuple[PrefillRow, ...]
    length: int
    base_len: int
    rows: int
    size: int


@attrs.frozen
class Wave:
    """Groups run together (indices into the call's batches) and their steps. `queries`: their
    distinct queries (a query under two adapters is two), `query_of`: each group's index into
    them, `adapters`: each query's LoRA adapter (0: none). `ready`: each query's K/V where
    it needs no prefill (empty, or a cache hit), else None; `reused`: for a query to prefill, the
    cached state it continues (None: none) and how many of its tokens that holds."""

    groups: list[int]
    queries: list[np.ndarray]
    query_of: list[int]
    ready: list[Prefix | None]
    reused: dict[int, tuple[Prefix | None, int]]
    prefill: list[PrefillStep]
    extend: list[ExtendStep]
    adapters: list[int] = attrs.Factory(list)


def distinct_queries(
    batches: Sequence[ScoreBatch],
) -> tuple[list[np.ndarray], list[int], list[int]]:
    """The batches' distinct (query, adapter) pairs in order of first appearance: the queries,
    each batch's index into them, and each query's adapter. One query under two adapters is two
    queries: its K/V differ."""
    queries, index, query_of, adapters = [], {}, [], []
    for batch in batches:
        query = batch.query[: batch.query_len]
        key = (batch.adapter, query.tobytes())
        if key not in index:
            index[key] = len(queries)
            queries.append(query)
            adapters.append(batch.adapter)
        query_of.append(index[key])
    return queries, query_of, adapters


class Planning(Sizing):
    """The planning half of `PrefillExtendBackend` (module doc); its steps' sizes from `Sizing`."""

    prefill_chunk: int
    batch_invariant: bool
    _empty: Prefix

    def plan(self, batches: Sequence[ScoreBatch]) -> Plan:
        """The call's waves (`waves`: groups whose queries' K/V are held at once); each wave's
        steps are planned when it comes (`expand`)."""
        return Plan(tuple(batches), self.waves(batches))

    def schedule(
        self,
        batches: Sequence[ScoreBatch],
        read: Callable[..., Reuse | None] | None = None,
    ) -> Iterator[Wave]:
        """The waves of `plan(batches)`, expanded (`expand`)."""
        return self.expand(self.plan(batches), read)

    def expand(self, plan: Plan, read: Callable[..., Reuse | None] | None = None) -> Iterator[Wave]:
        """The plan's waves, each with its prefill and extend steps.

        Lazy: a wave is planned when the one before it has run, so it sees what that one put in
        the prefix cache. `read` is how the cache is consulted: `run` passes `cache.lookup`
        (which counts hits); the default, `cache.probe`, reads it without a trace, for pricing
        (`price`), which plans every wave from the cache as it is now."""
        read = read or self.cache.probe
        batches = plan.batches
        for groups in plan.steps:
            wave_batches = [batches[g] for g in groups]
            queries, query_of, adapters = distinct_queries(wave_batches)
            ready, reused, prefill = self._plan_prefill(queries, read, adapters)
            extend = self.plan_extend(wave_batches, query_of)
            yield Wave(groups, queries, query_of, ready, reused, prefill, extend, adapters)

    def waves(self, batches: Sequence[ScoreBatch]) -> list[list[int]]:
        """The groups in consecutive waves whose distinct queries' K/V, all held at once while
        the wave runs, fit `held_budget` (one query at least)."""
        budget = self.held_budget
        waves, seen, held = [[]], set(), 0
        for g, batch in enumerate(batches):
            query = (batch.adapter, batch.query[: batch.query_len].tobytes())
            if query not in seen:
                nbytes = self.prefix_bytes(batch.query_len)
                if seen and held + nbytes > budget:
                    waves.append([])
                    seen, held = set(), 0
                seen.add(query)
                held += nbytes
            waves[-1].append(g)
        return [wave for wave in waves if wave]

    def _plan_prefill(
        self,
        queries: Sequence[np.ndarray],
        read: Callable[..., Reuse | None],
        adapters: Sequence[int] | None = None,
    ) -> tuple[list[Prefix | None], dict[int, tuple[Prefix | None, int]], list[PrefillStep]]:
        """The prefill steps for these queries, as `Wave` holds them: nothing on a cache hit, the
        part past the longest cached prefix on a partial hit, all of it on a miss.

        A query's K/V hold `bucket_prefix(len(query))` positions from its first step on, so its
        steps' shapes come from the shape set (`shapes`). Queries of one prefill chunk at most,
        with nothing cached, prefill together, one per row, in steps of queries of one K/V size,
        longest first so similar lengths share a step. The others (longer, or continuing a cached
        prefix, resized to their own size) prefill one per step, a chunk at a time.
        Batch-invariant: exact hits only, and one query per step, so its chunks start at 0 and
        every multiple of prefill_chunk. adapters: each query's (default none); `read` looks a
        query up under its adapter, `read(tokens, adapter)`."""
        ready: list[Prefix | None] = [None] * len(queries)
        reused: dict[int, tuple[Prefix | None, int]] = {}
        together, alone = [], []  # query indices; alone: (index, tokens done)
        for i, query in enumerate(queries):
            n = len(query)
            if n == 0:
                ready[i] = self._empty
                continue
            reuse = read(query, adapters[i] if adapters else 0)
            if self.batch_invariant and reuse is not None and not reuse.exact:
                reuse = None
            if reuse is not None and reuse.exact:
                ready[i] = reuse.value
                continue
            # Reuse at most n - 1 tokens: the last token's hidden state is needed and not cached.
            start = 0 if reuse is None else min(reuse.length, n - 1)
            reused[i] = (None if start == 0 else reuse.value, start)
            if start == 0 and n <= self.prefill_chunk and not self.batch_invariant:
                together.append(i)
            else:
                alone.append((i, start))
        layout, steps = self.model.layout, []
        together.sort(key=lambda i: -len(queries[i]))
        while together:
            size = bucket_prefix(len(queries[together[0]]))
            length = self.token_bucket(len(queries[together[0]]))
            same = [i for i in together if bucket_prefix(len(queries[i])) == size]
            cap = self.prefill_batch_rows(length, MIN_TOKEN_BUCKET)
            taken = same[:cap]
            together = [i for i in together if i not in set(taken)]
            chunks = tuple(PrefillRow(i, 0, len(queries[i])) for i in taken)
            rows = 1 if len(chunks) == 1 else layout.rows(len(chunks))
            steps.append(PrefillStep(chunks, length, MIN_TOKEN_BUCKET, rows, size))
        for i, start in alone:
            n, size = len(queries[i]), bucket_prefix(len(queries[i]))
            base_len = MIN_TOKEN_BUCKET if start == 0 else size
            while start < n:
                stop = min(start + self.prefill_chunk, n)
                chunk = (PrefillRow(i, start, stop),)
                steps.append(PrefillStep(chunk, self.token_bucket(stop - start), base_len, 1, size))
                start, base_len = stop, size
        return ready, reused, steps

    def plan_extend(self, batches: Sequence[ScoreBatch], query_of: list[int]) -> list[ExtendStep]:
        """The extend steps that score these groups' items (query_of: each group's query).

        Each group's items, sorted by length so a step pads little, fill steps as the group alone
        would; a full step runs against its query's prefix through one shared matmul. What is
        left of each group (its last, partly filled step) is pooled with the other groups'
        leftovers, sorted by length and batched again: those steps mix queries, each row
        attending to its own query's K/V, at a row count that leaves room for that per-row copy.
        Batch-invariant: `plan_invariant_extend`.
        """
        if self.batch_invariant:
            return self.plan_invariant_extend(batches)
        layout, steps, pool = self.model.layout, [], []
        for g, batch in enumerate(batches):
            lens = batch.item_lens[: batch.num_items]
            order = np.argsort(lens, kind="stable")  # similar lengths share a batch
            for positions, item_len in self._plan(lens[order], self.batch_rows):
                rows = order[positions]
                full = len(rows) == self.batch_rows(item_len)
                if full or len(batches) == 1:
                    groups = np.full(len(rows), g)
                    steps.append(ExtendStep(item_len, groups, rows, layout.rows(len(rows))))
                else:
                    pool += [(int(lens[i]), g, int(i)) for i in rows]
        if pool:
            pool.sort(key=lambda entry: entry[0])  # stable: equal lengths keep group order
            lens = np.array([n for n, _, _ in pool])
            prefix_len = max(bucket_prefix(batches[g].query_len) for _, g, _ in pool)
            rows_for = functools.partial(self.batch_rows, row_prefix_len=prefix_len)
            queries = np.array([query_of[g] for _, g, _ in pool])
            cap = self.query_cap(prefix_len)
            for positions, item_len in self._plan(lens, rows_for, (queries, cap)):
                groups = np.array([pool[p][1] for p in positions])
                rows = np.array([pool[p][2] for p in positions])
                steps.append(ExtendStep(item_len, groups, rows, layout.rows(len(rows))))
        return steps

    def plan_invariant_extend(self, batches: Sequence[ScoreBatch]) -> list[ExtendStep]:
        """Batch-invariant extend steps: one group's items per step, each padded to its own
        length's bucket, in `invariant_rows(bucket)` rows whatever the count of real ones."""
        steps = []
        for g, batch in enumerate(batches):
            lens = batch.item_lens[: batch.num_items]
            buckets = np.array([self.item_bucket(int(n)) for n in lens], int)
            for item_len in sorted(set(buckets.tolist())):
                (items,) = np.nonzero(buckets == item_len)
                size = self.invariant_rows(item_len)
                for start in range(0, len(items), size):
                    rows = items[start : start + size]
                    steps.append(ExtendStep(item_len, np.full(len(rows), g), rows, size))
        return steps

    def _plan(self, sorted_lens: np.ndarray, batch_rows, queries=None):
        """Batches over length-sorted items: (positions in sorted order, item-length bucket);
        batch_rows(item_len) caps a batch's items, and with queries = (each item's query, cap)
        a batch holds at most cap distinct queries. One query's batches are split rather than
        padded (`unpadded_rows`); mixed-query batches are not: each of their shapes stacks
        prefixes and compiles dearly, and splitting them doubled the compiles of many-query
        streams (docs/benchmarks.md, "Splitting mixed-query steps")."""
        start, n = 0, len(sorted_lens)
        while start < n:
            count = n - start
            item_len = self.item_bucket(int(sorted_lens[start + count - 1]))
            cap = batch_rows(item_len)
            if queries is not None:  # up to the first item of one query too many
                own, most = queries
                _, first = np.unique(own[start : start + min(count, cap)], return_index=True)
                if len(first) > most:
                    cap = min(cap, int(np.sort(first)[most]))
            if count > cap:  # shrinking the batch can only shorten its bucket: cap still holds
                count = cap
                item_len = self.item_bucket(int(sorted_lens[start + count - 1]))
            unpadded = count if queries is not None else self.unpadded_rows(count, item_len)
            if unpadded < count:
                count = unpadded
                item_len = self.item_bucket(int(sorted_lens[start + count - 1]))
            yield np.arange(start, start + count), item_len
            start += count
