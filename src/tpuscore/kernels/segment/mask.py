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

The kernels compute the mask tile by tile from O(T) metadata and never materialize it;
`segment_attention_reference` is the same function in plain jnp: the test oracle.

Axis letters: B batch, T tokens, S keys, N query heads, K kv heads, G = N/K, H head dim.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: exp(MASK - MASK) stays 1, not NaN


class Tiles(Protocol):
    """What the shape checks need of a kernel's block sizes."""

    block_q: int
    block_kv: int


def segment_mask(prefix_len: jax.Array, seg_start: jax.Array, num_keys: int) -> jax.Array:
    """The dense mask [B, T, S] that the kernels compute tile by tile."""
    rows = jnp.arange(seg_start.shape[1])[None, :, None]
    cols = jnp.arange(num_keys)[None, None, :]
    in_prefix = cols < prefix_len[:, None, None]
    return (cols <= rows) & (in_prefix | (cols >= seg_start[:, :, None]))


def segment_attention_reference(q, k, v, prefix_len, seg_start):
    """Softmax attention [B, N, T, H] of q [B, N, T, H] to k/v [B, K, T, H] under
    `segment_mask`, in float32."""
    B, N, T, H = q.shape
    K = k.shape[1]
    qg = q.reshape(B, K, N // K, T, H).astype(jnp.float32)
    hp = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("bkgth,bksh->bkgts", qg, k.astype(jnp.float32), precision=hp)
    mask = segment_mask(prefix_len, seg_start, T)[:, None, None]
    weights = jax.nn.softmax(jnp.where(mask, scores / jnp.sqrt(H), -jnp.inf), axis=-1)
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
