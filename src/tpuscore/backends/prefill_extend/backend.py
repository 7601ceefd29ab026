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

`schedule` plans a call as waves of groups, each with its prefill and extend steps;
`score_groups` runs those steps and `work` prices the same ones, so what is priced is what runs.

Every step's shape comes from a finite lattice (`shapes`): a query's K/V hold `bucket_prefix` of
its length (a power of two) from its first step, a mixed step stacks as many prefixes as its rows
allow (`mixed_queries`), and stacking and resizing prefixes are jitted steps, since eager jnp ops
compile per shape too.

In batch-invariant mode every step's shape and content depend on one query and its own items
alone: queries prefill one per step, in chunks at fixed boundaries, reusing the prefix cache only
on an exact hit (so a query's K/V never depend on what was cached); items are bucketed by their
own length and run in steps of one group with a fixed row count per item bucket, padding rows
included. A row's result then cannot depend on what else shares its call.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from collections.abc import Callable, Iterator, Sequence

import attrs
import jax
import jax.numpy as jnp
import numpy as np

from tpuscore.api.errors import check_int
from tpuscore.backends import budgets, work
from tpuscore.backends.base import Scoring
from tpuscore.backends.buckets import (
    MIN_TOKEN_BUCKET,
    bucket_count,
    bucket_prefix,
    bucket_tokens,
    pow2_floor,
    row_buckets,
)
from tpuscore.backends.budgets import Budgeted
from tpuscore.backends.contract import (
    BackendOutput,
    GroupsOutputBuilder,
    Plan,
    ScoreBatch,
    ShapeLimits,
    Step,
    StepShape,
    StepTable,
    stack_labels,
    step_table,
)
from tpuscore.backends.prefill_extend import memory
from tpuscore.backends.prefill_extend.prefix_cache import PrefixCache, Reuse
from tpuscore.kernels import cpu_attention
from tpuscore.models import decoder
from tpuscore.models.config import ModelConfig
from tpuscore.models.decoder import Prefix
from tpuscore.models.model import Model
from tpuscore.models.weights import Params

logger = logging.getLogger(__name__)

# The jitted steps' names, as the step table, the shape set and the run's stats give them.
PREFILL, PREFILL_ROWS, STACK, UNSTACK, RESIZE = (
    "prefill",
    "prefill_rows",
    "stack",
    "unstack",
    "resize",
)
SCORE_ITEMS, SCORE_MIXED_ITEMS = "score_items", "score_mixed_items"

MAX_BATCH_TOKENS = 4096  # item tokens per extend step, whatever the memory would allow
MAX_PREFILL_TOKENS = 16384  # query tokens per batched prefill step, likewise
# A step meets its query's K/V in key blocks and skips those past the query's length (`key_blocks`).
MAX_KEY_BLOCKS = 8
KEY_BLOCK_TOKENS = 256  # an extend step's narrowest key block
INVARIANT_ROWS = 16  # items per extend step and device in batch-invariant mode, padding included
# Padding (in item tokens) past which an extend step on CPU runs as steps of power-of-two rows.
# A CPU step's fixed cost, mostly reading every weight once, is worth about 30 tokens of compute
# whatever the model (twice the matmul rate over the memory bandwidth), so 128 leaves a margin.
CPU_SPLIT_PADDING_TOKENS = 128


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefillExtendOptions:
    """prefix_cache_bytes: the query K/V cache's budget (default 1 GiB on CPU, a tenth of
    accelerator memory; 0 keeps nothing). batch_items: items per extend step (default from an
    activation-memory estimate). activation_bytes: that estimate's budget (default 256 MiB on
    CPU, an eighth of accelerator memory). prefill_chunk: query tokens per prefill step, which
    bounds its own [chunk, chunk] attention (default 512). split_padding_tokens: an extend step
    whose row padding would hold at least this many item tokens runs as steps of power-of-two
    rows instead (100 items: 64 + 32 + 4 rather than 128; default 128 on CPU, 0 = never, the
    default on accelerators, where a step's fixed cost outweighs padding). batch_invariant: plan
    every step from one query and its items alone (module doc; set by
    `Scorer(batch_invariant=True)`)."""

    prefix_cache_bytes: int | None = None
    batch_items: int | None = None
    activation_bytes: int | None = None
    prefill_chunk: int | None = None
    split_padding_tokens: int | None = None
    batch_invariant: bool = False

    def __post_init__(self):
        for name, minimum in (
            ("prefix_cache_bytes", 0),
            ("batch_items", 1),
            ("activation_bytes", 1),
            ("prefill_chunk", 1),
            ("split_padding_tokens", 0),
        ):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), minimum=minimum)


def key_blocks(size: int, width: int | None = None) -> int:
    """Key blocks a step meets its query's K/V buffer of `size` positions in (a power of two, so
    they divide it): blocks at least `width` wide (a prefill chunk's own length; default
    KEY_BLOCK_TOKENS), at most MAX_KEY_BLOCKS. The blocks past the query's length are skipped
    (`decoder.extend`'s prefix_blocks): the padding `bucket_prefix` adds is not computed, nor, in
    a long query's prefill, the chunks not run yet. On CPU only: on a GPU, XLA runs a loop of
    dynamic trip count by reading its condition back to the host every block (not measured
    there), so accelerators keep one block."""
    if jax.default_backend() != "cpu":
        return 1
    return max(1, min(size // bucket_count(width or KEY_BLOCK_TOKENS), MAX_KEY_BLOCKS))


def prefix_kernel() -> decoder.PrefixKernel | None:
    """The fused CPU kernel for the attention to a shared query's K/V where this process can run
    it (x86-64 with AVX-512; float32 only, which the kernel checks per call; steps lowered for
    another platform keep XLA's ops): `decoder.extend`'s prefix_kernel."""
    return cpu_attention.prefix_attention if cpu_attention.available() else None


def keys_read(size: int, length: int, width: int | None = None) -> int:
    """Positions of a K/V buffer of `size` that a step meeting it in `key_blocks(size, width)`
    reads when it holds `length` keys: the blocks up to the one holding the last (all of one
    block, which runs without the loop)."""
    blocks = key_blocks(size, width)
    block = size // blocks
    return size if blocks == 1 else min(size, -(-length // block) * block)


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
    hidden, (k, v) = decoder.extend(
        params, config, prefix, tokens, causal, return_kv=True,
        prefix_blocks=key_blocks(prefix.k.shape[-1], R), prefix_kernel=prefix_kernel(),
    )  # fmt: skip
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
    blocks = key_blocks(prefix.k.shape[-1])
    hidden, _ = decoder.extend(
        params, config, prefix, items, causal, prefix_blocks=blocks, prefix_kernel=prefix_kernel()
    )
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


@functools.partial(jax.jit, static_argnames="size")
def resize(prefix: Prefix, size: int) -> Prefix:
    """`prefix` holding `size` positions: cut, or zero-padded past its own (a cached query's
    K/V continued by a longer query, or padded to the longest of a mixed step's queries)."""

    def fit(x: jax.Array, axis: int) -> jax.Array:
        extra = size - x.shape[axis]
        if extra <= 0:
            return jax.lax.slice_in_dim(x, 0, size, axis=axis)
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, extra)
        return jnp.pad(x, widths)

    return prefix._replace(k=fit(prefix.k, 3), v=fit(prefix.v, 2))


# `decoder.stack_prefixes` jitted: `count` prefixes of one size, stacked. Eagerly, its jnp ops
# would compile once per shape outside the shape set.
stack = jax.jit(decoder.stack_prefixes, static_argnames="count")


def bucket_item_tokens(n: int) -> int:
    """Item-length buckets: multiples of 4 up to 32, then `bucket_tokens`. Items are short and
    each padding token pays attention to the whole query: 20 tokens padded to 24 waste a sixth."""
    return max(4, -(-n // 4) * 4) if n <= 32 else bucket_tokens(n)


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
    distinct queries, `query_of`: each group's index into them. `ready`: each query's K/V where
    it needs no prefill (empty, or a cache hit), else None; `reused`: for a query to prefill, the
    cached state it continues (None: none) and how many of its tokens that holds."""

    groups: list[int]
    queries: list[np.ndarray]
    query_of: list[int]
    ready: list[Prefix | None]
    reused: dict[int, tuple[Prefix | None, int]]
    prefill: list[PrefillStep]
    extend: list[ExtendStep]


class PrefillExtendBackend(Scoring, Budgeted):
    # The jitted steps, reached through the instance: a seam for tests.
    prefill = staticmethod(prefill)
    prefill_rows = staticmethod(prefill_rows)
    score_items = staticmethod(score_items)
    score_mixed_items = staticmethod(score_mixed_items)

    def __init__(self, model: Model, options: PrefillExtendOptions):
        self.model = model
        budget = options.prefix_cache_bytes
        self.cache = PrefixCache(budgets.cache_budget() if budget is None else budget)
        self.batch_items = options.batch_items
        self.activation_bytes = options.activation_bytes or budgets.activation_budget()
        self.prefill_chunk = options.prefill_chunk or 512
        split = options.split_padding_tokens
        if split is None:
            split = CPU_SPLIT_PADDING_TOKENS if jax.default_backend() == "cpu" else 0
        self.split_padding_tokens = split
        self.batch_invariant = options.batch_invariant
        self._empty = self._zero_prefix(MIN_TOKEN_BUCKET)

    def plan(self, batches: Sequence[ScoreBatch]) -> Plan:
        """The call's waves (`waves`: groups whose queries' K/V are held at once); each wave's
        steps are planned when it comes (`expand`)."""
        return Plan(tuple(batches), self.waves(batches))

    def schedule(
        self,
        batches: Sequence[ScoreBatch],
        read: Callable[[np.ndarray], Reuse | None] | None = None,
    ) -> Iterator[Wave]:
        """The waves of `plan(batches)`, expanded (`expand`)."""
        return self.expand(self.plan(batches), read)

    def expand(
        self, plan: Plan, read: Callable[[np.ndarray], Reuse | None] | None = None
    ) -> Iterator[Wave]:
        """The plan's waves, each with its prefill and extend steps.

        Lazy: a wave is planned when the one before it has run, so it sees what that one put in
        the prefix cache. `read` is how the cache is consulted: `run` passes `cache.lookup`
        (which counts hits); the default, `cache.probe`, reads it without a trace, for pricing
        (`price`), which plans every wave from the cache as it is now."""
        read = read or self.cache.probe
        batches = plan.batches
        for groups in plan.steps:
            wave_batches = [batches[g] for g in groups]
            queries, query_of = _distinct_queries(wave_batches)
            ready, reused, prefill = self._plan_prefill(queries, read)
            extend = self.plan_extend(wave_batches, query_of)
            yield Wave(groups, queries, query_of, ready, reused, prefill, extend)

    def price(self, plan: Plan) -> list[work.StepWork]:
        """What each step of the plan does (for `selection.py`), with the prefix cache as it is
        now. Every step's peak holds the K/V of its wave's queries. Attention is priced
        over the keys a step reads: a lone query's key blocks up to its length (`keys_read`), a
        step of several queries their whole buffers."""
        config, layout, itemsize = self.model.config, self.model.layout, self.model.dtype.itemsize
        steps = []
        for wave in self.expand(plan):
            held = sum(self.prefix_bytes(len(q)) for q in wave.queries)
            for step in wave.prefill:
                R, P = step.length, step.base_len
                read = P if step.rows > 1 else keys_read(P, step.chunks[0].start, R)
                peak = -(-step.rows // layout.data) * memory.prefill_row_bytes(config, R, P)
                steps.append(
                    work.step_work(
                        config,
                        itemsize,
                        rows=step.rows,
                        new=R,
                        pairs=step.rows * R * (R + read),
                        slots=0,
                        peak=peak + held,
                        kv_bytes=work.kv_bytes(config, step.rows * read, itemsize),
                    )
                )
            for step in wave.extend:
                rows, L = step.size, step.item_len
                step_queries = {wave.query_of[w] for w in step.groups}
                longest = max(len(wave.queries[q]) for q in step_queries)
                P = bucket_prefix(longest)
                row_prefix = 0 if len(step_queries) == 1 else P  # else one shared prefix
                read = P if row_prefix else keys_read(P, longest)  # a lone query's key blocks
                peak = rows // layout.data * memory.extend_row_bytes(config, L, row_prefix)
                steps.append(
                    work.step_work(
                        config,
                        itemsize,
                        rows=rows,
                        new=L,
                        pairs=rows * L * (L + read),
                        slots=1,
                        peak=peak + held,
                        kv_bytes=work.kv_bytes(config, read, itemsize)
                        * (1 if row_prefix == 0 else rows),
                    )
                )
        return steps

    def run(self, plan: Plan) -> list[BackendOutput]:
        """Score several groups: their distinct queries prefilled together (cache hits skip it),
        then their items in extend steps, where items of different queries may share a step."""
        batches = plan.batches
        out = BackendOutput.for_groups(batches)
        for wave in self.expand(plan, read=self.cache.lookup):
            owners = [wave.groups[wave.query_of.index(q)] for q in range(len(wave.queries))]
            prefixes = self._run_prefill(wave, out, owners)
            for step in wave.extend:
                self._extend(step, wave.groups, batches, wave.query_of, prefixes, out)
        return out.build()

    def _extend(self, step, wave, batches, query_of, prefixes, out) -> None:
        """Run one extend step of a wave (step.groups index into the wave)."""
        n = len(step.rows)
        layout = self.model.layout
        groups = np.asarray(wave)[step.groups]
        items = np.zeros((step.size, step.item_len), np.int32)
        item_lens = np.zeros(items.shape[0], np.int32)
        for r, (g, i) in enumerate(zip(groups, step.rows, strict=True)):
            item_lens[r] = batches[g].item_lens[i]
            width = min(step.item_len, batches[g].items.shape[1])  # groups pad to own buckets
            items[r, :width] = batches[g].items[i, :width]
        step_queries = sorted({query_of[w] for w in step.groups})
        labels = stack_labels([batches[g].label_ids for g in groups], items.shape[0])
        size = max(prefixes[q].k.shape[-1] for q in step_queries)
        if len(step_queries) == 1:  # the shared-prefix matmul
            name = SCORE_ITEMS
            shape = (*items.shape, size, labels.shape[-1])
            logprobs = self.score_items(
                self.model.params,
                prefixes[step_queries[0]],
                *map(layout.put_rows, (items, item_lens, labels)),
                self.model.config,
            )
        else:  # each row against its own query's K/V
            name = SCORE_MIXED_ITEMS
            count = self.mixed_queries(step.size, size)
            own = [self._resized(prefixes[q], size) for q in step_queries]
            padding = [self._resized(self._empty, size)] * (count - len(own))
            stacked = self.stack(own + padding, count)
            query_index = np.zeros(items.shape[0], np.int32)
            query_index[:n] = [step_queries.index(query_of[w]) for w in step.groups]
            shape = (*items.shape, count, size, labels.shape[-1])
            logprobs = self.score_mixed_items(
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
            buckets = np.array([bucket_item_tokens(int(n)) for n in lens], int)
            for item_len in sorted(set(buckets.tolist())):
                (items,) = np.nonzero(buckets == item_len)
                size = self.invariant_rows(item_len)
                for start in range(0, len(items), size):
                    rows = items[start : start + size]
                    steps.append(ExtendStep(item_len, np.full(len(rows), g), rows, size))
        return steps

    def invariant_rows(self, item_len: int) -> int:
        """Rows of every batch-invariant extend step at this item bucket: `batch_items` if set,
        else what the budget allows, at most INVARIANT_ROWS per device."""
        if self.batch_items is not None:
            return self.model.layout.rows(self.batch_items)
        per_device = self.batch_rows(item_len) // self.model.layout.data
        return min(per_device, INVARIANT_ROWS) * self.model.layout.data

    def query_prefix(self, query: np.ndarray) -> Prefix:
        """One query's K/V, from the cache or prefilled, with no output to count steps in (for
        other workloads on this machinery, such as `tasks.loglikelihood`)."""
        ready, reused, steps = self._plan_prefill([query], self.cache.lookup)
        wave = Wave([0], [query], [0], ready, reused, steps, [])
        return self._run_prefill(wave, None, [0])[0]

    def continuation_batches(self, lens: np.ndarray) -> Iterator[tuple[np.ndarray, int]]:
        """Steps of continuations of one query, each read at every position over the whole
        vocabulary (`tasks.loglikelihood`): (indices into lens, padded length) per step.

        Continuations are taken shortest first, so similar lengths share a step; rows per step:
        a power of two within the extend estimate and within the activation budget for the
        float32 [rows, length, vocab] log-probabilities (held about three times: logits,
        log-softmax, the gather)."""
        order = np.argsort(lens, kind="stable")
        sorted_lens, config = lens[order], self.model.config
        start, n = 0, len(sorted_lens)
        while start < n:
            length = bucket_item_tokens(int(sorted_lens[-1]))
            extend = memory.extend_batch_rows(
                config, length, self.activation_bytes, MAX_BATCH_TOKENS
            )
            vocab = pow2_floor(self.activation_bytes // (3 * 4 * length * config.vocab_size))
            count = min(n - start, extend, vocab)
            length = bucket_item_tokens(int(sorted_lens[start + count - 1]))
            yield order[start : start + count], length
            start += count

    def _plan_prefill(
        self, queries: Sequence[np.ndarray], read: Callable[[np.ndarray], Reuse | None]
    ) -> tuple[list[Prefix | None], dict[int, tuple[Prefix | None, int]], list[PrefillStep]]:
        """The prefill steps for these queries, as `Wave` holds them: nothing on a cache hit, the
        part past the longest cached prefix on a partial hit, all of it on a miss.

        A query's K/V hold `bucket_prefix(len(query))` positions from its first step on, so its
        steps' shapes come from the shape set (`shapes`). Queries of one prefill chunk at most,
        with nothing cached, prefill together, one per row, in steps of queries of one K/V size,
        longest first so similar lengths share a step. The others (longer, or continuing a cached
        prefix, resized to their own size) prefill one per step, a chunk at a time.
        Batch-invariant: exact hits only, and one query per step, so its chunks start at 0 and
        every multiple of prefill_chunk."""
        ready: list[Prefix | None] = [None] * len(queries)
        reused: dict[int, tuple[Prefix | None, int]] = {}
        together, alone = [], []  # query indices; alone: (index, tokens done)
        for i, query in enumerate(queries):
            n = len(query)
            if n == 0:
                ready[i] = self._empty
                continue
            reuse = read(query)
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
            length = bucket_tokens(len(queries[together[0]]))
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
                steps.append(PrefillStep(chunk, bucket_tokens(stop - start), base_len, 1, size))
                start, base_len = stop, size
        return ready, reused, steps

    def _run_prefill(
        self, wave: Wave, out: GroupsOutputBuilder | None, owners: Sequence[int]
    ) -> list[Prefix]:
        """Run a wave's prefill steps; returns each query's K/V and caches each one prefilled.
        Each step is counted in `out` (if given), its tokens charged to the query's owner
        group."""
        prefixes, current = list(wave.ready), {}
        # Every prefix a step takes is placed as `warm` places its zeros: on a mesh, jit keys an
        # executable by its inputs' shardings too, so an unplaced one would compile again.
        place = self.model.layout.put_prefix
        for i, (base, start) in wave.reused.items():
            n = len(wave.queries[i])
            logger.debug("prefilling %d of %d query tokens (%d cached)", n - start, n, start)
            if base is None:
                current[i] = self._empty
            else:
                resized = self._resized(base._replace(length=np.int32(start)), bucket_prefix(n))
                current[i] = place(resized)
        for step in wave.prefill:
            advanced = self._prefill_step(wave.queries, step, current, out, owners)
            for chunk, prefix in zip(step.chunks, advanced, strict=True):
                i = chunk.query
                if chunk.stop < len(wave.queries[i]):
                    current[i] = place(prefix)
                else:
                    prefixes[i] = prefix = place(prefix)
                    nbytes = sum(a.nbytes for a in (prefix.k, prefix.v, prefix.last_hidden))
                    self.cache.put(wave.queries[i], prefix, nbytes)
        return prefixes

    def _resized(self, prefix: Prefix, size: int) -> Prefix:
        """`prefix` holding `size` positions (itself if it does)."""
        return prefix if prefix.k.shape[-1] == size else resize(prefix, size=size)

    def _prefill_step(self, queries, step: PrefillStep, current, out, owners) -> list[Prefix]:
        """Run one prefill step on the prefixes so far (`current`, by query); returns the
        advanced prefix of each of its chunks."""
        layout = self.model.layout
        chunks = [queries[c.query][c.start : c.stop] for c in step.chunks]
        tokens = np.zeros((step.rows, step.length), np.int32)
        for r, chunk in enumerate(chunks):
            tokens[r, : len(chunk)] = chunk
        charged = {owners[c.query]: c.stop - c.start for c in step.chunks}
        if len(chunks) == 1:  # one query: its prefix in place, as a lone request runs
            if out is not None:
                out.step(PREFILL, (step.length, step.base_len, step.size), charged)
            prefix = self.prefill(
                self.model.params,
                current[step.chunks[0].query],
                tokens,
                np.int32(len(chunks[0])),
                config=self.model.config,
                size=step.size,
            )
            return [prefix]
        counts = np.zeros(tokens.shape[0], np.int32)
        counts[: len(chunks)] = list(map(len, chunks))
        empties = self.stack([self._empty] * step.rows, step.rows)
        if out is not None:
            out.step(PREFILL_ROWS, (*tokens.shape, step.base_len, step.size), charged)
        stacked = self.prefill_rows(
            self.model.params,
            empties,
            layout.put_rows(tokens),
            layout.put_rows(counts),
            config=self.model.config,
            size=step.size,
        )
        stacked = layout.put_prefix(stacked, stacked=True)  # as `warm` places it (on a mesh)
        return [_unstack(stacked, np.int32(r), size=step.size) for r in range(len(chunks))]

    def prefill_batch_rows(self, length: int, base_len: int) -> int:
        """Queries per batched prefill step at this chunk length and cached-prefix length."""
        per_device = memory.prefill_rows(
            self.model.config, length, base_len, self.budget, MAX_PREFILL_TOKENS
        )
        return per_device * self.model.layout.data

    def _plan(self, sorted_lens: np.ndarray, batch_rows, queries=None):
        """Batches over length-sorted items: (positions in sorted order, item-length bucket);
        batch_rows(item_len) caps a batch's items, and with queries = (each item's query, cap)
        a batch holds at most cap distinct queries. One query's batches are split rather than
        padded (`unpadded_rows`); mixed-query batches are not: each of their shapes stacks
        prefixes and compiles dearly, and splitting them doubled the compiles of many-query
        streams (a test scoring table rows went from 5 to 10 s)."""
        start, n = 0, len(sorted_lens)
        while start < n:
            count = n - start
            item_len = bucket_item_tokens(int(sorted_lens[start + count - 1]))
            cap = batch_rows(item_len)
            if queries is not None:  # up to the first item of one query too many
                own, most = queries
                _, first = np.unique(own[start : start + min(count, cap)], return_index=True)
                if len(first) > most:
                    cap = min(cap, int(np.sort(first)[most]))
            if count > cap:  # shrinking the batch can only shorten its bucket: cap still holds
                count = cap
                item_len = bucket_item_tokens(int(sorted_lens[start + count - 1]))
            unpadded = count if queries is not None else self.unpadded_rows(count, item_len)
            if unpadded < count:
                count = unpadded
                item_len = bucket_item_tokens(int(sorted_lens[start + count - 1]))
            yield np.arange(start, start + count), item_len
            start += count

    def unpadded_rows(self, count: int, item_len: int) -> int:
        """The items a step of `count` items takes: all of them, or where padding them to a row
        bucket would waste `split_padding_tokens` item tokens or more, the largest row bucket
        below (the rest go to the next steps, which are split again)."""
        layout = self.model.layout
        padding = (layout.rows(count) - count) * item_len
        if not self.split_padding_tokens or padding < self.split_padding_tokens:
            return count
        below = pow2_floor(count)
        return below if layout.rows(below) == below else count

    def batch_rows(self, item_len: int, row_prefix_len: int = 0) -> int:
        """Items per extend step: the override, or as many as the activation budget allows on
        each device at this item length (with a per-row prefix of row_prefix_len positions)."""
        if self.batch_items is not None:
            return self.batch_items
        per_device = memory.extend_batch_rows(
            self.model.config, item_len, self.budget, MAX_BATCH_TOKENS, row_prefix_len
        )
        return per_device * self.model.layout.data

    def shapes(self, limits: ShapeLimits) -> set[StepShape]:
        """Every step shape this backend can compile for requests within `limits`, on its
        budgets as they are: the shape set (docs/serving.md, "Compiled shapes").

        prefill (R, P_in, size): a chunk of R tokens into K/V of `size` = bucket_prefix(query)
        positions, continuing the empty prefix (P_in 16) or its own (P_in = size).
        prefill_rows (rows, R, 16, size), with stack (rows, 16) of its empty prefixes and
        unstack (rows, size): fresh one-chunk queries of one size together.
        resize (P_in, size): a cached prefix continued by a query of another size, or padded to
        a mixed step's size. score_items (rows, L, P, C) and score_mixed_items
        (rows, L, mixed_queries(rows, P), P, C) with its stack: rows a power
        of two within the step's budget, L an item bucket, P a query's size, C a label bucket.
        """
        Q, chunk, layout = limits.query_tokens, self.prefill_chunk, self.model.layout
        invariant = self.batch_invariant
        sizes = sorted({bucket_prefix(n) for n in range(Q + 1)})
        out: set[StepShape] = set()
        for size in sizes:
            low, high = (1 if size == MIN_TOKEN_BUCKET else size // 2 + 1), min(Q, size)
            for n in range(low, high + 1):  # a query's first chunk, on the empty prefix
                out.add(StepShape(PREFILL, (bucket_tokens(min(n, chunk)), MIN_TOKEN_BUCKET, size)))
            # Later chunks of a long query; without batch invariance, any rest after a cache hit.
            longest_rest = high - chunk if invariant else high - 1
            for m in range(1, min(chunk, longest_rest) + 1):
                out.add(StepShape(PREFILL, (bucket_tokens(m), size, size)))
            if invariant:
                continue
            for n in range(low, min(high, chunk) + 1):
                length = bucket_tokens(n)
                cap = self.prefill_batch_rows(length, MIN_TOKEN_BUCKET)
                for rows in row_buckets(2, cap, layout.data):
                    out.add(StepShape(PREFILL_ROWS, (rows, length, MIN_TOKEN_BUCKET, size)))
                    out.add(StepShape(STACK, (rows, MIN_TOKEN_BUCKET)))
                    out.add(StepShape(UNSTACK, (rows, size)))
            out.update(StepShape(RESIZE, (other, size)) for other in sizes if other != size)
        widths = limits.label_widths()
        for item_len in sorted({bucket_item_tokens(n) for n in range(limits.item_tokens + 1)}):
            if invariant:
                row_counts = [self.invariant_rows(item_len)]
            else:
                row_counts = row_buckets(1, self.batch_rows(item_len), layout.data)
            for rows, size, width in itertools.product(row_counts, sizes, widths):
                out.add(StepShape(SCORE_ITEMS, (rows, item_len, size, width)))
                if not invariant and rows >= 2:
                    count = self.mixed_queries(rows, size)
                    out.add(StepShape(SCORE_MIXED_ITEMS, (rows, item_len, count, size, width)))
                    out.add(StepShape(STACK, (count, size)))
        return out

    def stack(self, prefixes: Sequence[Prefix], count: int) -> Prefix:
        """`count` prefixes of one size stacked (`stack`), placed as the steps take them."""
        return self.model.layout.put_prefix(stack(prefixes, count=count), stacked=True)

    @property
    def steps(self) -> StepTable:
        """The jitted steps and the zeros of each shape (`shapes` lists them)."""
        return step_table(
            Step(PREFILL, self.prefill, self._prefill_zeros),
            Step(PREFILL_ROWS, self.prefill_rows, self._prefill_rows_zeros),
            Step(STACK, self.stack, self._stack_zeros),
            Step(UNSTACK, _unstack, self._unstack_zeros),
            Step(RESIZE, resize, self._resize_zeros),
            Step(SCORE_ITEMS, self.score_items, self._score_items_zeros),
            Step(SCORE_MIXED_ITEMS, self.score_mixed_items, self._score_mixed_items_zeros),
        )

    def _prefill_zeros(self, shape: tuple[int, ...]) -> tuple[tuple, dict]:
        length, base_len, size = shape
        params, config = self.model.params, self.model.config
        tokens = np.zeros((1, length), np.int32)
        args = (params, self._zero_prefix(base_len), tokens, np.int32(1))
        return args, {"config": config, "size": size}

    def _prefill_rows_zeros(self, shape: tuple[int, ...]) -> tuple[tuple, dict]:
        rows, length, base_len, size = shape
        layout, zeros = self.model.layout, functools.partial(np.zeros, dtype=np.int32)
        args = (
            self.model.params,
            layout.put_prefix(self._zero_prefix(base_len, rows), stacked=True),
            *map(layout.put_rows, (zeros((rows, length)), zeros(rows))),
        )
        return args, {"config": self.model.config, "size": size}

    def _stack_zeros(self, shape: tuple[int, ...]) -> tuple[tuple, dict]:
        count, size = shape
        return ([self._zero_prefix(size)] * count, count), {}

    def _unstack_zeros(self, shape: tuple[int, ...]) -> tuple[tuple, dict]:
        rows, size = shape
        return (self._zero_prefix(size, rows), np.int32(0)), {"size": size}

    def _resize_zeros(self, shape: tuple[int, ...]) -> tuple[tuple, dict]:
        base_len, size = shape
        return (self._zero_prefix(base_len),), {"size": size}

    def _score_items_zeros(self, shape: tuple[int, ...]) -> tuple[tuple, dict]:
        rows, item_len, size, width = shape
        zeros, layout = functools.partial(np.zeros, dtype=np.int32), self.model.layout
        inputs = (zeros((rows, item_len)), zeros(rows), zeros((rows, width)))
        args = (self.model.params, self._zero_prefix(size), *map(layout.put_rows, inputs))
        return (*args, self.model.config), {}

    def _score_mixed_items_zeros(self, shape: tuple[int, ...]) -> tuple[tuple, dict]:
        rows, item_len, count, size, width = shape
        zeros, layout = functools.partial(np.zeros, dtype=np.int32), self.model.layout
        stacked = layout.put_prefix(self._zero_prefix(size, count), stacked=True)
        inputs = (zeros(rows), zeros((rows, item_len)), zeros(rows), zeros((rows, width)))
        args = (self.model.params, stacked, *map(layout.put_rows, inputs))
        return (*args, self.model.config), {}

    def _zero_prefix(self, size: int, count: int | None = None) -> Prefix:
        """A prefix of zeros holding `size` positions, or `count` of them stacked, placed as the
        steps' own are (uncommitted on one device), without compiling anything."""
        config, dtype = self.model.config, self.model.dtype
        L, K, H, D = config.num_layers, config.num_kv_heads, config.head_dim, config.hidden_size
        stacked = () if count is None else (count,)
        prefix = Prefix(
            k=np.zeros((L, *stacked, K, H, size), dtype),
            v=np.zeros((L, *stacked, K, size, H), dtype),
            length=np.zeros(stacked, np.int32),
            last_hidden=np.zeros((*stacked, D), np.float32),
        )
        if self.model.layout.mesh is None:
            return jax.tree.map(jax.device_put, prefix)
        # Host arrays go straight to their shards; resharding a device array would compile.
        return self.model.layout.put_prefix(prefix, stacked=count is not None)


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
