"""packed_dense and packed_segment: the query and many items in one sequence, one forward pass.

Each chunk of items is packed behind the query (`packing.py`) and runs once: query tokens are
computed once per chunk instead of once per item. Items are isolated by the shared-prefix segment
mask, so scores equal serial up to float rounding. The two backends differ only in how attention
applies that mask:

- packed_dense materializes it as a [T, T] mask for XLA attention: simple, O(T^2) memory, so the
  items are split into chunks whose estimated attention memory fits a budget.
- packed_segment runs `kernels.segment_attention`, a Pallas flash-attention kernel that computes
  the mask per tile from O(T) metadata and skips tiles the mask empties. Off TPU it runs in Pallas
  interpret mode: right, but not fast.
"""

from __future__ import annotations

import functools
import logging

import jax
import numpy as np

from tpuscore import packing
from tpuscore.batching import BackendOutput, ScoreBatch, bucket_tokens
from tpuscore.kernels.segment_attention import BlockSizes, segment_attention, segment_mask
from tpuscore.memory import activation_budget, activation_bytes_per_token
from tpuscore.models import decoder
from tpuscore.models.config import ModelConfig
from tpuscore.models.weights import Params

logger = logging.getLogger(__name__)

MAX_PACKED_TOKENS = 16384  # bounds the token buckets a stream of requests can compile


@functools.partial(jax.jit, static_argnames=("config", "block_sizes"))
def score_packed(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    prefix_len: jax.Array,
    seg_start: jax.Array,
    score_index: jax.Array,
    label_ids: jax.Array,
    config: ModelConfig,
    block_sizes: BlockSizes | None,
) -> jax.Array:
    """Label logprobs [I, C] at positions score_index [I] of one packed sequence [T].

    block_sizes None attends through a dense [T, T] mask; else through the segment kernel.
    """
    T = tokens.shape[0]
    prefix_len, seg_start = prefix_len[None], seg_start[None]
    if block_sizes is None:
        attention = functools.partial(decoder.attend, mask=segment_mask(prefix_len, seg_start, T))
    else:

        def attention(q, k, v):  # the kernel wants heads before tokens: [B, N, T, H]
            q, k, v = (x.swapaxes(1, 2) for x in (q, k, v))
            o = segment_attention(q, k, v, prefix_len, seg_start, block_sizes=block_sizes)
            return o.swapaxes(1, 2)

    hidden = decoder.forward(params, config, tokens[None], positions[None], attention)
    return decoder.label_logprobs(params, config, hidden[0, score_index], label_ids)


class PackedBackend:
    """What both packed backends share. Option activation_bytes: the memory budget that a chunk's
    estimate must fit (default 256 MiB on CPU, an eighth of accelerator memory)."""

    supports_item_first = False  # the query must come first to be a shared prefix
    block_sizes: BlockSizes | None = None

    def __init__(self, config: ModelConfig, params: Params, *, activation_bytes: int | None = None):
        self.config = config
        self.params = params
        self.activation_bytes = activation_bytes or activation_budget()

    def score(self, batch: ScoreBatch) -> BackendOutput:
        logprobs = np.zeros((batch.items.shape[0], batch.label_ids.shape[0]), np.float32)
        num_tokens = 0
        # Chunks fill the longest bucket that fits the budget: only the last one pads much.
        chunks = list(packing.plan(batch, self.max_tokens))
        logger.debug("%d items in %d packed chunks", batch.num_items, len(chunks))
        for items in chunks:
            real = batch.query_len + int(batch.item_lens[items].sum())
            length = self.bucket(real)
            if length > self.max_tokens:  # the query and one item, too long to split further
                logger.warning(
                    "packed length %d needs about %d bytes, over the %d-byte budget",
                    length, self.memory_bytes(length), self.activation_bytes,
                )  # fmt: skip
            chunk = packing.pack(batch, items, length)
            out = score_packed(
                self.params,
                chunk.tokens,
                chunk.positions,
                np.int32(chunk.prefix_len),
                chunk.seg_start,
                chunk.score_index,
                batch.label_ids,
                config=self.config,
                block_sizes=self.block_sizes,
            )
            logprobs[items] = np.asarray(out)[: len(items)]
            num_tokens += real
        valid = np.arange(logprobs.shape[0]) < batch.num_items
        return BackendOutput(logprobs, valid, num_tokens=num_tokens)

    def bucket(self, tokens: int) -> int:
        """The packed length that `tokens` real tokens are padded to."""
        return bucket_tokens(tokens)

    @functools.cached_property
    def max_tokens(self) -> int:
        """The longest packed length (a bucket) whose memory estimate fits the budget."""
        fits, length = self.bucket(1), self.bucket(1)
        while length <= MAX_PACKED_TOKENS and self.memory_bytes(length) <= self.activation_bytes:
            fits, length = length, self.bucket(length + 1)
        return fits

    def memory_bytes(self, length: int) -> int:
        """Estimated peak memory of one layer at this packed length, in float32: activations."""
        return length * activation_bytes_per_token(self.config)


class PackedDenseBackend(PackedBackend):
    """packed_dense: attention under a dense [T, T] mask. Option activation_bytes: the memory
    budget that a chunk's estimate must fit (default 256 MiB on CPU, an eighth of accelerator
    memory)."""

    def memory_bytes(self, length: int) -> int:
        # Plus the [T, T] mask and per head the float32 scores, exp weights and their cast.
        attention = length * length * (1 + 12 * self.config.num_heads)
        return super().memory_bytes(length) + attention


class PackedSegmentBackend(PackedBackend):
    """packed_segment: attention by the Pallas segment kernel. Options activation_bytes (as
    packed_dense's) and block_sizes (the kernel's tiles: a `BlockSizes` or a dict of its fields)."""

    def __init__(self, config, params, *, block_sizes=None, activation_bytes=None):
        super().__init__(config, params, activation_bytes=activation_bytes)
        if isinstance(block_sizes, dict):
            block_sizes = BlockSizes(**block_sizes)
        if not isinstance(block_sizes, BlockSizes | None):
            raise TypeError(f"block_sizes must be a BlockSizes or a dict, got {block_sizes!r}")
        self.block_sizes = block_sizes or BlockSizes()

    def bucket(self, tokens: int) -> int:
        tile = self.block_sizes.tile  # the kernel needs whole tiles
        return -(-bucket_tokens(tokens) // tile) * tile
