"""prefill_extend's jitted steps: prefill a query's K/V (one query, or several stacked one per
row), score items against one query's K/V or each row against its own, and stack, unstack and
resize K/V, which are jitted too since eager jnp ops compile per shape as well.

Every scoring step takes `adapters` (each row's LoRA adapter, `Model.row_adapters`; None: the
base model): a query's K/V are computed under the adapter of the items that read them.

A step meets its query's K/V in key blocks and skips those past the query's length
(`key_blocks`), on CPU through the fused CPU kernel where this process can run it
(`prefix_kernel`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tpuscore.backends.buckets import bucket_count
from tpuscore.backends.contract import TOP_LOGPROBS
from tpuscore.kernels import cpu_attention
from tpuscore.models import decoder
from tpuscore.models.adapters import RowAdapters
from tpuscore.models.config import ModelConfig
from tpuscore.models.decoder import Prefix
from tpuscore.models.weights import Params

# The steps' names, as the step table, the shape set and a run's stats give them.
PREFILL, PREFILL_ROWS, STACK, UNSTACK, RESIZE = (
    "prefill",
    "prefill_rows",
    "stack",
    "unstack",
    "resize",
)
SCORE_ITEMS, SCORE_MIXED_ITEMS = "score_items", "score_mixed_items"
CONTINUATION_LOGPROBS = "continuation_logprobs"  # the loglikelihood plans' extend step
PROMPT_LOGPROBS = "prompt_logprobs"  # the prompt log-probabilities plans' extend step

# A step meets its query's K/V in key blocks and skips those past the query's length (`key_blocks`).
MAX_KEY_BLOCKS = 8
KEY_BLOCK_TOKENS = 256  # an extend step's narrowest key block


def key_blocks(size: int, width: int | None = None, *, platform: str | None = None) -> int:
    """Key blocks a step meets its query's K/V buffer of `size` positions in (a power of two, so
    they divide it): blocks at least `width` wide (a prefill chunk's own length; default
    KEY_BLOCK_TOKENS), at most MAX_KEY_BLOCKS. The blocks past the query's length are skipped
    (`decoder.extend`'s prefix_blocks): the padding `bucket_prefix` adds is not computed, nor, in
    a long query's prefill, the chunks not run yet. On CPU only: on a GPU, XLA runs a loop of
    dynamic trip count by reading its condition back to the host every block (not measured
    there), so accelerators keep one block. platform: where the step runs (the model's; None:
    this process's default)."""
    if (platform or jax.default_backend()) != "cpu":
        return 1
    return max(1, min(size // bucket_count(width or KEY_BLOCK_TOKENS), MAX_KEY_BLOCKS))


def prefix_kernel() -> decoder.PrefixKernel | None:
    """The fused CPU kernel for the attention to a shared query's K/V where this process can run
    it (x86-64 with AVX-512; float32 only, which the kernel checks per call; steps lowered for
    another platform keep XLA's ops): `decoder.extend`'s prefix_kernel."""
    return cpu_attention.prefix_attention if cpu_attention.available() else None


def keys_read(
    size: int, length: int, width: int | None = None, *, platform: str | None = None
) -> int:
    """Positions of a K/V buffer of `size` that a step meeting it in `key_blocks(size, width)`
    reads when it holds `length` keys: the blocks up to the one holding the last (all of one
    block, which runs without the loop)."""
    blocks = key_blocks(size, width, platform=platform)
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


@functools.partial(jax.jit, static_argnames=("config", "size", "platform"))
def prefill(
    params: Params,
    prefix: Prefix,
    tokens: jax.Array,
    count: jax.Array,
    config: ModelConfig,
    size: int,
    platform: str | None = None,
    adapters: RowAdapters | None = None,
) -> Prefix:
    """Extend `prefix` by the first `count` of tokens [1, R]; the result holds `size` positions.
    platform: where it runs (`key_blocks`); adapters: the query's adapter (one row)."""
    R = tokens.shape[1]
    causal = jnp.tril(jnp.ones((1, R, R), bool))
    hidden, (k, v) = decoder.extend(
        params, config, prefix, tokens, causal, return_kv=True,
        prefix_blocks=key_blocks(prefix.k.shape[-1], R, platform=platform),
        prefix_kernel=prefix_kernel(), platform=platform, adapters=adapters,
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
    adapters: RowAdapters | None = None,
) -> Prefix:
    """Extend each of the stacked `prefixes` (`decoder.stack_prefixes`, one per row) by the first
    counts[b] of tokens [B, R] in its row (under its adapter); the results, stacked, hold `size`
    positions."""
    B, R = tokens.shape
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((R, R), bool)), (B, R, R))
    hidden, (k, v) = decoder.extend(
        params, config, prefixes, tokens, causal, rows=jnp.arange(B), return_kv=True,
        adapters=adapters,
    )  # fmt: skip
    k = k.transpose(0, 1, 3, 4, 2)  # [layers, B, K, H, R]
    v = v.transpose(0, 1, 3, 2, 4)  # [layers, B, K, R, H]
    append = jax.vmap(_append, in_axes=(1, 1, 0, None, None), out_axes=1)
    return Prefix(
        k=append(prefixes.k, k, prefixes.length, size, 3),
        v=append(prefixes.v, v, prefixes.length, size, 2),
        length=prefixes.length + counts,
        last_hidden=hidden[jnp.arange(B), counts - 1],
    )


@functools.partial(jax.jit, static_argnames=("config", "platform"))
def score_items(
    params: Params,
    prefix: Prefix,
    items: jax.Array,
    item_lens: jax.Array,
    label_ids: jax.Array,
    config: ModelConfig,
    platform: str | None = None,
    adapters: RowAdapters | None = None,
) -> jax.Array:
    """Label logprobs [B, C] after prefix + each row of items [B, L] (right-padded); label_ids
    [C] for every row, or [B, C] per row. adapters: each row's, that of the prefix's query.

    An empty item scores the prefix's last token. Rows are independent: padding rows are dropped.
    """
    B, L = items.shape
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((L, L), bool)), (B, L, L))
    blocks = key_blocks(prefix.k.shape[-1], platform=platform)
    kernel = prefix_kernel()
    hidden, _ = decoder.extend(
        params,
        config,
        prefix,
        items,
        causal,
        prefix_blocks=blocks,
        prefix_kernel=kernel,
        platform=platform,
        adapters=adapters,
    )
    last = hidden[jnp.arange(B), jnp.maximum(item_lens - 1, 0)]
    last = jnp.where((item_lens == 0)[:, None], prefix.last_hidden, last)
    if label_ids.ndim == 2:
        return decoder.row_label_logprobs(params, config, last[:, None], label_ids, adapters)[:, 0]
    return decoder.label_logprobs(params, config, last, label_ids, adapters)


@functools.partial(jax.jit, static_argnames="config")
def score_mixed_items(
    params: Params,
    prefixes: Prefix,
    query_index: jax.Array,
    items: jax.Array,
    item_lens: jax.Array,
    label_ids: jax.Array,
    config: ModelConfig,
    adapters: RowAdapters | None = None,
) -> jax.Array:
    """Label logprobs [B, C] after prefix query_index[b] of the stacked `prefixes` + row b of
    items [B, L], with labels per row [B, C]: rows of different queries in one step, each
    attending to its own query's K/V (gathered per row), each under its own adapter."""
    B, L = items.shape
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((L, L), bool)), (B, L, L))
    hidden, _ = decoder.extend(
        params, config, prefixes, items, causal, rows=query_index, adapters=adapters
    )
    last = hidden[jnp.arange(B), jnp.maximum(item_lens - 1, 0)]
    last = jnp.where((item_lens == 0)[:, None], prefixes.last_hidden[query_index], last)
    return decoder.row_label_logprobs(params, config, last[:, None], label_ids, adapters)[:, 0]


@functools.partial(jax.jit, static_argnames="size")
def unstack(prefixes: Prefix, row: jax.Array, size: int) -> Prefix:
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


@functools.partial(jax.jit, static_argnames="config")
def continuation_logprobs(
    params: Params,
    prefix: Prefix,
    tokens: jax.Array,
    config: ModelConfig,
    adapters: RowAdapters | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Log-probabilities [B, L] of tokens [B, L] (rows right-padded continuations of `prefix`),
    each given the prefix and the row's tokens before it, and whether each is the argmax [B, L].
    adapters: each row's LoRA adapter, that of the prefix's query.

    Token j is predicted by the hidden state before it: the prefix's last token for j = 0, the
    row's token j - 1 after. Positions past a row's length hold padding: the caller drops them
    (causal attention keeps padding from reaching real tokens)."""
    B, L = tokens.shape
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((L, L), bool)), (B, L, L))
    hidden, _ = decoder.extend(params, config, prefix, tokens, causal, adapters=adapters)
    first = jnp.broadcast_to(prefix.last_hidden, (B, 1, hidden.shape[-1]))
    before = jnp.concatenate([first, hidden[:, :-1]], axis=1)  # [B, L, D]
    vocab = jnp.arange(config.vocab_size)
    # An LM head takes no adapter (only a classification head has its own; it has no tokens).
    logprobs = decoder.label_logprobs(params, config, before.reshape(B * L, -1), vocab)
    logprobs = logprobs.reshape(B, L, -1)  # [B, L, V]
    picked = jnp.take_along_axis(logprobs, tokens[..., None], axis=-1)[..., 0]
    return picked, jnp.argmax(logprobs, axis=-1) == tokens


@functools.partial(jax.jit, static_argnames="config")
def prompt_logprobs(
    params: Params,
    prefix: Prefix,
    tokens: jax.Array,
    config: ModelConfig,
    adapters: RowAdapters | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For rows tokens [B, L] (right-padded continuations of `prefix`): the log-probability of
    each token [B, L], and the TOP_LOGPROBS most likely tokens' log-probabilities and ids
    [B, L + 1, TOP_LOGPROBS] at each of the L + 1 positions from the prefix's last token on
    (position i predicts token i; the caller reads a row's positions up to its length; causal
    attention keeps padding out of real tokens). adapters: each row's LoRA adapter, that of
    the prefix's query."""
    B, L = tokens.shape
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((L, L), bool)), (B, L, L))
    hidden, _ = decoder.extend(params, config, prefix, tokens, causal, adapters=adapters)
    first = jnp.broadcast_to(prefix.last_hidden, (B, 1, hidden.shape[-1]))
    before = jnp.concatenate([first, hidden], axis=1)  # [B, L + 1, D]
    vocab = jnp.arange(config.vocab_size)
    logprobs = decoder.label_logprobs(params, config, before.reshape(B * (L + 1), -1), vocab)
    logprobs = logprobs.reshape(B, L + 1, -1)  # [B, L + 1, V]
    picked = jnp.take_along_axis(logprobs[:, :L], tokens[..., None], axis=-1)[..., 0]
    values, ids = jax.lax.top_k(logprobs, TOP_LOGPROBS)
    return picked, values, ids
