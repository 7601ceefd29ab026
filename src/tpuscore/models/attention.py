"""Attention of the decoder's layers: the window and soft-cap of a layer, the masked scores, and
attention split in parts (the rows' own keys, a shared prefix's keys, in score blocks) merged by
their running max and sum; `attend` is the plain one.

Axis letters as `decoder`'s: B batch, T tokens, S keys, N query heads, K kv heads, G = N/K, H
head dim."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tpuscore.models.config import ModelConfig

f32 = jnp.float32

CPU_SCORE_BLOCK_BYTES = 4 << 20  # about an L2 cache: see `_prefix_parts`
SCORE_BLOCK_BYTES = 256 << 20


def score_block_tokens(tokens: int, bytes_per_token: int, platform: str | None = None) -> int:
    """The largest divisor of tokens whose attention scores fit the score block (at least 1) of
    `platform` (where the step runs: the model's; None, this process's default)."""
    on_cpu = (platform or jax.default_backend()) == "cpu"
    budget = CPU_SCORE_BLOCK_BYTES if on_cpu else SCORE_BLOCK_BYTES
    fits = max(1, budget // bytes_per_token)
    return max(t for t in range(1, min(tokens, fits) + 1) if tokens % t == 0)


NO_WINDOW = np.iinfo(np.int32).max  # a global layer's window: every earlier key


class LayerAttention(NamedTuple):
    """What a layer's attention needs besides q, k and v.

    window: this layer's key window, an int32 scalar traced through the layer scan (`NO_WINDOW`
    on a global layer), or None where the model has no sliding layer. scale: Gemma's
    query_pre_attn_scalar ** -0.5, or None for the usual head_dim ** -0.5. softcap: Gemma 2's
    tanh cap on the scores, or None.
    """

    window: jax.Array | None
    scale: float | None
    softcap: float | None


def layer_windows(config: ModelConfig) -> np.ndarray:
    """Each layer's key window [L] int32: sliding_window on local layers, NO_WINDOW elsewhere."""
    local = np.asarray(config.local_layers or [False] * config.num_layers, bool)
    return np.where(local, config.sliding_window or NO_WINDOW, NO_WINDOW).astype(np.int32)


def attention_scale(config: ModelConfig) -> float | None:
    """The score scale where it is not head_dim ** -0.5 (Gemma), else None."""
    scalar = config.query_pre_attn_scalar
    return None if scalar is None else float(scalar) ** -0.5


def within_window(q_pos: jax.Array, k_pos: jax.Array, window: jax.Array | None) -> jax.Array:
    """Mask [..., T, S]: key position k_pos [..., S] is inside the window of query position
    q_pos [..., T] (k > q - window); all True for window None. Causality is the caller's."""
    if window is None:
        return jnp.ones((*q_pos.shape, k_pos.shape[-1]), bool)
    return k_pos[..., None, :] > q_pos[..., :, None] - window


def _scores(q: jax.Array, k: jax.Array, layer: LayerAttention | None) -> jax.Array:
    """q [..., T, H] @ k [..., H, S], scaled and soft-capped as the layer says."""
    if layer is None or layer.scale is None:
        scores = _matmul(q, k) / jnp.sqrt(q.shape[-1])
    else:
        scores = _matmul(q, k) * layer.scale
    if layer is not None and layer.softcap is not None:
        scores = jnp.tanh(scores / layer.softcap) * layer.softcap
    return scores


def _masked_exp(scores: jax.Array, mask: jax.Array):
    """Unnormalized softmax over the last axis: max m, e = exp(scores - m) (0 where masked), sum.

    A fully masked row gives m = finfo.min, e = 0 and sum 0, which `_merge` weighs as zero.
    """
    scores = jnp.where(mask, scores, jnp.finfo(f32).min)
    m = jnp.max(scores, axis=-1, keepdims=True)
    e = jnp.where(mask, jnp.exp(scores - m), 0.0)
    return m, e, jnp.sum(e, axis=-1, keepdims=True)


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    precision = jax.lax.Precision.HIGHEST if a.dtype == f32 else None
    return jnp.matmul(a, b, precision=precision, preferred_element_type=f32)


def _own_parts(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, layer: LayerAttention | None = None
):
    """Attention of q [B,T,N,H] to k/v [B,S,K,H] under mask [B,T,S], unnormalized.

    Returns o [B,T,K,G,H] (sum of exp-weighted values), max and exp sum [B,T,K,G,1]. GQA
    without a K/V repeat: [B, K, G*T, H] @ [B, K, H, S], one batched matmul per kv head.
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    q = q.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)
    scores = _scores(q, k.transpose(0, 2, 3, 1), layer).reshape(B, K, G, T, S)
    m, e, total = _masked_exp(scores, mask[:, None, None])
    o = _matmul(e.reshape(B, K, G * T, S).astype(v.dtype), v.transpose(0, 2, 1, 3))
    to_btkg = lambda x: x.reshape(B, K, G, T, -1).transpose(0, 3, 1, 2, 4)  # noqa: E731
    return to_btkg(o), to_btkg(m), to_btkg(total)


def _prefix_parts(
    q: jax.Array,
    prefix_k: jax.Array,
    prefix_v: jax.Array,
    prefix_mask: jax.Array,
    layer: LayerAttention | None = None,
    positions: jax.Array | None = None,
    key_blocks: int = 1,
    length: jax.Array | None = None,
    platform: str | None = None,
):
    """Attention of every row of q [B,T,N,H] to one shared prefix, unnormalized.

    prefix_k [K,H,P], prefix_v [K,P,H], prefix_mask [P]. With a window (layer.window not None),
    the tokens' positions [T] (the same in every row) limit each to the prefix keys inside its
    window. The B*T query tokens meet the prefix in [K, G*t, H] @ [K, H, P] matmuls over blocks of
    t tokens; the prefix is never copied per row. Blocks keep the float32 scores small enough to
    stay in cache between the two matmuls and the exp, which on CPU would otherwise be bound by
    memory.

    key_blocks > 1: the prefix is met in that many equal key blocks (dividing P), in order, and
    only those holding a key before `length` (a loop with a dynamic trip count, merging each
    block's part as it goes, as flash attention does): keys the bucket pads the prefix with are
    not computed. Returns o [B,T,K,G,H], max and exp sum [B,T,K,G,1].
    """
    B, T, N, H = q.shape
    K, P = prefix_k.shape[0], prefix_k.shape[2]
    G = N // K
    width = P // key_blocks
    assert width * key_blocks == P, (P, key_blocks)
    t = score_block_tokens(B * T, bytes_per_token=N * width * 4, platform=platform)
    q = q.reshape(B * T // t, t, K, G, H).transpose(0, 2, 3, 1, 4).reshape(-1, K, G * t, H)
    windowed = layer is not None and layer.window is not None
    # Each block's token positions [blocks, t]: flattened token b*T + i sits at positions[i].
    block_pos = jnp.tile(positions, B).reshape(-1, t) if windowed else jnp.zeros((len(q), 1))

    def part(q, pos, start):
        """The part of the `width` keys from position `start` on."""
        k = jax.lax.dynamic_slice_in_dim(prefix_k, start, width, axis=2)
        v = jax.lax.dynamic_slice_in_dim(prefix_v, start, width, axis=1)
        mask = jax.lax.dynamic_slice_in_dim(prefix_mask, start, width)
        scores = _scores(q, k, layer)  # [K, G*t, width]
        if windowed:  # [t, width], repeated over the G query heads of each token
            window = within_window(pos, start + jnp.arange(width), layer.window) & mask
            mask = jnp.broadcast_to(window, (G, t, width)).reshape(G * t, width)
        m, e, total = _masked_exp(scores, mask)
        return _matmul(e.astype(v.dtype), v), m, total

    def block(args):
        q, pos = args
        if key_blocks == 1:
            return part(q, pos, 0)

        def merge_next(j, parts):
            return _merge_parts(parts, part(q, pos, j * width))

        empty = (
            jnp.zeros((K, G * t, H), f32),
            jnp.full((K, G * t, 1), jnp.finfo(f32).min),
            jnp.zeros((K, G * t, 1), f32),
        )
        return jax.lax.fori_loop(0, -(-length // width), merge_next, empty)

    def to_btkg(x):
        return x.reshape(-1, K, G, t, x.shape[-1]).transpose(0, 3, 1, 2, 4).reshape(B, T, K, G, -1)

    return tuple(map(to_btkg, jax.lax.map(block, (q, block_pos))))


def _merge_parts(a, b):
    """Two unnormalized parts over disjoint key sets as one: (o, max, exp sum)."""
    (oa, ma, la), (ob, mb, lb) = a, b
    m = jnp.maximum(ma, mb)
    sa, sb = jnp.exp(ma - m), jnp.exp(mb - m)
    return oa * sa + ob * sb, m, la * sa + lb * sb


def _merge(*parts) -> jax.Array:
    """Exact softmax attention [B,T,N,H] from partial results over disjoint key sets."""
    o, _, total = functools.reduce(_merge_parts, parts)
    B, T, K, G, H = o.shape
    return (o / total).reshape(B, T, K * G, H)


def attend(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, layer: LayerAttention | None = None
) -> jax.Array:
    """Softmax attention with GQA. q [B,T,N,H], k/v [B,S,K,H], mask [B,T,S] -> [B,T,N,H].

    layer: the scale and soft-cap (None: head_dim ** -0.5, no cap); its window must already be
    in the mask (`within_window`). Every row of the mask must allow at least one key (padding
    rows: their own position)."""
    return _merge(_own_parts(q, k, v, mask, layer))


# (q [B,T,N,H], prefix k [K,H,P], prefix v [K,P,H], length [], scale) -> o [B,T,K,G,H], max and
# exp sum [B,T,K,G,1], or None where the kernel does not apply.
