"""A fused CPU attention kernel (C++, AVX-512, an XLA FFI call) for the attention of many rows
to one shared prefix's K/V, float32: the query-side half of prefill_extend's steps, which XLA:CPU
otherwise runs as two matmuls with the softmax's passes over the scores in memory between them
(docs/benchmarks.md, "A fused CPU kernel for the attention to the query"). `library.py` builds
and registers it; `attention._prefix_parts` is its jnp reference."""

from __future__ import annotations

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
        library.TARGET,
        (jax.ShapeDtypeStruct((B * T, K, G, H), jnp.float32), rows, rows),
        vmap_method="sequential",
    )
    length = jnp.asarray(length, jnp.int32).reshape(())
    o, m, total = call(q.reshape(B * T, K, G, H), k, v, length, scale=np.float32(scale))
    return o.reshape(B, T, K, G, H), m.reshape(B, T, K, G, 1), total.reshape(B, T, K, G, 1)
