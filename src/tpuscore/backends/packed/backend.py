"""packed_dense and packed_segment: the query and many items in one sequence, one forward pass.

Each chunk of items is packed behind its query (`packing.py`) and runs once: query tokens are
computed once per chunk instead of once per item. Chunks go in the batch axis, one packed row
each, so requests with different queries share a device step (`PackedBackend.schedule`). Items are
isolated by the shared-prefix segment mask, so scores equal serial up to float rounding. The two
backends differ only in how attention applies that mask:

- packed_dense materializes it as a [T, T] mask for XLA attention: simple, O(T^2) memory, so the
  items are split into chunks whose estimated attention memory fits a budget.
- packed_segment runs a Pallas flash-attention kernel that computes the mask per tile from O(T)
  metadata and skips tiles the mask empties: `kernels.segment.tpu` on TPU,
  `kernels.segment.gpu` (Triton) on GPUs. On CPU it runs the TPU kernel in Pallas
  interpret mode: right, but not fast.
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

from tpuscore.api.errors import ValidationError, check_int
from tpuscore.backends import budgets, work
from tpuscore.backends.base import Scoring
from tpuscore.backends.buckets import bucket_count, bucket_tokens, pow2_floor, row_buckets
from tpuscore.backends.budgets import Budgeted
from tpuscore.backends.contract import (
    BackendOutput,
    Plan,
    ScoreBatch,
    ShapeLimits,
    Step,
    StepShape,
    StepTable,
    stack_labels,
    step_table,
)
from tpuscore.backends.packed import memory, packing
from tpuscore.kernels.segment import segment_attention
from tpuscore.kernels.segment.gpu import GpuBlockSizes, tuned_block_sizes
from tpuscore.kernels.segment.mask import segment_mask
from tpuscore.kernels.segment.tpu import BlockSizes
from tpuscore.models import decoder
from tpuscore.models.config import ModelConfig
from tpuscore.models.model import Model
from tpuscore.models.weights import Params
from tpuscore.parallel.sharding import ONE_DEVICE, Layout

logger = logging.getLogger(__name__)

SCORE_PACKED = "score_packed"  # the one step
MAX_PACKED_TOKENS = 16384  # bounds the token buckets a stream of requests can compile
MAX_STEP_TOKENS = 1 << 16  # tokens in all rows of one step: bounds the row counts likewise
# Packed tokens per scored position: a row of T tokens scores up to about T / 12 items (`slots`),
# so its LM head costs a few percent of its layers. Rows of shorter items are padded longer.
SLOT_TOKENS = 12


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
    default on a GPU the swept tiles for its kind (`gpu.tuned_block_sizes`), elsewhere the
    default tiles."""

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
        object.__setattr__(self, "block_sizes", block_sizes)


@functools.partial(jax.jit, static_argnames=("config", "block_sizes", "layout", "interpret"))
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
    layout: Layout = ONE_DEVICE,
    interpret: bool | None = None,
) -> jax.Array:
    """Label logprobs [B, I, C] at positions score_index [B, I] of packed rows [B, T], each row
    with its own query (prefix_len [B], seg_start [B, T]) and labels (label_ids [B, C]).

    block_sizes None attends through a dense [B, T, T] mask; else through the segment kernel
    whose tiles they are (`BlockSizes`: the TPU kernel; `GpuBlockSizes`: the Triton one), run
    on each device of `layout`'s mesh for its own rows and heads. interpret None runs the kernel
    in Pallas interpret mode where it has no lowering (tests lowering for another platform pass
    False).
    """
    B, T = tokens.shape
    if block_sizes is None:
        mask = segment_mask(prefix_len, seg_start, T)

        def attention(q, k, v, layer):
            window = decoder.within_window(positions, positions, layer.window)
            return decoder.attend(q, k, v, mask & window, layer)

    else:

        def attention(q, k, v, layer):  # the kernel wants heads before tokens: [B, N, T, H]
            q, k, v = (x.swapaxes(1, 2) for x in (q, k, v))
            kernel = functools.partial(
                segment_attention,
                scale=layer.scale,
                softcap=layer.softcap,
                block_sizes=block_sizes,
                interpret=interpret,
            )
            window = jnp.int32(decoder.NO_WINDOW) if layer.window is None else layer.window
            o = layout.over_shards(kernel)(q, k, v, prefix_len, seg_start, window)
            return o.swapaxes(1, 2)

    hidden = decoder.forward(params, config, tokens, positions, attention)
    scored = jnp.take_along_axis(hidden, score_index[:, :, None], axis=1)  # [B, I, D]
    return decoder.row_label_logprobs(params, config, scored, label_ids)


@attrs.frozen
class PackedStep:
    """One device step: `chunks` (group, batch rows of that group's items), one packed row each,
    padded to `rows` rows of `length` tokens; `tokens` real tokens per chunk."""

    length: int
    rows: int
    chunks: tuple[tuple[int, np.ndarray], ...]
    tokens: tuple[int, ...]


class PackedBackend(Scoring, Budgeted):
    """What both packed backends share; subclasses say how attention applies the mask."""

    block_sizes: BlockSizes | GpuBlockSizes | None = None
    dense_mask = True
    score_packed = staticmethod(score_packed)  # the jitted step: a seam for tests

    def __init__(self, model: Model, options: PackedOptions):
        self.model = model
        self.activation_bytes = options.activation_bytes or budgets.activation_budget()

    def plan(self, batches: Sequence[ScoreBatch]) -> Plan:
        """The `schedule` of these groups."""
        return Plan(tuple(batches), self.schedule(batches))

    def run(self, plan: Plan) -> list[BackendOutput]:
        batches = plan.batches
        out = BackendOutput.for_groups(batches)
        for step in plan.steps:
            if step.length > self.max_tokens:  # the query and one item, too long to split further
                logger.warning(
                    "packed length %d needs about %d bytes, over the %d-byte budget",
                    step.length,
                    self.memory_bytes(step.length),
                    self.budget,
                )
            groups = [g for g, _ in step.chunks]
            packed = packing.stack(
                [packing.pack(batches[g], rows, step.length) for g, rows in step.chunks],
                step.rows,
                self.slots(step.length),
            )
            labels = stack_labels([batches[g].label_ids for g in groups], step.rows)
            tokens: dict[int, int] = {}
            for g, n in zip(groups, step.tokens, strict=True):
                tokens[g] = tokens.get(g, 0) + n
            out.step(
                SCORE_PACKED,
                (*packed.tokens.shape, packed.score_index.shape[1], labels.shape[1]),
                tokens,
            )
            put = self.model.layout.put_rows
            logprobs = self.score_packed(
                self.model.params,
                put(packed.tokens),
                put(packed.positions),
                put(packed.prefix_len),
                put(packed.seg_start),
                put(packed.score_index),
                put(labels),
                config=self.model.config,
                block_sizes=self.block_sizes,
                layout=self.model.layout,
            )
            for r, (g, rows) in enumerate(step.chunks):
                out.scores(g, rows, logprobs, index=r)
        return out.build()

    def schedule(self, batches: Sequence[ScoreBatch]) -> list[PackedStep]:
        """The device steps that score these groups.

        Each group's items are split, in order, into chunks that fill the longest packed length
        that fits the budget, with no more items than their logits leave room for there
        (`chunk_limits`, `packing.plan`, `slots`); each chunk is one packed row, its query first,
        of `length_for` its tokens and items.
        Rows are taken longest first: a step's length is the token bucket of its longest chunk,
        and it takes as many of the next chunks as fit that length's memory (a power of two of
        rows, the last step padded to one), so chunks of similar length share a step.
        """
        chunks = [
            (g, rows, batch.query_len + int(batch.item_lens[rows].sum()))
            for g, batch in enumerate(batches)
            for rows in packing.plan(batch, self.max_tokens, self.slots(self.max_tokens))
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

    def bucket(self, tokens: int) -> int:
        """The packed length that `tokens` real tokens are padded to."""
        return bucket_tokens(tokens)

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

    def price(self, plan: Plan) -> list[work.StepWork]:
        """What each step of the plan does (for `selection.py`)."""
        config, itemsize = self.model.config, self.model.dtype.itemsize
        batches, steps = plan.batches, []
        for step in plan.steps:
            T = step.length
            chunks = [(g, rows, n) for (g, rows), n in zip(step.chunks, step.tokens, strict=True)]
            if self.block_sizes is None:  # dense: every (token, key) pair, masked or not
                pairs, kv = step.rows * T * T, 0
            else:  # the kernel: its visible tiles, each re-reading a K/V tile
                bq, bkv = self.block_sizes.block_q, self.block_sizes.block_kv
                tiles = sum(
                    work.segment_tiles(
                        packing.pack(batches[g], rows, T).seg_start, batches[g].query_len, bq, bkv
                    )
                    for g, rows, _ in chunks
                )
                tiles += (step.rows - len(chunks)) * (T // bq)  # padding rows: their diagonal
                pairs, kv = tiles * bq * bkv, work.kv_bytes(config, tiles * bkv, itemsize)
            steps.append(
                work.step_work(
                    config,
                    itemsize,
                    rows=step.rows,
                    new=T,
                    pairs=pairs,
                    slots=self.slots(T),
                    peak=self.step_bytes(chunks, T),
                    kv_bytes=kv,
                )
            )
        return steps

    @property
    def steps(self) -> StepTable:
        """Its one step, score_packed (rows, T, slots, C)."""
        return step_table(Step(SCORE_PACKED, self.score_packed, self._packed_zeros))

    def _packed_zeros(self, shape: tuple[int, ...]) -> tuple[tuple, dict]:
        rows, length, slots, width = shape
        zeros = functools.partial(np.zeros, dtype=np.int32)
        inputs = [zeros((rows, length))] * 2 + [zeros(rows), zeros((rows, length))]
        inputs += [zeros((rows, slots)), zeros((rows, width))]
        args = (self.model.params, *map(self.model.layout.put_rows, inputs))
        kwargs = {
            "config": self.model.config,
            "block_sizes": self.block_sizes,
            "layout": self.model.layout,
        }
        return args, kwargs

    def shapes(self, limits: ShapeLimits) -> set[StepShape]:
        """Every step shape this backend can compile for requests within `limits`, on its
        budget as it is: score_packed (rows, T, slots(T), C) for T a packed length up to the
        longest chunk (`max_tokens`, or a query and one item past it), rows a power of two
        within T's budget, C a label bucket (docs/serving.md, "Compiled shapes")."""
        longest = max(self.max_tokens, limits.query_tokens + limits.item_tokens)
        lengths = sorted({self.bucket(n) for n in range(1, longest + 1)})
        return {
            StepShape(SCORE_PACKED, (rows, length, self.slots(length), width))
            for length in lengths
            for rows in row_buckets(1, self.rows(length), self.model.layout.data)
            for width in limits.label_widths()
        }

    def memory_bytes(self, length: int) -> int:
        """Estimated peak memory of one layer at this packed length."""
        return memory.packed_bytes(self.model.config, length, dense_mask=self.dense_mask)


class PackedDenseBackend(PackedBackend):
    """packed_dense: attention under a dense [T, T] mask."""


class PackedSegmentBackend(PackedBackend):
    """packed_segment: attention by the Pallas segment kernel, which never builds the mask."""

    dense_mask = False

    def __init__(self, model: Model, options: PackedSegmentOptions):
        super().__init__(model, options)
        self.block_sizes = options.block_sizes
        if self.block_sizes is None and jax.default_backend() == "gpu":
            kind = jax.devices()[0].device_kind
            self.block_sizes = tuned_block_sizes(kind, model.config.head_dim, model.dtype)
        elif self.block_sizes is None:
            self.block_sizes = BlockSizes()

    def bucket(self, tokens: int) -> int:
        tile = self.block_sizes.tile  # the kernel needs whole tiles
        return -(-bucket_tokens(tokens) // tile) * tile
