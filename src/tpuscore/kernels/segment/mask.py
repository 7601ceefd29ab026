"""The segment (shared-prefix) mask rule, its dense form, the jnp reference of the attention under
it, and the input checks both kernels (`tpu.py`, `gpu.py`) share.

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

Scores are scaled (default H ** -0.5) and, for Gemma 2, soft-capped: tanh(s / cap) * cap.

The kernels compute the mask tile by tile from O(T) metadata and never materialize it;
`segment_attention_reference` is the same function in plain jnp: the test oracle.

Axis letters: B batch, T tokens, S keys, N query heads, K kv heads, G = N/K, H head dim.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: exp(MASK - MASK) stays 1, not NaN
NO_WINDOW = jnp.iinfo(jnp.int32).max  # every earlier key


class Tiles(Protocol):
    """What the shape checks need of a kernel's block sizes."""

    block_q: int
    block_kv: int


def segment_positions(prefix_len: jax.Array, seg_start: jax.Array) -> jax.Array:
    """Each row's token position [B, T]: its index in the query, prefix_len + its offset in an
    item (padding rows: prefix_len)."""
    rows = jnp.arange(seg_start.shape[1])[None, :]
    return rows - jnp.maximum(seg_start - prefix_len[:, None], 0)


def segment_mask(
    prefix_len: jax.Array, seg_start: jax.Array, num_keys: int, window: jax.Array | None = None
) -> jax.Array:
    """The dense mask [B, T, S] that the kernels compute tile by tile; window: the sliding
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


def soft_cap(scores: jax.Array, cap: float | None) -> jax.Array:
    """tanh(scores / cap) * cap (Gemma 2's attention-logit soft-cap); scores for cap None."""
    return scores if cap is None else jnp.tanh(scores / cap) * cap


def segment_attention_reference(
    q, k, v, prefix_len, seg_start, window=None, *, scale=None, softcap=None
):
    """Softmax attention [B, N, T, H] of q [B, N, T, H] to k/v [B, K, T, H] under
    `segment_mask` (cut to `window`), scores scaled by `scale` (default H ** -0.5) and
    soft-capped at `softcap`, in float32."""
    B, N, T, H = q.shape
    K = k.shape[1]
    qg = q.reshape(B, K, N // K, T, H).astype(jnp.float32)
    hp = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("bkgth,bksh->bkgts", qg, k.astype(jnp.float32), precision=hp)
    scores = soft_cap(scores * (H**-0.5 if scale is None else scale), softcap)
    mask = segment_mask(prefix_len, seg_start, T, window)[:, None, None]
    weights = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    o = jnp.einsum("bkgts,bksh->bkgth", weights, v.astype(jnp.float32), precision=hp)
    return o.reshape(B, N, T, H).astype(q.dtype)


def check_shapes(q, k, v, prefix_len, seg_start, block_sizes: Tiles) -> None:
    """ValueError naming the dimension unless q [B, N, T, H], k/v [B, K, T, H], prefix_len [B]
    and seg_start [B, T] agree, K divides N, and T is a multiple of both block sizes."""
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


def first_segment_key(seg_start: jax.Array, block_q: int) -> jax.Array:
    """Per query tile [B, T / block_q]: the smallest segment start among its rows. Segments are
    contiguous, so the tile's rows see keys [0, prefix_len) and [this, last row], no others."""
    B, T = seg_start.shape
    return seg_start.reshape(B, T // block_q, block_q).min(axis=-1)


def first_position(prefix_len: jax.Array, seg_start: jax.Array, block_q: int) -> jax.Array:
    """Per query tile [B, T / block_q]: the smallest position among its rows, which bounds the
    first query key any of them sees through a window (pos - window + 1)."""
    B, T = seg_start.shape
    pos = segment_positions(prefix_len, seg_start)
    return pos.reshape(B, T // block_q, block_q).min(axis=-1)


def visible_blocks(i, prefix_len, first_key, first_pos, window, block_q: int, block_kv: int):
    """The kv blocks query tile i may see, as both kernels walk them: [prefix_lo, prefix_hi) of
    the query's keys [max(0, first_pos - window + 1), prefix_len) (empty when the window
    reaches no query key), then [segment_lo, last] of its items' keys [max(first_key, first row
    - window + 1), last row]. Exact at block granularity: each block in them holds a visible
    key (rows see contiguous key ranges that end at themselves)."""
    first_row, last_row = i * block_q, (i + 1) * block_q - 1
    first_query_key = jnp.maximum(first_pos - window + 1, 0)
    prefix_hi = jnp.where(first_query_key < prefix_len, (prefix_len + block_kv - 1) // block_kv, 0)
    prefix_lo = jnp.minimum(first_query_key // block_kv, prefix_hi)
    segment_lo = jnp.maximum(first_key, jnp.maximum(first_row - window + 1, 0)) // block_kv
    return prefix_lo, prefix_hi, segment_lo, last_row // block_kv
