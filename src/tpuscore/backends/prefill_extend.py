"""prefill_extend: prefill the query once, then score every item against its cached K/V.

Serial scoring runs N x (query + item) token positions; this runs the query once plus N x item.
Items attend to the query's K/V through one shared matmul and to their own tokens causally, and
the two halves merge exactly (`decoder.extend`), so scores equal serial up to float rounding.

The query's K/V stays in a `PrefixCache` across calls: a repeated query costs item work only, and a
query sharing a prefix with a cached one prefills only the rest.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from tpuscore.batching import BackendOutput, ScoreBatch, bucket_count, bucket_tokens, pow2_floor
from tpuscore.memory import activation_budget, activation_bytes_per_token, cache_budget
from tpuscore.models import decoder
from tpuscore.models.config import ModelConfig
from tpuscore.models.decoder import Prefix
from tpuscore.models.weights import Params
from tpuscore.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)

PREFILL_CHUNK = 512  # query tokens per prefill step: bounds its own [chunk, chunk] attention
MAX_BATCH_TOKENS = 4096  # item tokens per extend step, whatever the memory would allow


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
    """Options: prefix_cache_bytes (cache budget; default 1 GiB on CPU, a tenth of accelerator
    memory), batch_items (items per extend step; default from an activation-memory estimate),
    activation_bytes (that estimate's budget)."""

    supports_item_first = False  # the query must come first to be a shared prefix

    def __init__(
        self,
        config: ModelConfig,
        params: Params,
        *,
        prefix_cache_bytes: int | None = None,
        batch_items: int | None = None,
        activation_bytes: int | None = None,
    ):
        if batch_items is not None and (not isinstance(batch_items, int) or batch_items < 1):
            raise ValueError(f"batch_items must be a positive int, got {batch_items!r}")
        self.config = config
        self.params = params
        self.cache = PrefixCache(
            cache_budget() if prefix_cache_bytes is None else prefix_cache_bytes
        )
        self.batch_items = batch_items
        self.activation_bytes = activation_bytes or activation_budget()
        dtype = params["layers"]["wk"].dtype
        L, K, H = config.num_layers, config.num_kv_heads, config.head_dim
        self._empty = Prefix(
            k=jnp.zeros((L, K, H, bucket_tokens(0)), dtype),
            v=jnp.zeros((L, K, bucket_tokens(0), H), dtype),
            length=jnp.int32(0),
            last_hidden=jnp.zeros(config.hidden_size, jnp.float32),
        )

    def score(self, batch: ScoreBatch) -> BackendOutput:
        prefix, prefilled = self.query_prefix(batch.query[: batch.query_len])
        n = batch.num_items
        lens = batch.item_lens[:n]
        order = np.argsort(lens, kind="stable")  # similar lengths share a batch: less padding
        logprobs = np.zeros((batch.items.shape[0], batch.label_ids.shape[0]), np.float32)
        for rows, L in self._plan(lens[order]):
            items = np.zeros((bucket_count(len(rows)), L), np.int32)
            item_lens = np.zeros(items.shape[0], np.int32)
            item_lens[: len(rows)] = lens[order[rows]]
            items[: len(rows)] = batch.items[order[rows], :L]
            out = score_items(self.params, prefix, items, item_lens, batch.label_ids, self.config)
            logprobs[order[rows]] = np.asarray(out)[: len(rows)]
        valid = np.arange(logprobs.shape[0]) < n
        return BackendOutput(logprobs, valid, num_tokens=prefilled + int(lens.sum()))

    def query_prefix(self, query: np.ndarray) -> tuple[Prefix, int]:
        """The query's K/V and how many tokens were prefilled to get it: none on a cache hit, the
        part past the longest cached prefix on a partial hit, all of them on a miss."""
        n = len(query)
        if n == 0:
            return self._empty, 0
        reuse = self.cache.lookup(query)
        if reuse is not None and reuse.exact:
            return reuse.value, 0
        # Reuse at most n - 1 tokens: the last token's hidden state is needed and not cached.
        start = 0 if reuse is None else min(reuse.length, n - 1)
        prefix = self._empty if start == 0 else reuse.value._replace(length=jnp.int32(start))
        for begin in range(start, n, PREFILL_CHUNK):
            chunk = query[begin : begin + PREFILL_CHUNK]
            tokens = np.zeros((1, bucket_tokens(len(chunk))), np.int32)
            tokens[0, : len(chunk)] = chunk
            size = bucket_tokens(begin + len(chunk))
            prefix = prefill(
                self.params, prefix, tokens, np.int32(len(chunk)), config=self.config, size=size
            )
        nbytes = sum(a.nbytes for a in (prefix.k, prefix.v, prefix.last_hidden))
        self.cache.put(query, prefix, nbytes)
        logger.debug("prefilled %d of %d query tokens (%d cached)", n - start, n, start)
        return prefix, n - start

    def _plan(self, sorted_lens: np.ndarray):
        """Batches over length-sorted items: (positions in sorted order, item-length bucket)."""
        start, n = 0, len(sorted_lens)
        while start < n:
            rows = n - start
            L = bucket_item_tokens(int(sorted_lens[start + rows - 1]))
            cap = self._batch_rows(L)
            if rows > cap:  # shrinking the batch can only shorten its bucket: cap still holds
                rows = cap
                L = bucket_item_tokens(int(sorted_lens[start + rows - 1]))
            yield np.arange(start, start + rows), L
            start += rows

    def _batch_rows(self, L: int) -> int:
        """Items per extend step: the override, or as many (a power of two) as the activation
        budget allows at this item length."""
        if self.batch_items is not None:
            return self.batch_items
        config = self.config
        # Per item token, in float32: activations, and scores and exp weights against its own
        # item. Scores against the prefix go through fixed-size blocks (`decoder._prefix_parts`).
        per_token = activation_bytes_per_token(config) + 4 * 3 * config.num_heads * L
        tokens = min(MAX_BATCH_TOKENS, self.activation_bytes // per_token)
        return pow2_floor(tokens // L)
