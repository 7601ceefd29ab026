"""prefill_extend: prefill the query once, then score every item against its cached K/V.

Serial scoring runs N x (query + item) token positions; this runs the query once plus N x item.
Items attend to the query's K/V through one shared matmul and to their own tokens causally, and
the two halves merge exactly (`decoder.extend`), so scores equal serial up to float rounding.

The query's K/V stays in a `PrefixCache` across calls: a repeated query costs item work only, and a
query sharing a prefix with a cached one prefills only the rest.

Several groups (requests with different queries) share device steps: their uncached queries
prefill together, one query per row, and the items each group leaves over after filling steps of
its own share extend steps, where each row attends to its own query's K/V gathered per row.
A step whose rows share one query keeps the shared-prefix matmul.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from tpuscore.api.errors import check_int
from tpuscore.backends import costs
from tpuscore.backends.buckets import bucket_count, bucket_tokens
from tpuscore.backends.contract import (
    BackendOutput,
    GroupsOutputBuilder,
    ScoreBatch,
    stack_labels,
)
from tpuscore.backends.prefill_extend.prefix_cache import PrefixCache
from tpuscore.models import decoder
from tpuscore.models.config import ModelConfig
from tpuscore.models.decoder import Prefix
from tpuscore.models.model import Model
from tpuscore.models.weights import Params

logger = logging.getLogger(__name__)

MAX_BATCH_TOKENS = 4096  # item tokens per extend step, whatever the memory would allow
MAX_PREFILL_TOKENS = 16384  # query tokens per batched prefill step, likewise


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefillExtendOptions:
    """prefix_cache_bytes: the query K/V cache's budget (default 1 GiB on CPU, a tenth of
    accelerator memory; 0 keeps nothing). batch_items: items per extend step (default from an
    activation-memory estimate). activation_bytes: that estimate's budget (default 256 MiB on
    CPU, an eighth of accelerator memory). prefill_chunk: query tokens per prefill step, which
    bounds its own [chunk, chunk] attention (default 512)."""

    prefix_cache_bytes: int | None = None
    batch_items: int | None = None
    activation_bytes: int | None = None
    prefill_chunk: int | None = None

    def __post_init__(self):
        for name, minimum in (
            ("prefix_cache_bytes", 0),
            ("batch_items", 1),
            ("activation_bytes", 1),
            ("prefill_chunk", 1),
        ):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), minimum=minimum)


def _append(cached: jax.Array, new: jax.Array, at: jax.Array, size: int, axis: int) -> jax.Array:
    """cached with new written from position `at` along axis, holding `size` positions."""
    # Room for R more positions past the larger of both sizes, so no write is clipped.
    shape = list(cached.shape)
    shape[axis] = max(size, shape[axis]) + new.shape[axis]
    out = jax.lax.dynamic_update_slice_in_dim(jnp.zeros(shape, new.dtype), cached, 0, axis)
    out = jax.lax.dynamic_update_slice_in_dim(out, new, at, axis)
    return jax.lax.slice_in_dim(out, 0, size, axis=axis)


@functools.partial(jax.jit, static_argnames=("config", "size"))
def prefill(
    params: Params,
    prefix: Prefix,
    tokens: jax.Array,
    count: jax.Array,
    config: ModelConfig,
    size: int,
) -> Prefix:
    """Extend `prefix` by the first `count` of tokens [1, R]; the result holds `size` positions."""
    R = tokens.shape[1]
    causal = jnp.tril(jnp.ones((1, R, R), bool))
    hidden, (k, v) = decoder.extend(params, config, prefix, tokens, causal, return_kv=True)
    k = k[:, 0].transpose(0, 2, 3, 1)  # [layers, K, H, R]
    v = v[:, 0].transpose(0, 2, 1, 3)  # [layers, K, R, H]
    return Prefix(
        k=_append(prefix.k, k, prefix.length, size, axis=3),
        v=_append(prefix.v, v, prefix.length, size, axis=2),
        length=prefix.length + count,
        last_hidden=hidden[0, count - 1],
    )


@functools.partial(jax.jit, static_argnames=("config", "size"))
def prefill_rows(
    params: Params,
    prefixes: Prefix,
    tokens: jax.Array,
    counts: jax.Array,
    config: ModelConfig,
    size: int,
) -> Prefix:
    """Extend each of the stacked `prefixes` (`decoder.stack_prefixes`, one per row) by the first
    counts[b] of tokens [B, R] in its row; the results, stacked, hold `size` positions."""
    B, R = tokens.shape
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((R, R), bool)), (B, R, R))
    hidden, (k, v) = decoder.extend(
        params, config, prefixes, tokens, causal, rows=jnp.arange(B), return_kv=True
    )
    k = k.transpose(0, 1, 3, 4, 2)  # [layers, B, K, H, R]
    v = v.transpose(0, 1, 3, 2, 4)  # [layers, B, K, R, H]
    append = jax.vmap(_append, in_axes=(1, 1, 0, None, None), out_axes=1)
    return Prefix(
        k=append(prefixes.k, k, prefixes.length, size, 3),
        v=append(prefixes.v, v, prefixes.length, size, 2),
        length=prefixes.length + counts,
        last_hidden=hidden[jnp.arange(B), counts - 1],
    )


@functools.partial(jax.jit, static_argnames="config")
def score_items(
    params: Params,
    prefix: Prefix,
    items: jax.Array,
    item_lens: jax.Array,
    label_ids: jax.Array,
    config: ModelConfig,
) -> jax.Array:
    """Label logprobs [B, C] after prefix + each row of items [B, L] (right-padded); label_ids
    [C] for every row, or [B, C] per row.

    An empty item scores the prefix's last token. Rows are independent: padding rows are dropped.
    """
    B, L = items.shape
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((L, L), bool)), (B, L, L))
    hidden, _ = decoder.extend(params, config, prefix, items, causal)
    last = hidden[jnp.arange(B), jnp.maximum(item_lens - 1, 0)]
    last = jnp.where((item_lens == 0)[:, None], prefix.last_hidden, last)
    if label_ids.ndim == 2:
        return decoder.row_label_logprobs(params, config, last[:, None], label_ids)[:, 0]
    return decoder.label_logprobs(params, config, last, label_ids)


@functools.partial(jax.jit, static_argnames="config")
def score_mixed_items(
    params: Params,
    prefixes: Prefix,
    query_index: jax.Array,
    items: jax.Array,
    item_lens: jax.Array,
    label_ids: jax.Array,
    config: ModelConfig,
) -> jax.Array:
    """Label logprobs [B, C] after prefix query_index[b] of the stacked `prefixes` + row b of
    items [B, L], with labels per row [B, C]: rows of different queries in one step, each
    attending to its own query's K/V (gathered per row)."""
    B, L = items.shape
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((L, L), bool)), (B, L, L))
    hidden, _ = decoder.extend(params, config, prefixes, items, causal, rows=query_index)
    last = hidden[jnp.arange(B), jnp.maximum(item_lens - 1, 0)]
    last = jnp.where((item_lens == 0)[:, None], prefixes.last_hidden[query_index], last)
    return decoder.row_label_logprobs(params, config, last[:, None], label_ids)[:, 0]


@functools.partial(jax.jit, static_argnames="size")
def _unstack(prefixes: Prefix, row: jax.Array, size: int) -> Prefix:
    """Prefix `row` of stacked `prefixes`, holding `size` positions: its own copy, so the cache
    keeps no stack alive. The row is traced, so one compilation serves every row."""

    def take(x: jax.Array, axis: int) -> jax.Array:
        return jax.lax.dynamic_index_in_dim(x, row, axis=axis, keepdims=False)

    return Prefix(
        k=take(prefixes.k, 1)[..., :size],
        v=take(prefixes.v, 1)[..., :size, :],
        length=take(prefixes.length, 0),
        last_hidden=take(prefixes.last_hidden, 0),
    )


def bucket_item_tokens(n: int) -> int:
    """Item-length buckets: multiples of 4 up to 32, then `bucket_tokens`. Items are short and
    each padding token pays attention to the whole query: 20 tokens padded to 24 waste a sixth."""
    return max(4, -(-n // 4) * 4) if n <= 32 else bucket_tokens(n)


@attrs.frozen
class ExtendStep:
    """One extend step: row r scores item rows[r] of group groups[r]; rows padded to a power of
    two, items to item_len tokens."""

    item_len: int
    groups: np.ndarray
    rows: np.ndarray


class PrefillExtendBackend(costs.Budgeted):
    estimate = "prefill_extend"

    def __init__(self, model: Model, options: PrefillExtendOptions):
        self.model = model
        budget = options.prefix_cache_bytes
        self.cache = PrefixCache(costs.cache_budget() if budget is None else budget)
        self.batch_items = options.batch_items
        self.activation_bytes = options.activation_bytes or costs.activation_budget()
        self.prefill_chunk = options.prefill_chunk or 512
        config = model.config
        L, K, H = config.num_layers, config.num_kv_heads, config.head_dim
        self._empty = Prefix(
            k=jnp.zeros((L, K, H, bucket_tokens(0)), model.dtype),
            v=jnp.zeros((L, K, bucket_tokens(0), H), model.dtype),
            length=jnp.int32(0),
            last_hidden=jnp.zeros(config.hidden_size, jnp.float32),
        )

    def score(self, batch: ScoreBatch) -> BackendOutput:
        return self.score_groups([batch])[0]

    def work(self, batches: Sequence[ScoreBatch]) -> list[costs.StepWork]:
        """What each step of `score_groups` on these batches would do (for `selection.py`), with
        the prefix cache as it is now. Every step's peak holds the K/V of its wave's queries."""
        config, layout, itemsize = self.model.config, self.model.layout, self.model.dtype.itemsize
        steps = []
        for wave in self.waves(batches):
            wave_batches = [batches[g] for g in wave]
            queries, query_of = _distinct_queries(wave_batches)
            held = sum(self.prefix_bytes(len(q)) for q in queries)
            steps += self._prefill_work(queries, held)
            for step in self.plan_extend(wave_batches, query_of):
                rows, L = layout.rows(len(step.rows)), step.item_len
                step_queries = {query_of[w] for w in step.groups}
                P = max(bucket_tokens(len(queries[q])) for q in step_queries)
                row_prefix = 0 if len(step_queries) == 1 else P  # else one shared prefix
                peak = rows // layout.data * costs.extend_row_bytes(config, L, row_prefix)
                steps.append(
                    costs.step_work(
                        config,
                        itemsize,
                        rows=rows,
                        new=L,
                        pairs=rows * L * (L + P),
                        slots=1,
                        peak=peak + held,
                        kv_bytes=costs.kv_bytes(config, P, itemsize)
                        * (1 if row_prefix == 0 else rows),
                    )
                )
        return steps

    def _prefill_work(self, queries: Sequence[np.ndarray], held: int) -> list[costs.StepWork]:
        """The prefill steps `query_prefixes` would run for these queries (see there)."""
        config, layout, itemsize = self.model.config, self.model.layout, self.model.dtype.itemsize
        pending = []  # [length, tokens done]
        for query in queries:
            n, hit = len(query), self.cache.peek(query)
            if n and hit < n:
                pending.append([n, min(hit, n - 1)])
        steps = []
        while pending:
            pending.sort(key=lambda p: -min(p[0] - p[1], self.prefill_chunk))
            chunk = min(pending[0][0] - pending[0][1], self.prefill_chunk)
            base_len = max(bucket_tokens(done) for _, done in pending)
            cap = self.prefill_batch_rows(bucket_tokens(chunk), base_len)
            step, pending = pending[:cap], pending[cap:]
            rows, R = 1 if len(step) == 1 else layout.rows(len(step)), bucket_tokens(chunk)
            peak = -(-rows // layout.data) * costs.prefill_row_bytes(config, R, base_len)
            steps.append(
                costs.step_work(
                    config,
                    itemsize,
                    rows=rows,
                    new=R,
                    pairs=rows * R * (R + base_len),
                    slots=0,
                    peak=peak + held,
                    kv_bytes=costs.kv_bytes(config, rows * base_len, itemsize),
                )
            )
            for p in step:
                p[1] += min(p[0] - p[1], self.prefill_chunk)
            pending += [p for p in step if p[1] < p[0]]
        return steps

    def score_groups(self, batches: Sequence[ScoreBatch]) -> list[BackendOutput]:
        """Score several groups: their distinct queries prefilled together (cache hits skip it),
        then their items in extend steps, where items of different queries may share a step."""
        out = BackendOutput.for_groups(batches)
        for wave in self.waves(batches):
            queries, query_of = _distinct_queries([batches[g] for g in wave])
            owners = [wave[query_of.index(q)] for q in range(len(queries))]
            prefixes = self.query_prefixes(queries, out, owners)
            for step in self.plan_extend([batches[g] for g in wave], query_of):
                self._extend(step, wave, batches, query_of, prefixes, out)
        return out.build()

    def _extend(self, step, wave, batches, query_of, prefixes, out) -> None:
        """Run one extend step of a wave (step.groups index into the wave)."""
        n = len(step.rows)
        layout = self.model.layout
        groups = np.asarray(wave)[step.groups]
        items = np.zeros((layout.rows(n), step.item_len), np.int32)
        item_lens = np.zeros(items.shape[0], np.int32)
        for r, (g, i) in enumerate(zip(groups, step.rows, strict=True)):
            item_lens[r] = batches[g].item_lens[i]
            width = min(step.item_len, batches[g].items.shape[1])  # groups pad to own buckets
            items[r, :width] = batches[g].items[i, :width]
        step_queries = sorted({query_of[w] for w in step.groups})
        if len(set(groups)) == 1:  # one group: its labels for every row
            labels = batches[groups[0]].label_ids
        else:
            labels = stack_labels([batches[g].label_ids for g in groups], items.shape[0])
        if len(step_queries) == 1:  # the shared-prefix matmul
            name = "score_items"
            shape = (*items.shape, labels.shape[-1])
            logprobs = score_items(
                self.model.params,
                prefixes[step_queries[0]],
                layout.put_rows(items),
                layout.put_rows(item_lens),
                labels if labels.ndim == 1 else layout.put_rows(labels),
                self.model.config,
            )
        else:  # each row against its own query's K/V
            name = "score_mixed_items"
            stacked = layout.put_prefix(
                decoder.stack_prefixes(
                    [prefixes[q] for q in step_queries], bucket_count(len(step_queries))
                ),
                stacked=True,
            )
            query_index = np.zeros(items.shape[0], np.int32)
            query_index[:n] = [step_queries.index(query_of[w]) for w in step.groups]
            shape = (*items.shape, *stacked.k.shape[1:2], stacked.k.shape[-1], labels.shape[-1])
            logprobs = score_mixed_items(
                self.model.params,
                stacked,
                *map(layout.put_rows, (query_index, items, item_lens, labels)),
                self.model.config,
            )
        tokens = {int(g): 0 for g in groups}
        for g, length in zip(groups, item_lens[:n], strict=True):
            tokens[int(g)] += int(length)
        out.step(name, shape, tokens)
        for g in tokens:
            (where,) = np.nonzero(groups == g)
            out.scores(g, step.rows[where], logprobs, index=where)

    def waves(self, batches: Sequence[ScoreBatch]) -> list[list[int]]:
        """The groups in consecutive waves whose distinct queries' K/V, all held at once while
        the wave runs, fit `held_budget` (one query at least)."""
        budget = self.held_budget
        waves, seen, held = [[]], set(), 0
        for g, batch in enumerate(batches):
            query = batch.query[: batch.query_len].tobytes()
            if query not in seen:
                nbytes = self.prefix_bytes(batch.query_len)
                if seen and held + nbytes > budget:
                    waves.append([])
                    seen, held = set(), 0
                seen.add(query)
                held += nbytes
            waves[-1].append(g)
        return [wave for wave in waves if wave]

    @property
    def held_budget(self) -> int:
        """What a wave's queries' K/V may hold: the larger of the cache and activation budgets."""
        return max(self.cache.budget_bytes, self.activation_bytes)

    @property
    def peak_budget(self) -> int:
        """A step's activations fit the budget; the K/V it holds, `held_budget`."""
        return self.budget + self.held_budget

    def prefix_bytes(self, query_len: int) -> int:
        """Bytes of one query's K/V (and last hidden state) as the cache holds it."""
        config = self.model.config
        positions = bucket_tokens(query_len)
        kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * positions
        return kv * self.model.dtype.itemsize + 4 * config.hidden_size

    def plan_extend(self, batches: Sequence[ScoreBatch], query_of: list[int]) -> list[ExtendStep]:
        """The extend steps that score these groups' items (query_of: each group's query).

        Each group's items, sorted by length so a step pads little, fill steps as the group alone
        would; a full step runs against its query's prefix through one shared matmul. What is
        left of each group (its last, partly filled step) is pooled with the other groups'
        leftovers, sorted by length and batched again: those steps mix queries, each row
        attending to its own query's K/V, at a row count that leaves room for that per-row copy.
        """
        steps, pool = [], []
        for g, batch in enumerate(batches):
            lens = batch.item_lens[: batch.num_items]
            order = np.argsort(lens, kind="stable")  # similar lengths share a batch
            for positions, item_len in self._plan(lens[order], self.batch_rows):
                rows = order[positions]
                full = len(rows) == self.batch_rows(item_len)
                if full or len(batches) == 1:
                    steps.append(ExtendStep(item_len, np.full(len(rows), g), rows))
                else:
                    pool += [(int(lens[i]), g, int(i)) for i in rows]
        if pool:
            pool.sort(key=lambda entry: entry[0])  # stable: equal lengths keep group order
            lens = np.array([n for n, _, _ in pool])
            prefix_len = max(bucket_tokens(batches[g].query_len) for _, g, _ in pool)
            rows_for = functools.partial(self.batch_rows, row_prefix_len=prefix_len)
            for positions, item_len in self._plan(lens, rows_for):
                groups = np.array([pool[p][1] for p in positions])
                rows = np.array([pool[p][2] for p in positions])
                steps.append(ExtendStep(item_len, groups, rows))
        return steps

    def query_prefix(self, query: np.ndarray) -> Prefix:
        """One query's K/V, from the cache or prefilled, with no output to count steps in (for
        other workloads on this machinery, such as `loglikelihood`)."""
        return self.query_prefixes([query], None, [0])[0]

    def query_prefixes(
        self,
        queries: Sequence[np.ndarray],
        out: GroupsOutputBuilder | None,
        owners: Sequence[int],
    ) -> list[Prefix]:
        """Each query's K/V. Prefills nothing on a cache hit, the part past the longest cached
        prefix on a partial hit, all of it on a miss. Queries that need prefill run together,
        the next chunk of each in one row of a step; each prefill step is counted in `out` (if
        given), its tokens charged to the query's owner group."""
        prefixes: list[Prefix | None] = [None] * len(queries)
        pending = []  # (query index, prefix so far, tokens done)
        for i, query in enumerate(queries):
            n = len(query)
            if n == 0:
                prefixes[i] = self._empty
                continue
            reuse = self.cache.lookup(query)
            if reuse is not None and reuse.exact:
                prefixes[i] = reuse.value
                continue
            # Reuse at most n - 1 tokens: the last token's hidden state is needed and not cached.
            start = 0 if reuse is None else min(reuse.length, n - 1)
            base = self._empty if start == 0 else reuse.value._replace(length=jnp.int32(start))
            pending.append((i, base, start))
            logger.debug("prefilling %d of %d query tokens (%d cached)", n - start, n, start)
        while pending:
            # The next chunk of every pending query, longest first: similar lengths share a step.
            pending.sort(key=lambda p: -min(len(queries[p[0]]) - p[2], self.prefill_chunk))
            chunk_len = min(len(queries[pending[0][0]]) - pending[0][2], self.prefill_chunk)
            base_len = max(base.k.shape[-1] for _, base, _ in pending)
            rows = self.prefill_batch_rows(bucket_tokens(chunk_len), base_len)
            step, pending = pending[:rows], pending[rows:]
            for i, prefix, start in self._prefill_step(queries, step, out, owners):
                if start < len(queries[i]):
                    pending.append((i, prefix, start))
                else:
                    prefixes[i] = prefix = self.model.layout.put_prefix(prefix)
                    nbytes = sum(a.nbytes for a in (prefix.k, prefix.v, prefix.last_hidden))
                    self.cache.put(queries[i], prefix, nbytes)
        return prefixes

    def _prefill_step(self, queries, step, out, owners):
        """Run the next chunk of each (query index, prefix so far, tokens done) in `step`, one row
        each; returns them advanced."""
        layout = self.model.layout
        chunks = [queries[i][start : start + self.prefill_chunk] for i, _, start in step]
        rows = 1 if len(step) == 1 else layout.rows(len(step))
        tokens = np.zeros((rows, bucket_tokens(max(map(len, chunks)))), np.int32)
        for r, chunk in enumerate(chunks):
            tokens[r, : len(chunk)] = chunk
        sizes = [
            bucket_tokens(start + len(c)) for (_, _, start), c in zip(step, chunks, strict=True)
        ]
        charged = {owners[i]: len(c) for (i, _, _), c in zip(step, chunks, strict=True)}
        if len(step) == 1:  # one query: its prefix in place, as a lone request runs
            (i, prefix, start), chunk = step[0], chunks[0]
            if out is not None:
                out.step("prefill", (tokens.shape[1], sizes[0]), charged)
            prefix = prefill(
                self.model.params,
                prefix,
                tokens,
                np.int32(len(chunk)),
                config=self.model.config,
                size=sizes[0],
            )
            return [(i, prefix, start + len(chunk))]
        counts = np.zeros(tokens.shape[0], np.int32)
        counts[: len(chunks)] = list(map(len, chunks))
        stacked = decoder.stack_prefixes([prefix for _, prefix, _ in step], tokens.shape[0])
        if out is not None:
            out.step("prefill_rows", (*tokens.shape, stacked.k.shape[-1], max(sizes)), charged)
        stacked = prefill_rows(
            self.model.params,
            layout.put_prefix(stacked, stacked=True),
            layout.put_rows(tokens),
            layout.put_rows(counts),
            config=self.model.config,
            size=max(sizes),
        )
        advanced = []
        for r, ((i, _, start), size) in enumerate(zip(step, sizes, strict=True)):
            prefix = _unstack(stacked, np.int32(r), size=size)
            advanced.append((i, prefix, start + int(counts[r])))
        return advanced

    def prefill_batch_rows(self, length: int, base_len: int) -> int:
        """Queries per batched prefill step at this chunk length and cached-prefix length."""
        per_device = costs.prefill_rows(
            self.model.config, length, base_len, self.budget, MAX_PREFILL_TOKENS
        )
        return per_device * self.model.layout.data

    def _plan(self, sorted_lens: np.ndarray, batch_rows):
        """Batches over length-sorted items: (positions in sorted order, item-length bucket);
        batch_rows(item_len) caps a batch's items."""
        start, n = 0, len(sorted_lens)
        while start < n:
            count = n - start
            item_len = bucket_item_tokens(int(sorted_lens[start + count - 1]))
            cap = batch_rows(item_len)
            if count > cap:  # shrinking the batch can only shorten its bucket: cap still holds
                count = cap
                item_len = bucket_item_tokens(int(sorted_lens[start + count - 1]))
            yield np.arange(start, start + count), item_len
            start += count

    def batch_rows(self, item_len: int, row_prefix_len: int = 0) -> int:
        """Items per extend step: the override, or as many as the activation budget allows on
        each device at this item length (with a per-row prefix of row_prefix_len positions)."""
        if self.batch_items is not None:
            return self.batch_items
        per_device = costs.extend_batch_rows(
            self.model.config, item_len, self.budget, MAX_BATCH_TOKENS, row_prefix_len
        )
        return per_device * self.model.layout.data


def _distinct_queries(batches: Sequence[ScoreBatch]) -> tuple[list[np.ndarray], list[int]]:
    """The batches' distinct queries in order of first appearance, and each batch's index
    into them."""
    queries, index, query_of = [], {}, []
    for batch in batches:
        query = batch.query[: batch.query_len]
        key = query.tobytes()
        if key not in index:
            index[key] = len(queries)
            queries.append(query)
        query_of.append(index[key])
    return queries, query_of
