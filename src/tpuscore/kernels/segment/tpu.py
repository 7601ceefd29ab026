"""Shared-prefix segment attention: a Pallas flash-attention kernel whose mask is procedural.

A packed sequence holds a shared prefix (the query) followed by independent segments (the items).
Row r may attend to key c when

    c <= r  and  (c < prefix_len  or  c >= seg_start[r])

so the query is causal, and every item sees the whole query plus, causally, only itself. With
prefix_len 2, segments [2, 4) and [4, 6), and row 6 padding (its own segment):

    row  seg_start  keys 0123456
     0       0           x......
     1       0           xx.....
     2       2           xxx....
     3       2           xxxx...
     4       4           xx..x..
     5       4           xx..xx.
     6       6           xx....x

On a sliding-window layer (window w), a row sees only keys within its last w positions. A query
row r sits at position r; an item row at prefix_len + its offset in the item, so

    pos(r) = r - max(seg_start[r] - prefix_len, 0)

and the rule gains: a query key c needs c > pos(r) - w, a key of the row's own item c > r - w.
With the layout above and w = 2:

    row  pos   keys 0123456
     0    0         x......
     1    1         xx.....
     2    2         .xx....
     3    3         ..xx...        its own item only: the query is out of reach
     4    2         .x..x..        the query's last key (2 - 1 < 2) and itself
     5    3         ....xx.
     6    2         .x....x        (padding)

The mask is computed inside the kernel from O(T) metadata and never materialized. Tiles with no
visible key are skipped: no compute, and on TPU no copy, because the K/V index map repeats the
block index of the previous grid step for them (Pallas copies a block only when its index
changes). `segment_attention_reference` is the same function in plain jnp: the test oracle.

Axis letters: B batch, T tokens, N query heads, K kv heads, G = N/K, H head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

NUM_LANES = 128  # TPU vector lane count: the minor block dimension
NUM_SUBLANES = 8  # the second-minor one
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: exp(MASK - MASK) stays 1, not NaN


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


NO_WINDOW = jnp.iinfo(jnp.int32).max  # every earlier key


def segment_positions(prefix_len: jax.Array, seg_start: jax.Array) -> jax.Array:
    """Each row's token position [B, T]: its index in the query, prefix_len + its offset in an
    item (padding rows: prefix_len)."""
    rows = jnp.arange(seg_start.shape[1])[None, :]
    return rows - jnp.maximum(seg_start - prefix_len[:, None], 0)


def segment_mask(
    prefix_len: jax.Array, seg_start: jax.Array, num_keys: int, window: jax.Array | None = None
) -> jax.Array:
    """The dense mask [B, T, S] that the kernel computes tile by tile; window: the sliding
    window (an int32 scalar), None for none."""
    rows = jnp.arange(seg_start.shape[1])[None, :, None]
    cols = jnp.arange(num_keys)[None, None, :]
    in_prefix = cols < prefix_len[:, None, None]
    in_segment = cols >= seg_start[:, :, None]
    if window is not None:
        pos = segment_positions(prefix_len, seg_start)[:, :, None]
        in_prefix = in_prefix & (cols > pos - window)
        in_segment = in_segment & (cols > rows - window)
    return (cols <= rows) & (in_prefix | in_segment)


def _softcap(scores: jax.Array, softcap: float | None) -> jax.Array:
    return scores if softcap is None else jnp.tanh(scores / softcap) * softcap


def segment_attention_reference(
    q, k, v, prefix_len, seg_start, window=None, *, scale=None, softcap=None
):
    """Softmax attention under `segment_mask`, in float32. Shapes and arguments as
    `segment_attention`."""
    B, N, T, H = q.shape
    K = k.shape[1]
    qg = q.reshape(B, K, N // K, T, H).astype(jnp.float32)
    hp = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("bkgth,bksh->bkgts", qg, k.astype(jnp.float32), precision=hp)
    scores = _softcap(scores * (H**-0.5 if scale is None else scale), softcap)
    mask = segment_mask(prefix_len, seg_start, T, window)[:, None, None]
    weights = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    o = jnp.einsum("bkgts,bksh->bkgth", weights, v.astype(jnp.float32), precision=hp)
    return o.reshape(B, N, T, H).astype(q.dtype)


def _check_shapes(q, k, v, prefix_len, seg_start, block_sizes: BlockSizes) -> None:
    if q.ndim != 4:
        raise ValueError(f"q must be [batch, heads, tokens, head_dim], got shape {q.shape}")
    B, N, T, H = q.shape
    for name, x in (("k", k), ("v", v)):
        if x.ndim != 4 or (x.shape[0], x.shape[2], x.shape[3]) != (B, T, H):
            raise ValueError(
                f"{name} must be [batch={B}, kv_heads, tokens={T}, head_dim={H}], got {x.shape}"
            )
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v kv_heads differ: {k.shape[1]} != {v.shape[1]}")
    if N % k.shape[1]:
        raise ValueError(f"heads={N} must be a multiple of kv_heads={k.shape[1]}")
    if prefix_len.shape != (B,):
        raise ValueError(f"prefix_len must be [batch={B}], got shape {prefix_len.shape}")
    if seg_start.shape != (B, T):
        raise ValueError(f"seg_start must be [batch={B}, tokens={T}], got {seg_start.shape}")
    for name, block in (("block_q", block_sizes.block_q), ("block_kv", block_sizes.block_kv)):
        if T % block:
            raise ValueError(f"tokens={T} must be a multiple of {name}={block}")


def _first_segment_key(seg_start: jax.Array, block_q: int) -> jax.Array:
    """Per query tile [B, T / block_q]: the smallest segment start among its rows. Segments are
    contiguous, so the tile's rows see keys [0, prefix_len) and [this, last row], no others."""
    B, T = seg_start.shape
    return seg_start.reshape(B, T // block_q, block_q).min(axis=-1)


def _first_position(prefix_len: jax.Array, seg_start: jax.Array, block_q: int) -> jax.Array:
    """Per query tile [B, T / block_q]: the smallest position among its rows, which bounds the
    first query key any of them sees through a window (pos - window)."""
    B, T = seg_start.shape
    pos = segment_positions(prefix_len, seg_start)
    return pos.reshape(B, T // block_q, block_q).min(axis=-1)


def _visible_blocks(i, prefix_len, first_key, first_pos, window, block_q: int, block_kv: int):
    """The kv blocks query tile i may see: (lo, hi) of the query's keys, [lo, hi) (the blocks of
    [max(0, first_pos - window + 1), prefix_len)), and (lo, hi) of its items' keys, [lo, hi]
    (the blocks of [max(first_key, first row - window + 1), last row])."""
    first_row, last_row = i * block_q, (i + 1) * block_q - 1
    first_query_key = jnp.maximum(first_pos - window + 1, 0)
    prefix_hi = jnp.where(first_query_key < prefix_len, pl.cdiv(prefix_len, block_kv), 0)
    prefix_lo = jnp.minimum(first_query_key // block_kv, prefix_hi)
    segment_lo = jnp.maximum(first_key, jnp.maximum(first_row - window + 1, 0)) // block_kv
    return prefix_lo, prefix_hi, segment_lo, last_row // block_kv


def _tile_visible(i, j, prefix_len, first_key, first_pos, window, block_q: int, block_kv: int):
    """Whether kv tile j holds any key that a row of query tile i may see."""
    p_lo, p_hi, s_lo, s_hi = _visible_blocks(
        i, prefix_len, first_key, first_pos, window, block_q, block_kv
    )
    return (j <= s_hi) & (((p_lo <= j) & (j < p_hi)) | (s_lo <= j))


def _kv_index_map(
    b, kv_head, i, j, prefix_len_ref, first_key_ref, first_pos_ref, window_ref, *, block_q, block_kv
):
    """The kv block to fetch at grid step (i, j). A skipped tile fetches a block that a neighbouring
    step fetches anyway, so the pipeline issues no copy for it."""
    p_lo, p_hi, s_lo, s_hi = _visible_blocks(
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
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
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
        s = _softcap(s * scale, softcap)  # [G * block_q, block_kv]
        shape = (block_q, block_kv)
        rows = i * block_q + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
        cols = j * block_kv + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
        seg_start = jnp.tile(seg_start_ref[...], (1, block_kv // NUM_LANES))
        pos = rows - jnp.maximum(seg_start - prefix_len, 0)
        in_prefix = (cols < prefix_len) & (cols > pos - window)
        in_segment = (cols >= seg_start) & (cols > rows - window)
        mask = (cols <= rows) & (in_prefix | in_segment)
        mask = jnp.tile(mask, (G, 1))
        s = jnp.where(mask, s, MASK_VALUE)

        m_prev, l_prev = m_ref[...], l_ref[...]  # [G * block_q, NUM_LANES], lane-broadcast
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
        p = jnp.where(mask, jnp.exp(s - m_next[:, :1]), 0.0)
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
def _segment_attention(
    q, k, v, prefix_len, seg_start, window, block_sizes, interpret, count_tiles, scale, softcap
):
    _check_shapes(q, k, v, prefix_len, seg_start, block_sizes)
    if interpret is None:  # off TPU there is no Mosaic lowering
        interpret = jax.default_backend() != "tpu"
    B, N, T, H = q.shape
    K = k.shape[1]
    G = N // K
    bq, bkv = block_sizes.block_q, block_sizes.block_kv
    prefix_len = prefix_len.astype(jnp.int32)
    seg_start = seg_start.astype(jnp.int32)
    first_key = _first_segment_key(seg_start, bq)
    first_pos = _first_position(prefix_len, seg_start, bq)
    window = jnp.full((1,), NO_WINDOW if window is None else window, jnp.int32)
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
    block_sizes: BlockSizes = BlockSizes(),
    interpret: bool | None = None,
) -> jax.Array:
    """Attention [B, N, T, H] of q [B, N, T, H] to k/v [B, K, T, H] under the shared-prefix segment
    mask given by prefix_len [B] and seg_start [B, T], cut to `window` (an int32 scalar, may be
    traced; None: no window) as the module docstring draws it.

    Scores are scaled by `scale` (default H ** -0.5) and soft-capped as tanh(s / softcap) *
    softcap where softcap is given. Every row must see at least one key (seg_start[r] <= r holds
    that). T must be a multiple of both block sizes. interpret defaults to True off TPU, where
    the Mosaic lowering is missing.
    """
    return _segment_attention(
        q, k, v, prefix_len, seg_start, window, block_sizes, interpret, False, scale, softcap
    )


def executed_tiles(
    q, k, v, prefix_len, seg_start, window=None, *, block_sizes=BlockSizes(), interpret=None
):
    """How many (query tile, kv tile) steps the kernel computed, over all batches and kv heads."""
    out = _segment_attention(
        q, k, v, prefix_len, seg_start, window, block_sizes, interpret, True, None, None
    )
    return int(out[1])
