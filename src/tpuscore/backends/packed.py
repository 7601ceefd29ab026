"""packed_dense and packed_segment: the query and many items in one sequence, one forward pass.

Each chunk of items is packed behind the query (`packing.py`) and runs once: query tokens are
computed once per chunk instead of once per item. Items are isolated by the shared-prefix segment
mask, so scores equal serial up to float rounding. The two backends differ only in how attention
applies that mask:

- packed_dense materializes it as a [T, T] mask for XLA attention: simple, O(T^2) memory, so the
  items are split into chunks whose estimated attention memory fits a budget.
- packed_segment runs a Pallas flash-attention kernel that computes the mask per tile from O(T)
  metadata and skips tiles the mask empties: `kernels.segment_attention` on TPU,
  `kernels.segment_attention_gpu` (Triton) on GPUs. On CPU it runs the TPU kernel in Pallas
  interpret mode: right, but not fast.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import numpy as np

from tpuscore import costs, packing
from tpuscore.backends.contract import BackendOutput, ScoreBatch
from tpuscore.buckets import bucket_tokens
from tpuscore.errors import ValidationError, check_int
from tpuscore.kernels.segment_attention import BlockSizes, segment_attention, segment_mask
from tpuscore.kernels.segment_attention_gpu import GpuBlockSizes, segment_attention_gpu
from tpuscore.models import decoder
from tpuscore.models.config import ModelConfig
from tpuscore.models.model import Model
from tpuscore.models.weights import Params

logger = logging.getLogger(__name__)

MAX_PACKED_TOKENS = 16384  # bounds the token buckets a stream of requests can compile


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackedOptions:
    """activation_bytes: the memory budget a chunk's estimate must fit (default 256 MiB on CPU,
    an eighth of accelerator memory)."""

    activation_bytes: int | None = None

    def __post_init__(self):
        if self.activation_bytes is not None:
            check_int("activation_bytes", self.activation_bytes, minimum=1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackedSegmentOptions(PackedOptions):
    """As packed_dense's, and block_sizes: the kernel's tiles. On a GPU a `GpuBlockSizes` (the
    Triton kernel's), elsewhere a `BlockSizes` (the TPU kernel's), or a dict of its fields;
    default the platform's default tiles."""

    block_sizes: BlockSizes | GpuBlockSizes | None = None

    def __post_init__(self):
        super().__post_init__()
        block_sizes = self.block_sizes
        kind = GpuBlockSizes if jax.default_backend() == "gpu" else BlockSizes
        try:
            if isinstance(block_sizes, dict):
                block_sizes = kind(**block_sizes)
        except (TypeError, ValueError) as e:
            raise ValidationError(
                "invalid_backend_option", f"block_sizes: {e}", "block_sizes"
            ) from None
        if not isinstance(block_sizes, kind | None):
            raise ValidationError(
                "invalid_backend_option",
                f"block_sizes must be a {kind.__name__} on {jax.default_backend()} or a dict of "
                f"its fields, got {block_sizes!r}",
                "block_sizes",
            )
        object.__setattr__(self, "block_sizes", block_sizes or kind())


@functools.partial(jax.jit, static_argnames=("config", "block_sizes", "interpret"))
def score_packed(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    prefix_len: jax.Array,
    seg_start: jax.Array,
    score_index: jax.Array,
    label_ids: jax.Array,
    config: ModelConfig,
    block_sizes: BlockSizes | GpuBlockSizes | None,
    interpret: bool | None = None,
) -> jax.Array:
    """Label logprobs [I, C] at positions score_index [I] of one packed sequence [T].

    block_sizes None attends through a dense [T, T] mask; else through the segment kernel whose
    tiles they are (`BlockSizes`: the TPU kernel; `GpuBlockSizes`: the Triton one). interpret
    None runs the kernel in Pallas interpret mode where it has no lowering (tests lowering for
    another platform pass False).
    """
    T = tokens.shape[0]
    prefix_len, seg_start = prefix_len[None], seg_start[None]
    if block_sizes is None:
        attention = functools.partial(decoder.attend, mask=segment_mask(prefix_len, seg_start, T))
    else:

        def attention(q, k, v):  # the kernel wants heads before tokens: [B, N, T, H]
            q, k, v = (x.swapaxes(1, 2) for x in (q, k, v))
            gpu = isinstance(block_sizes, GpuBlockSizes)
            kernel = segment_attention_gpu if gpu else segment_attention
            o = kernel(q, k, v, prefix_len, seg_start, block_sizes=block_sizes, interpret=interpret)
            return o.swapaxes(1, 2)

    hidden = decoder.forward(params, config, tokens[None], positions[None], attention)
    return decoder.label_logprobs(params, config, hidden[0, score_index], label_ids)


class PackedBackend:
    """What both packed backends share; subclasses say how attention applies the mask."""

    block_sizes: BlockSizes | GpuBlockSizes | None = None
    dense_mask = True

    def __init__(self, model: Model, options: PackedOptions):
        self.model = model
        self.activation_bytes = options.activation_bytes or costs.activation_budget()

    def score(self, batch: ScoreBatch) -> BackendOutput:
        out = BackendOutput.for_batch(batch)
        # Chunks fill the longest bucket that fits the budget: only the last one pads much.
        for rows in packing.plan(batch, self.max_tokens):
            real = batch.query_len + int(batch.item_lens[rows].sum())
            length = self.bucket(real)
            if length > self.max_tokens:  # the query and one item, too long to split further
                logger.warning(
                    "packed length %d needs about %d bytes, over the %d-byte budget",
                    length, self.memory_bytes(length), self.activation_bytes,
                )  # fmt: skip
            chunk = packing.pack(batch, rows, length)
            shape = (length, len(chunk.score_index), len(batch.label_ids))
            out.step("score_packed", shape, real)
            out.scores(
                rows,
                score_packed(
                    self.model.params,
                    chunk.tokens,
                    chunk.positions,
                    np.int32(chunk.prefix_len),
                    chunk.seg_start,
                    chunk.score_index,
                    batch.label_ids,
                    config=self.model.config,
                    block_sizes=self.block_sizes,
                ),
            )
        return out.build()

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
        """Estimated peak memory of one layer at this packed length."""
        return costs.packed_bytes(self.model.config, length, dense_mask=self.dense_mask)


class PackedDenseBackend(PackedBackend):
    """packed_dense: attention under a dense [T, T] mask."""


class PackedSegmentBackend(PackedBackend):
    """packed_segment: attention by the Pallas segment kernel, which never builds the mask."""

    dense_mask = False

    def __init__(self, model: Model, options: PackedSegmentOptions):
        super().__init__(model, options)
        self.block_sizes = options.block_sizes

    def bucket(self, tokens: int) -> int:
        tile = self.block_sizes.tile  # the kernel needs whole tiles
        return -(-bucket_tokens(tokens) // tile) * tile
