"""Fused CPU attention kernels (C++, AVX-512, XLA FFI calls), float32 (the segment kernel's dots
also in bfloat16, on AVX-512 BF16), where XLA:CPU would run two matmuls with the softmax's passes
over the scores in memory between them:

- `prefix_attention`: many rows attending to one shared prefix's K/V, the query-side half of
  prefill_extend's steps (docs/benchmarks.md, "A fused CPU kernel for the attention to the
  query"); `attention._prefix_parts` is its jnp reference.
- `segment_attention`: packed rows under the shared-prefix segment mask, packed_segment's
  attention on CPU, computing only the keys each block of rows can see;
  `segment.mask.segment_attention_reference` is its jnp reference.

`library.py` builds and registers them."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tpuscore.kernels.cpu_attention import library


def available() -> bool:
    """Whether the kernel runs in this process (built, registered, and this CPU has AVX-512F)."""
    return library.registered()


def prefix_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, length: jax.Array, scale: float
) -> tuple[jax.Array, jax.Array, jax.Array] | None:
    """Attention of q [B,T,N,H] to the first `length` keys of one prefix, k [K,H,P], v [K,P,H],
    scores scaled by `scale`, unnormalized: o [B,T,K,G,H], max and exp sum [B,T,K,G,1], as
    `attention._prefix_parts` (no window, no soft-cap) returns them. None where the kernel does
    not apply (not float32, or not `available()`): the caller runs its own ops."""
    B, T, N, H = q.shape
    K = k.shape[0]
    if any(x.dtype != jnp.float32 for x in (q, k, v)) or not available():
        return None
    G = N // K
    rows = jax.ShapeDtypeStruct((B * T, K, G), jnp.float32)
    call = jax.ffi.ffi_call(
        library.PREFIX_TARGET,
        (jax.ShapeDtypeStruct((B * T, K, G, H), jnp.float32), rows, rows),
        vmap_method="sequential",
    )
    length = jnp.asarray(length, jnp.int32).reshape(())
    o, m, total = call(q.reshape(B * T, K, G, H), k, v, length, scale=np.float32(scale))
    return o.reshape(B, T, K, G, H), m.reshape(B, T, K, G, 1), total.reshape(B, T, K, G, 1)


@dataclasses.dataclass(frozen=True)
class CpuTiles:
    """packed_segment's `block_sizes` on CPU: the fused segment kernel's blocks, for pricing
    (block_q tokens of rows, each meeting keys in panels of block_kv). Its rows need no padding
    to whole tiles (tile 1). bf16: the kernel rounds q, k and v to bfloat16 and runs their dots
    on AVX-512 BF16 (`bf16_dots`), float32 sums; the precisions whose weights are bfloat16."""

    block_q: int = 16
    block_kv: int = 32
    tile: int = 1
    bf16: bool = False


def bf16_dots() -> bool:
    """Whether the segment kernel's bfloat16 dots run in this process (it is `available()` and
    this CPU has AVX-512 BF16)."""
    return library.bf16_dots()


def segment_kernel_applies(dtype, softcap: float | None) -> bool:
    """Whether `segment_attention` runs for inputs of this dtype and soft-cap in this process:
    float32, or bfloat16 where its dots run in bfloat16 (`bf16_dots`)."""
    if softcap is not None or not available():
        return False
    return dtype == jnp.float32 or (dtype == jnp.bfloat16 and bf16_dots())


def segment_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    prefix_len: jax.Array,
    seg_start: jax.Array,
    window: jax.Array | None,
    scale: float | None,
    softcap: float | None = None,
    bf16: bool = False,
) -> jax.Array:
    """Attention [B,T,N,H] of q [B,T,N,H] to k/v [B,T,K,H] under the segment mask of prefix_len
    [B] and seg_start [B,T] (`segment.mask.segment_mask`), cut to `window` (an int32 scalar, may
    be traced; None: none), scores scaled by `scale` (None: H ** -0.5), in float32. bf16: q, k
    and v rounded to bfloat16, their dots on AVX-512 BF16 with float32 sums, the result rounded
    to bfloat16 (bfloat16 inputs always are). Only where `segment_kernel_applies` and, with
    bf16, `bf16_dots` (ValueError otherwise: the caller runs its own ops there)."""
    B, T, N, H = q.shape
    K = k.shape[2]
    if not all(segment_kernel_applies(x.dtype, softcap) for x in (q, k, v)):
        raise ValueError("the CPU segment kernel needs float32, no soft-cap and AVX-512")
    bf16 = bf16 or any(x.dtype == jnp.bfloat16 for x in (q, k, v))
    if bf16 and (H % 2 or not bf16_dots()):
        raise ValueError("the kernel's bfloat16 dots need an even head dim and AVX-512 BF16")
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))  # bfloat16 widens exactly
    call = jax.ffi.ffi_call(
        library.SEGMENT_TARGET,
        jax.ShapeDtypeStruct((B, T, K, N // K, H), jnp.bfloat16 if bf16 else jnp.float32),
        vmap_method="sequential",
    )
    window = jnp.iinfo(jnp.int32).max if window is None else window
    if not bf16:  # the float32 dots read key panels and values contiguous per kv head
        k, v = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)  # [B, K, H, T], [B, K, T, H]
    o = call(
        q.reshape(B, T, K, N // K, H),
        k,
        v,
        jnp.asarray(prefix_len, jnp.int32),
        jnp.asarray(seg_start, jnp.int32),
        jnp.asarray(window, jnp.int32).reshape(()),
        scale=np.float32(H**-0.5 if scale is None else scale),
        bf16=bool(bf16),
    )
    return o.reshape(B, T, N, H)
