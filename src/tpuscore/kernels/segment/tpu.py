"""Shared-prefix segment attention: a Pallas flash-attention kernel whose mask is procedural.

The mask rule (`mask.py`, with pictures): row r sees key c when c <= r and (c < prefix_len or
c >= seg_start[r]), so every item sees the whole query plus, causally, only itself; on a
sliding-window layer, only the keys within the row's last `window` positions of that.

The mask is computed inside the kernel from O(T) metadata and never materialized. Tiles with no
visible key are skipped: no compute, and on TPU no copy, because the K/V index map repeats the
block index of the previous grid step for them (Pallas copies a block only when its index
changes); tiles wholly outside a window are skipped the same way.
`mask.segment_attention_reference` is the same function in plain jnp: the test oracle.
`tpuscore.kernels.segment.segment_attention` runs this kernel for `BlockSizes` tiles.

Axis letters as in `mask.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpuscore.kernels.segment import mask

NUM_LANES = 128  # TPU vector lane count: the minor block dimension
NUM_SUBLANES = 8  # the second-minor one


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes: block_q query rows per tile (times the G query heads of one kv head), block_kv
    keys per tile. TPU layout wants block_q a multiple of 8 and block_kv a multiple of 128."""

    block_q: int = 128
    block_kv: int = 128

    def __post_init__(self):
        for name, multiple in (("block_q", NUM_SUBLANES), ("block_kv", NUM_LANES)):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value % multiple:
                raise ValueError(f"{name} must be a positive multiple of {multiple}, got {value!r}")

    @property
    def tile(self) -> int:
        """The sequence length must be a multiple of this."""
        return math.lcm(self.block_q, self.block_kv)


def _tile_visible(i, j, prefix_len, first_key, first_pos, window, block_q: int, block_kv: int):
    """Whether kv tile j holds any key that a row of query tile i may see."""
    p_lo, p_hi, s_lo, s_hi = mask.visible_blocks(
        i, prefix_len, first_key, first_pos, window, block_q, block_kv
    )
    return (j <= s_hi) & (((p_lo <= j) & (j < p_hi)) | (s_lo <= j))


def _kv_index_map(
    b, kv_head, i, j, prefix_len_ref, first_key_ref, first_pos_ref, window_ref, *, block_q, block_kv
):
    """The kv block to fetch at grid step (i, j). A skipped tile fetches a block that a neighbouring
    step fetches anyway, so the pipeline issues no copy for it."""
    p_lo, p_hi, s_lo, s_hi = mask.visible_blocks(
        i, prefix_len_ref[b], first_key_ref[b, i], first_pos_ref[b, i], window_ref[0],
        block_q, block_kv,
    )  # fmt: skip
    block = jnp.where(j < p_hi, jnp.maximum(j, p_lo), jnp.clip(j, s_lo, s_hi))
    return b, kv_head, block, 0


def _kernel(
    prefix_len_ref,  # scalar prefetch: [B]
    first_key_ref,  # scalar prefetch: [B, T / block_q]
    first_pos_ref,  # scalar prefetch: [B, T / block_q]
    window_ref,  # scalar prefetch: [1]
    seg_start_ref,  # [block_q, NUM_LANES], lane-broadcast
    q_ref,  # [G, block_q, H]
    k_ref,  # [block_kv, H]
    v_ref,  # [block_kv, H]
    o_ref,  # [G, block_q, H]
    *rest,  # tiles_ref [NUM_SUBLANES, NUM_LANES] when counting, then the scratch
    scale: float,
    softcap: float | None,
    count_tiles: bool,
):
    tiles_ref, (m_ref, l_ref, acc_ref) = (rest[0], rest[1:]) if count_tiles else (None, rest)
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    G, block_q, H = q_ref.shape
    block_kv = k_ref.shape[0]
    prefix_len, window = prefix_len_ref[b], window_ref[0]

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, mask.MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        if count_tiles:
            tiles_ref[...] = jnp.zeros(tiles_ref.shape, jnp.int32)

    visible = _tile_visible(
        i, j, prefix_len, first_key_ref[b, i], first_pos_ref[b, i], window, block_q, block_kv
    )

    @pl.when(visible)
    def _compute():
        precision = jax.lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None
        q = q_ref[...].reshape(G * block_q, H)  # all G heads of this kv head in one matmul
        k, v = k_ref[...], v_ref[...]
        s = jax.lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
        s = mask.soft_cap(s * scale, softcap)  # [G * block_q, block_kv]
        shape = (block_q, block_kv)
        rows = i * block_q + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
        cols = j * block_kv + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
        seg_start = jnp.tile(seg_start_ref[...], (1, block_kv // NUM_LANES))
        pos = rows - jnp.maximum(seg_start - prefix_len, 0)
        in_prefix = (cols < prefix_len) & (cols > pos - window)
        in_segment = (cols >= seg_start) & (cols > rows - window)
        visible = (cols <= rows) & (in_prefix | in_segment)
        visible = jnp.tile(visible, (G, 1))
        s = jnp.where(visible, s, mask.MASK_VALUE)

        m_prev, l_prev = m_ref[...], l_ref[...]  # [G * block_q, NUM_LANES], lane-broadcast
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
        p = jnp.where(visible, jnp.exp(s - m_next[:, :1]), 0.0)
        alpha = jnp.exp(m_prev - m_next)
        m_ref[...] = m_next
        l_ref[...] = alpha * l_prev + jnp.sum(p, axis=-1, keepdims=True)
        pv = jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
            preferred_element_type=jnp.float32,
        )  # fmt: skip
        acc_ref[...] = alpha[:, :1] * acc_ref[...] + pv
        if count_tiles:
            tiles_ref[...] += 1

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        # Every row sees at least its own key, so l > 0.
        o = acc_ref[...] / l_ref[...][:, :1]
        o_ref[...] = o.reshape(G, block_q, H).astype(o_ref.dtype)


@functools.partial(
    jax.jit, static_argnames=("block_sizes", "interpret", "count_tiles", "scale", "softcap")
)
def attention(
    q, k, v, prefix_len, seg_start, window, block_sizes, interpret, count_tiles, scale, softcap
):
    """`segment_attention` on TPU tiles: the output, and with count_tiles the tiles computed."""
    B, N, T, H = q.shape
    K = k.shape[1]
    G = N // K
    bq, bkv = block_sizes.block_q, block_sizes.block_kv
    prefix_len = prefix_len.astype(jnp.int32)
    seg_start = seg_start.astype(jnp.int32)
    first_key = mask.first_segment_key(seg_start, bq)
    first_pos = mask.first_position(prefix_len, seg_start, bq)
    window = jnp.full((1,), mask.NO_WINDOW if window is None else window, jnp.int32)
    lanes = jnp.broadcast_to(seg_start[:, :, None], (B, T, NUM_LANES))

    kv_map = functools.partial(_kv_index_map, block_q=bq, block_kv=bkv)
    in_specs = [
        pl.BlockSpec((None, bq, NUM_LANES), lambda b, h, i, j, *_: (b, i, 0)),
        pl.BlockSpec((None, None, G, bq, H), lambda b, h, i, j, *_: (b, h, 0, i, 0)),
        pl.BlockSpec((None, None, bkv, H), kv_map),
        pl.BlockSpec((None, None, bkv, H), kv_map),
    ]
    out_specs = [pl.BlockSpec((None, None, G, bq, H), lambda b, h, i, j, *_: (b, h, 0, i, 0))]
    out_shape = [jax.ShapeDtypeStruct((B, K, G, T, H), q.dtype)]
    if count_tiles:
        tile_block = (None, None, None, NUM_SUBLANES, NUM_LANES)
        out_specs.append(pl.BlockSpec(tile_block, lambda b, h, i, j, *_: (b, h, i, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((B, K, T // bq, NUM_SUBLANES, NUM_LANES), jnp.int32))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(B, K, T // bq, T // bkv),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[
            pltpu.VMEM((G * bq, NUM_LANES), jnp.float32),  # running max
            pltpu.VMEM((G * bq, NUM_LANES), jnp.float32),  # running exp sum
            pltpu.VMEM((G * bq, H), jnp.float32),  # running weighted values
        ],
    )
    scale = H**-0.5 if scale is None else scale
    kernel = functools.partial(_kernel, scale=scale, softcap=softcap, count_tiles=count_tiles)
    outs = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
    )(prefix_len, first_key, first_pos, window, lanes, q.reshape(B, K, G, T, H), k, v)
    o = outs[0].reshape(B, N, T, H)
    return (o, outs[1][..., 0, 0].sum()) if count_tiles else o
