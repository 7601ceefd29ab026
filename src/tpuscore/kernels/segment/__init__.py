"""The segment (shared-prefix) attention kernel: the mask rule, its jnp reference and the input
checks (`mask.py`), a Pallas TPU kernel (`tpu.py`) and its Triton GPU twin (`gpu.py`), behind one
entry point: the tile type picks the kernel."""

from __future__ import annotations

import jax

from tpuscore.kernels.segment import gpu, mask, tpu
from tpuscore.kernels.segment.gpu import GpuBlockSizes
from tpuscore.kernels.segment.tpu import BlockSizes

Tiles = BlockSizes | GpuBlockSizes
TPU_TILES = BlockSizes()  # the default: the TPU kernel's tiles


def segment_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    prefix_len: jax.Array,
    seg_start: jax.Array,
    window: jax.Array | None = None,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    block_sizes: Tiles = TPU_TILES,
    interpret: bool | None = None,
) -> jax.Array:
    """Attention [B, N, T, H] of q [B, N, T, H] to k/v [B, K, T, H] under the shared-prefix segment
    mask given by prefix_len [B] and seg_start [B, T], cut to `window` (an int32 scalar, may be
    traced; None: no window) as `mask.py` draws it.

    Scores are scaled by `scale` (default H ** -0.5) and soft-capped as tanh(s / softcap) *
    softcap where softcap is given. Every row must see at least one key (seg_start[r] <= r holds
    that). T must be a multiple of both block sizes. `BlockSizes` runs the TPU kernel (Pallas,
    Mosaic), `GpuBlockSizes` the GPU one (Pallas on Triton); interpret defaults to True off the
    kernel's platform, where its lowering is missing.
    """
    inputs = _checked(q, k, v, prefix_len, seg_start, window, block_sizes, interpret)
    if isinstance(block_sizes, GpuBlockSizes):
        return gpu.attention(*inputs, scale, softcap)[0]
    return tpu.attention(*inputs, False, scale, softcap)


def executed_tiles(
    q, k, v, prefix_len, seg_start, window=None, *, block_sizes: Tiles = TPU_TILES, interpret=None
) -> int:
    """How many (query tile, kv tile) steps the kernel computed, over all batches and kv heads."""
    inputs = _checked(q, k, v, prefix_len, seg_start, window, block_sizes, interpret)
    if isinstance(block_sizes, GpuBlockSizes):
        return int(gpu.attention(*inputs, None, None)[1])
    return int(tpu.attention(*inputs, True, None, None)[1])


def _checked(q, k, v, prefix_len, seg_start, window, block_sizes, interpret):
    """The kernel's inputs once their shapes agree (`mask.check_shapes`), interpret defaulting to
    True off the tiles' platform, where the kernel has no lowering."""
    mask.check_shapes(q, k, v, prefix_len, seg_start, block_sizes)
    if interpret is None:
        platform = "gpu" if isinstance(block_sizes, GpuBlockSizes) else "tpu"
        interpret = jax.default_backend() != platform
    return q, k, v, prefix_len, seg_start, window, block_sizes, interpret
