"""The packed backends' one jitted step: packed rows of a query and its items through the model,
attention under the segment mask (dense, or the segment kernel's)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tpuscore.backends.packed.packing import NO_SLOT
from tpuscore.kernels import cpu_attention
from tpuscore.kernels.cpu_attention import CpuTiles
from tpuscore.kernels.segment import segment_attention
from tpuscore.kernels.segment.gpu import GpuBlockSizes
from tpuscore.kernels.segment.mask import segment_mask
from tpuscore.kernels.segment.tpu import BlockSizes
from tpuscore.models import decoder
from tpuscore.models.adapters import RowAdapters
from tpuscore.models.attention import NO_WINDOW, attend, within_window
from tpuscore.models.config import ModelConfig
from tpuscore.models.weights import Params
from tpuscore.parallel.sharding import ONE_DEVICE, Layout

SCORE_PACKED = "score_packed"  # its name, as the step table, the shape set and stats give it

# Slots the LM head takes at once on a CPU, where it runs only over the slots items fill: a
# step has slots for its longest rows' items (SGLang's 10 items get 64) and the head over the
# full vocabulary is most of the cost of a slot.
HEAD_SLOTS = 16


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
    block_sizes: BlockSizes | GpuBlockSizes | CpuTiles | None,
    layout: Layout = ONE_DEVICE,
    interpret: bool | None = None,
    adapters: RowAdapters | None = None,
) -> jax.Array:
    """Label logprobs [B, I, C] at positions score_index [B, I] of packed rows [B, T], each row
    with its own query (prefix_len [B], seg_start [B, T]) and labels (label_ids [B, C]). A slot
    whose score_index is `packing.NO_SLOT` is padding: its logprobs are undefined.

    block_sizes None attends through a dense [B, T, T] mask; else through the segment kernel
    whose tiles they are (`BlockSizes`: the TPU kernel; `GpuBlockSizes`: the Triton one;
    `CpuTiles`: the fused CPU kernel, its dots in bfloat16 where `CpuTiles.bf16` asks and the
    CPU has them, or the dense mask where it does not apply), run on each
    device of `layout`'s mesh for its own rows and heads. interpret None runs the kernel
    in Pallas interpret mode where it has no lowering (tests lowering for another platform pass
    False). adapters: each packed row's LoRA adapter (a row holds one query's items), or None.
    """
    B, T = tokens.shape

    def dense(q, k, v, layer):
        mask = segment_mask(prefix_len, seg_start, T)
        window = within_window(positions, positions, layer.window)
        return attend(q, k, v, mask & window, layer)

    if block_sizes is None:
        attention = dense
    elif isinstance(block_sizes, CpuTiles):

        def attention(q, k, v, layer):
            applies = cpu_attention.segment_kernel_applies(q.dtype, layer.softcap)
            bf16 = block_sizes.bf16 and applies and cpu_attention.bf16_dots()
            odd_pairs = (q.dtype == jnp.bfloat16 or bf16) and q.shape[-1] % 2  # pairs need even H
            if not applies or odd_pairs:
                return dense(q, k, v, layer)
            kernel = functools.partial(
                cpu_attention.segment_attention, scale=layer.scale, bf16=bf16
            )
            window = jnp.int32(NO_WINDOW) if layer.window is None else layer.window
            return layout.over_shards(kernel, heads_axis=2)(q, k, v, prefix_len, seg_start, window)

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
            window = jnp.int32(NO_WINDOW) if layer.window is None else layer.window
            o = layout.over_shards(kernel)(q, k, v, prefix_len, seg_start, window)
            return o.swapaxes(1, 2)

    hidden = decoder.forward(params, config, tokens, positions, attention, adapters)
    at = jnp.maximum(score_index, 0)[:, :, None]
    scored = jnp.take_along_axis(hidden, at, axis=1)  # [B, I, D]
    filled = jnp.sum(score_index != NO_SLOT, axis=1)  # [B]: each row's filled slots come first
    return _filled_slots_logprobs(params, config, scored, filled, label_ids, adapters)


def _filled_slots_logprobs(params, config, scored, filled, label_ids, adapters):
    """`decoder.row_label_logprobs` of scored [B, I, D]; on a CPU only over the first
    max(filled) slots, HEAD_SLOTS at a time (the rest of the result is zeros)."""
    B, slots, _ = scored.shape

    def every_slot():
        return decoder.row_label_logprobs(params, config, scored, label_ids, adapters)

    if slots <= HEAD_SLOTS:
        return every_slot()

    def filled_slots():
        def part(j, out):
            start = j * HEAD_SLOTS
            chunk = jax.lax.dynamic_slice_in_dim(scored, start, HEAD_SLOTS, axis=1)
            logprobs = decoder.row_label_logprobs(params, config, chunk, label_ids, adapters)
            return jax.lax.dynamic_update_slice_in_dim(out, logprobs, start, axis=1)

        out = jax.eval_shape(every_slot)
        trips = (jnp.max(filled) + HEAD_SLOTS - 1) // HEAD_SLOTS
        return jax.lax.fori_loop(0, trips, part, jnp.zeros(out.shape, out.dtype))

    # A loop whose trip count is data asks the host each trip on a GPU; TPUs and GPUs have the
    # compute to spare.
    return jax.lax.platform_dependent(cpu=filled_slots, default=every_slot)
