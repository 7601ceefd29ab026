"""packed_dense and packed_segment: the query and many items in one sequence, one forward pass.

Each chunk of items is packed behind its query (`packing.py`) and runs once: query tokens are
computed once per chunk instead of once per item. Chunks go in the batch axis, one packed row
each, so requests with different queries share a device step (`PackedBackend.schedule`). Items are
isolated by the shared-prefix segment mask, so scores equal serial up to float rounding. The two
backends differ only in how attention applies that mask:

- packed_dense materializes it as a [T, T] mask for XLA attention: simple, O(T^2) memory, so the
  items are split into chunks whose estimated attention memory fits a budget.
- packed_segment runs a flash-attention kernel that computes the mask per tile from O(T)
  metadata and skips tiles the mask empties: `kernels.segment.tpu` on TPU,
  `kernels.segment.gpu` (Triton) on GPUs, `kernels.cpu_attention`'s fused C++ kernel on CPU
  (where it cannot run, the dense mask). Given the TPU kernel's `BlockSizes` on CPU, it runs
  that in Pallas interpret mode: right, but not fast.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np

from tpuscore.api.errors import ValidationError, check_int
from tpuscore.backends import budgets, work
from tpuscore.backends.base import Scoring
from tpuscore.backends.buckets import CPU_SPLIT_PADDING_TOKENS
from tpuscore.backends.budgets import Budgeted
from tpuscore.backends.contract import BackendOutput, Plan, stack_labels
from tpuscore.backends.packed import packing, steps
from tpuscore.backends.packed.plan import PackedPlanning
from tpuscore.backends.packed.shapes import PackedStepShapes
from tpuscore.backends.packed.steps import SCORE_PACKED
from tpuscore.kernels import cpu_attention
from tpuscore.kernels.cpu_attention import CpuTiles
from tpuscore.kernels.segment.gpu import GpuBlockSizes, tuned_block_sizes
from tpuscore.kernels.segment.tpu import BlockSizes
from tpuscore.models.model import MIXED, Model

# The precisions whose packed_segment attention on a CPU has its dots in bfloat16 (where the
# CPU has AVX-512 BF16): those whose weights are bfloat16.
BFLOAT16_DOTS = frozenset({"bfloat16", MIXED})

logger = logging.getLogger(__name__)
# `split_rows`' threshold on an accelerator: an H100 step's fixed cost (~2.5 ms: launch, input
# copies) is about 1,100 of Qwen3-0.6B's tokens in bfloat16, so padding rows of 2,048 tokens or
# more cost more than one step (the Batcher at SGLang's geometry: 20 rows of 512, padded to 32).
ACCELERATOR_SPLIT_PADDING_TOKENS = 2048


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackedOptions:
    """activation_bytes: the memory budget a chunk's estimate must fit (default 256 MiB on CPU,
    an eighth of accelerator memory). split_padding_tokens: a step whose padding rows would
    hold at least this many tokens runs as steps of power-of-two rows instead (20 rows: 16 + 4
    rather than 32; `buckets.split_rows`; default 128 on CPU, 2048 on accelerators, 0 =
    never)."""

    activation_bytes: int | None = None
    split_padding_tokens: int | None = None

    def __post_init__(self):
        if self.activation_bytes is not None:
            check_int("activation_bytes", self.activation_bytes, minimum=1)
        if self.split_padding_tokens is not None:
            check_int("split_padding_tokens", self.split_padding_tokens, minimum=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackedSegmentOptions(PackedOptions):
    """As packed_dense's, and block_sizes: the kernel's tiles. On a GPU a `GpuBlockSizes` (the
    Triton kernel's), elsewhere a `BlockSizes` (the TPU kernel's; on CPU, run in interpret
    mode), or a dict of its fields; default on a GPU the swept tiles for its kind
    (`gpu.tuned_block_sizes`), on CPU the fused C++ kernel's, on TPU the default tiles."""

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


class PackedBackend(PackedPlanning, PackedStepShapes, Scoring, Budgeted):
    """What both packed backends share; subclasses say how attention applies the mask."""

    block_sizes: BlockSizes | GpuBlockSizes | CpuTiles | None = None
    dense_mask = True
    score_packed = staticmethod(steps.score_packed)  # the jitted step: a seam for tests

    @property
    def interpret(self) -> bool | None:
        """Whether the segment kernel runs in Pallas interpret mode: where the model runs (its
        platform, resolved once) is not the platform the tiles are for. None without the kernel."""
        if self.block_sizes is None:
            return None
        if isinstance(self.block_sizes, CpuTiles):
            return False
        return self.model.platform != (
            "gpu" if isinstance(self.block_sizes, GpuBlockSizes) else "tpu"
        )

    def __init__(self, model: Model, options: PackedOptions):
        self.model = model
        self.activation_bytes = options.activation_bytes or budgets.activation_budget()
        split = options.split_padding_tokens
        if split is None:
            split = (
                CPU_SPLIT_PADDING_TOKENS
                if model.platform == "cpu"
                else ACCELERATOR_SPLIT_PADDING_TOKENS
            )
        self.split_padding_tokens = split

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
            row_adapters = np.zeros(step.rows, np.int32)  # padding rows: none
            row_adapters[: len(groups)] = [batches[g].adapter for g in groups]
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
                interpret=self.interpret,
                adapters=self.model.row_adapters(row_adapters),
            )
            for r, (g, rows) in enumerate(step.chunks):
                out.scores(g, rows, logprobs, index=r)
        return out.build()

    def price(self, plan: Plan) -> list[work.StepWork]:
        """What each step of the plan does (for `selection.py`)."""
        config, itemsize = self.model.config, self.model.dtype.itemsize
        batches, steps = plan.batches, []
        for step in plan.steps:
            T = step.length
            chunks = [(g, rows, n) for (g, rows), n in zip(step.chunks, step.tokens, strict=True)]
            if self.dense_mask:  # every (token, key) pair, masked or not
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


class PackedDenseBackend(PackedBackend):
    """packed_dense: attention under a dense [T, T] mask."""


class PackedSegmentBackend(PackedBackend):
    """packed_segment: attention by a segment kernel, which never builds the mask: Pallas on TPU
    and GPU, the fused C++ kernel on CPU (`kernels.cpu_attention`; the dense mask where that
    cannot run: no AVX-512, bfloat16 attention without AVX-512 BF16, or a soft-cap)."""

    @property
    def dense_mask(self) -> bool:
        """Whether attention builds the [T, T] mask: on CPU where the fused kernel cannot run
        (asked when planning, so a backend is built without building the kernel)."""
        if isinstance(self.block_sizes, CpuTiles):
            softcap = self.model.config.attn_logit_softcap
            return not cpu_attention.segment_kernel_applies(self.model.dtype, softcap)
        return self.block_sizes is None

    def __init__(self, model: Model, options: PackedSegmentOptions):
        super().__init__(model, options)
        self.block_sizes = options.block_sizes
        if self.block_sizes is None and model.platform == "gpu":
            kind = jax.devices()[0].device_kind
            self.block_sizes = tuned_block_sizes(kind, model.config.head_dim, model.dtype)
        elif self.block_sizes is None and model.platform == "cpu":
            # The fused CPU kernel where its scores apply (its dots in bfloat16 for the
            # precisions whose weights are: docs/runtime.md#precision), else the dense mask.
            if model.config.attn_logit_softcap is None:
                self.block_sizes = CpuTiles(bf16=model.precision in BFLOAT16_DOTS)
        elif self.block_sizes is None:
            self.block_sizes = BlockSizes()

    def bucket(self, tokens: int) -> int:
        tile = 1 if self.block_sizes is None else self.block_sizes.tile  # the kernel's whole tiles
        return -(-super().bucket(tokens) // tile) * tile
