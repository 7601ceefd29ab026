"""prefill_extend: prefill the query once, then score every item against its cached K/V.

Serial scoring runs N x (query + item) token positions; this runs the query once plus N x item.
Items attend to the query's K/V through one shared matmul and to their own tokens causally, and
the two halves merge exactly (`decoder.extend`), so scores equal serial up to float rounding.

The query's K/V stays in a `PrefixCache` across calls: a repeated query costs item work only, and a
query sharing a prefix with a cached one prefills only the rest.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from tpuscore import costs
from tpuscore.backends.contract import BackendOutput, OutputBuilder, ScoreBatch
from tpuscore.buckets import bucket_count, bucket_tokens
from tpuscore.errors import check_int
from tpuscore.models import decoder
from tpuscore.models.config import ModelConfig
from tpuscore.models.decoder import Prefix
from tpuscore.models.model import Model
from tpuscore.models.weights import Params
from tpuscore.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)

MAX_BATCH_TOKENS = 4096  # item tokens per extend step, whatever the memory would allow


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

    def append(cached, new, axis):
        # Room for R more positions past the larger of both sizes, so no write is clipped.
        shape = list(cached.shape)
        shape[axis] = max(size, shape[axis]) + R
        out = jax.lax.dynamic_update_slice_in_dim(jnp.zeros(shape, new.dtype), cached, 0, axis)
        out = jax.lax.dynamic_update_slice_in_dim(out, new, prefix.length, axis)
        return jax.lax.slice_in_dim(out, 0, size, axis=axis)

    return Prefix(
        k=append(prefix.k, k, axis=3),
        v=append(prefix.v, v, axis=2),
        length=prefix.length + count,
        last_hidden=hidden[0, count - 1],
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
    """Label logprobs [B, C] after prefix + each row of items [B, L] (right-padded).

    An empty item scores the prefix's last token. Rows are independent: padding rows are dropped.
    """
    B, L = items.shape
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((L, L), bool)), (B, L, L))
    hidden, _ = decoder.extend(params, config, prefix, items, causal)
    last = hidden[jnp.arange(B), jnp.maximum(item_lens - 1, 0)]
    last = jnp.where((item_lens == 0)[:, None], prefix.last_hidden, last)
    return decoder.label_logprobs(params, config, last, label_ids)


def bucket_item_tokens(n: int) -> int:
    """Item-length buckets: multiples of 4 up to 32, then `bucket_tokens`. Items are short and
    each padding token pays attention to the whole query: 20 tokens padded to 24 waste a sixth."""
    return max(4, -(-n // 4) * 4) if n <= 32 else bucket_tokens(n)


class PrefillExtendBackend:
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
        out = BackendOutput.for_batch(batch)
        prefix = self.query_prefix(batch.query[: batch.query_len], out)
        lens = batch.item_lens[: batch.num_items]
        order = np.argsort(lens, kind="stable")  # similar lengths share a batch: less padding
        for positions, item_len in self._plan(lens[order]):
            rows = order[positions]
            items = np.zeros((bucket_count(len(rows)), item_len), np.int32)
            item_lens = np.zeros(items.shape[0], np.int32)
            item_lens[: len(rows)] = lens[rows]
            items[: len(rows)] = batch.items[rows, :item_len]
            out.step("score_items", (*items.shape, len(batch.label_ids)), int(item_lens.sum()))
            out.scores(
                rows,
                score_items(
                    self.model.params,
                    prefix,
                    items,
                    item_lens,
                    batch.label_ids,
                    self.model.config,
                ),
            )
        return out.build()

    def query_prefix(self, query: np.ndarray, out: OutputBuilder | None = None) -> Prefix:
        """The query's K/V. Prefills nothing on a cache hit, the part past the longest cached
        prefix on a partial hit, all of it on a miss; each prefill step is counted in `out`."""
        n = len(query)
        if n == 0:
            return self._empty
        reuse = self.cache.lookup(query)
        if reuse is not None and reuse.exact:
            return reuse.value
        # Reuse at most n - 1 tokens: the last token's hidden state is needed and not cached.
        start = 0 if reuse is None else min(reuse.length, n - 1)
        prefix = self._empty if start == 0 else reuse.value._replace(length=jnp.int32(start))
        chunk_len = self.prefill_chunk
        for begin in range(start, n, chunk_len):
            chunk = query[begin : begin + chunk_len]
            tokens = np.zeros((1, bucket_tokens(len(chunk))), np.int32)
            tokens[0, : len(chunk)] = chunk
            size = bucket_tokens(begin + len(chunk))
            if out is not None:
                out.step("prefill", (tokens.shape[1], size), len(chunk))
            prefix = prefill(
                self.model.params,
                prefix,
                tokens,
                np.int32(len(chunk)),
                config=self.model.config,
                size=size,
            )
        nbytes = sum(a.nbytes for a in (prefix.k, prefix.v, prefix.last_hidden))
        self.cache.put(query, prefix, nbytes)
        logger.debug("prefilled %d of %d query tokens (%d cached)", n - start, n, start)
        return prefix

    def _plan(self, sorted_lens: np.ndarray):
        """Batches over length-sorted items: (positions in sorted order, item-length bucket)."""
        start, n = 0, len(sorted_lens)
        while start < n:
            count = n - start
            item_len = bucket_item_tokens(int(sorted_lens[start + count - 1]))
            cap = self._batch_rows(item_len)
            if count > cap:  # shrinking the batch can only shorten its bucket: cap still holds
                count = cap
                item_len = bucket_item_tokens(int(sorted_lens[start + count - 1]))
            yield np.arange(start, start + count), item_len
            start += count

    def _batch_rows(self, item_len: int) -> int:
        """Items per extend step: the override, or as many (a power of two) as the activation
        budget allows at this item length."""
        if self.batch_items is not None:
            return self.batch_items
        return costs.extend_batch_rows(
            self.model.config, item_len, self.activation_bytes, MAX_BATCH_TOKENS
        )
