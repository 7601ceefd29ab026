"""The decoder forward pass in JAX: Llama, Qwen2 and Qwen3 from one set of pure functions.

Axis letters: B batch, T tokens, S keys, N query heads, K kv heads, G = N/K, H head dim,
D model dim, F MLP dim, V vocab, C labels. Parameters follow `models/weights.py`.

Matmuls run in the parameter dtype and accumulate in float32; norms, RoPE and softmax run in
float32. The LM head is applied only to the rows being scored, never to every token.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tpuscore.models import rope
from tpuscore.models.config import ModelConfig
from tpuscore.models.weights import Params

CPU_SCORE_BLOCK_BYTES = 4 << 20  # about an L2 cache: see `_prefix_parts`
SCORE_BLOCK_BYTES = 256 << 20


def score_block_tokens(tokens: int, bytes_per_token: int) -> int:
    """The largest divisor of tokens whose attention scores fit the score block (at least 1)."""
    budget = CPU_SCORE_BLOCK_BYTES if jax.default_backend() == "cpu" else SCORE_BLOCK_BYTES
    fits = max(1, budget // bytes_per_token)
    return max(t for t in range(1, min(tokens, fits) + 1) if tokens % t == 0)


f32 = jnp.float32


def _dot(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    # float32 weights ask for full precision, or TPUs and GPUs would round to bf16/tf32.
    precision = jax.lax.Precision.HIGHEST if w.dtype == f32 else None
    out = jnp.einsum(spec, x.astype(w.dtype), w, precision=precision, preferred_element_type=f32)
    return out


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x = x.astype(f32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w.astype(f32)


def rope_angles(config: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, 1, H/2] for integer positions [B, T]."""
    angles = positions[..., None].astype(f32) * jnp.asarray(rope.inv_frequencies(config))
    return jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]


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


def _own_parts(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array):
    """Attention of q [B,T,N,H] to k/v [B,S,K,H] under mask [B,T,S], unnormalized.

    Returns o [B,T,K,G,H] (sum of exp-weighted values), max and exp sum [B,T,K,G,1]. GQA
    without a K/V repeat: [B, K, G*T, H] @ [B, K, H, S], one batched matmul per kv head.
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    q = q.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)
    scores = _matmul(q, k.transpose(0, 2, 3, 1)) / jnp.sqrt(H)
    scores = scores.reshape(B, K, G, T, S)
    m, e, total = _masked_exp(scores, mask[:, None, None])
    o = _matmul(e.reshape(B, K, G * T, S).astype(v.dtype), v.transpose(0, 2, 1, 3))
    to_btkg = lambda x: x.reshape(B, K, G, T, -1).transpose(0, 3, 1, 2, 4)  # noqa: E731
    return to_btkg(o), to_btkg(m), to_btkg(total)


def _prefix_parts(q: jax.Array, prefix_k: jax.Array, prefix_v: jax.Array, prefix_mask: jax.Array):
    """Attention of every row of q [B,T,N,H] to one shared prefix, unnormalized.

    prefix_k [K,H,P], prefix_v [K,P,H], prefix_mask [P]. The B*T query tokens meet the prefix in
    [K, G*t, H] @ [K, H, P] matmuls over blocks of t tokens; the prefix is never copied per row.
    Blocks keep the float32 scores small enough to stay in cache between the two matmuls and the
    exp, which on CPU would otherwise be bound by memory. Returns o [B,T,K,G,H], max and exp sum
    [B,T,K,G,1].
    """
    B, T, N, H = q.shape
    K, P = prefix_k.shape[0], prefix_k.shape[2]
    G = N // K
    t = score_block_tokens(B * T, bytes_per_token=N * P * 4)
    q = q.reshape(B * T // t, t, K, G, H).transpose(0, 2, 3, 1, 4).reshape(-1, K, G * t, H)

    def block(q):
        scores = _matmul(q, prefix_k) / jnp.sqrt(H)
        m, e, total = _masked_exp(scores, prefix_mask)
        return _matmul(e.astype(prefix_v.dtype), prefix_v), m, total

    def to_btkg(x):
        return x.reshape(-1, K, G, t, x.shape[-1]).transpose(0, 3, 1, 2, 4).reshape(B, T, K, G, -1)

    return tuple(map(to_btkg, jax.lax.map(block, q)))


def _merge(*parts) -> jax.Array:
    """Exact softmax attention [B,T,N,H] from partial results over disjoint key sets."""
    m = functools.reduce(jnp.maximum, [m for _, m, _ in parts])
    scales = [jnp.exp(mi - m) for _, mi, _ in parts]
    o = sum(oi * s for (oi, _, _), s in zip(parts, scales, strict=True))
    total = sum(li * s for (_, _, li), s in zip(parts, scales, strict=True))
    B, T, K, G, H = o.shape
    return (o / total).reshape(B, T, K * G, H)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax attention with GQA. q [B,T,N,H], k/v [B,S,K,H], mask [B,T,S] -> [B,T,N,H].

    Every row of the mask must allow at least one key (padding rows: their own position)."""
    return _merge(_own_parts(q, k, v, mask))


class Prefix(NamedTuple):
    """K/V of a shared token prefix, in the layout the prefix matmul wants.

    k [layers, K, H, P], v [layers, K, P, H]: positions at or past `length` are padding.
    last_hidden [D]: the final hidden state of the prefix's last token (scores an empty item).
    """

    k: jax.Array
    v: jax.Array
    length: jax.Array
    last_hidden: jax.Array


def _qkv(config: ModelConfig, x, p, cos, sin):
    dtype = p["wq"].dtype
    h = rms_norm(x, p["attn_norm"], config.rms_norm_eps)
    q = _dot("btd,dnh->btnh", h, p["wq"])
    k = _dot("btd,dkh->btkh", h, p["wk"])
    v = _dot("btd,dkh->btkh", h, p["wv"])
    if config.qkv_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    if config.qk_norm:
        q = rms_norm(q, p["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], config.rms_norm_eps)
    q = rope.rotate(q, cos, sin, xp=jnp).astype(dtype)
    k = rope.rotate(k, cos, sin, xp=jnp).astype(dtype)
    return q, k, v.astype(dtype)


def _finish(config: ModelConfig, x, o, p):
    """Output projection, residual and MLP after attention output o [B,T,N,H]."""
    attn = _dot("btnh,nhd->btd", o, p["wo"])
    if config.o_bias:
        attn = attn + p["bo"]
    x = x + attn
    h = rms_norm(x, p["mlp_norm"], config.rms_norm_eps)
    gate = _dot("btd,df->btf", h, p["w_gate"])
    up = _dot("btd,df->btf", h, p["w_up"])
    return x + _dot("btf,fd->btd", jax.nn.silu(gate) * up, p["w_down"])


Attention = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def forward(
    params: Params,
    config: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    attention: Attention,
) -> jax.Array:
    """Final hidden states [B, T, D] (before the final norm) for tokens [B, T].

    attention maps q [B,T,N,H] and k/v [B,T,K,H] to [B,T,N,H], e.g. `attend` under a mask.
    """
    cos, sin = rope_angles(config, positions)

    def step(x, p):
        q, k, v = _qkv(config, x, p, cos, sin)
        return _finish(config, x, attention(q, k, v), p), None

    x, _ = jax.lax.scan(step, params["embed"][tokens].astype(f32), params["layers"])
    return x


def extend(
    params: Params,
    config: ModelConfig,
    prefix: Prefix,
    tokens: jax.Array,
    mask: jax.Array,
    *,
    rows: jax.Array | None = None,
    return_kv: bool = False,
):
    """Run tokens [B, T], each row continuing a prefix, without copying a shared one.

    rows None: every row continues the one shared `prefix` (k [layers, K, H, P]), met through one
    matmul for the whole batch. rows [B]: `prefix` is a stack of prefixes (k [layers, Q, K, H, P],
    length [Q]; `stack_prefixes`) and row b continues prefix rows[b], gathered per row.

    Row tokens sit at positions prefix length + [0, T) and attend to the whole prefix plus their
    own row under mask [B, T, T] (which must allow each token itself). The two attention parts are
    merged exactly through their log-sum-exp (Hydragen, arXiv 2402.05099).

    Returns hidden [B, T, D], and with return_kv the rows' own k/v [layers, B, T, K, H].
    """
    B, T = tokens.shape
    length = prefix.length if rows is None else prefix.length[rows][:, None]  # [] or [B, 1]
    positions = jnp.broadcast_to(length + jnp.arange(T), (B, T))
    cos, sin = rope_angles(config, positions)
    prefix_mask = jnp.arange(prefix.k.shape[-1]) < length  # [P] or [B, P]

    def prefix_parts(q, prefix_k, prefix_v):
        if rows is None:
            return _prefix_parts(q, prefix_k, prefix_v, prefix_mask)
        # Each row's own prefix, as keys [B, P, K, H] under mask [B, T, P].
        k, v = prefix_k[rows].transpose(0, 3, 1, 2), prefix_v[rows].transpose(0, 2, 1, 3)
        return _own_parts(q, k, v, jnp.broadcast_to(prefix_mask[:, None], (B, T, k.shape[1])))

    def step(x, layer):
        p, prefix_k, prefix_v = layer
        q, k, v = _qkv(config, x, p, cos, sin)
        o = _merge(prefix_parts(q, prefix_k, prefix_v), _own_parts(q, k, v, mask))
        return _finish(config, x, o, p), (k, v) if return_kv else None

    x = params["embed"][tokens].astype(f32)
    return jax.lax.scan(step, x, (params["layers"], prefix.k, prefix.v))


def stack_prefixes(prefixes: list[Prefix], count: int) -> Prefix:
    """Prefixes stacked on a new axis 1 (k [layers, count, K, H, P], v [layers, count, K, P, H],
    length [count], last_hidden [count, D]), padded to the longest P and to `count` entries
    (padding entries are empty: length 0)."""
    P = max(p.k.shape[-1] for p in prefixes)
    first = prefixes[0]
    empty = Prefix(
        k=jnp.zeros((*first.k.shape[:-1], P), first.k.dtype),
        v=jnp.zeros((*first.v.shape[:2], P, first.v.shape[-1]), first.v.dtype),
        length=jnp.int32(0),
        last_hidden=jnp.zeros_like(first.last_hidden),
    )

    def pad(p: Prefix) -> Prefix:
        extra = P - p.k.shape[-1]
        return p._replace(
            k=jnp.pad(p.k, [(0, 0)] * 3 + [(0, extra)]),
            v=jnp.pad(p.v, [(0, 0)] * 2 + [(0, extra), (0, 0)]),
            length=jnp.asarray(p.length, jnp.int32),
        )

    padded = [pad(p) for p in prefixes] + [empty] * (count - len(prefixes))
    return Prefix(
        k=jnp.stack([p.k for p in padded], axis=1),
        v=jnp.stack([p.v for p in padded], axis=1),
        length=jnp.stack([p.length for p in padded]),
        last_hidden=jnp.stack([p.last_hidden for p in padded]),
    )


def _vocab_logprobs(params: Params, config: ModelConfig, hidden: jax.Array) -> jax.Array:
    """log P(token) over the full vocabulary [B, V] from the hidden states [B, D]."""
    h = rms_norm(hidden, params["final_norm"], config.rms_norm_eps)
    if config.tie_word_embeddings:
        logits = _dot("bd,vd->bv", h, params["embed"])
    else:
        logits = _dot("bd,dv->bv", h, params["lm_head"])
    return jax.nn.log_softmax(logits, axis=-1)


def label_logprobs(
    params: Params, config: ModelConfig, hidden: jax.Array, label_ids: jax.Array
) -> jax.Array:
    """log P(label) over the full vocabulary [B, C] from the hidden states [B, D] of scored rows."""
    return _vocab_logprobs(params, config, hidden)[:, label_ids]


def row_label_logprobs(
    params: Params, config: ModelConfig, hidden: jax.Array, label_ids: jax.Array
) -> jax.Array:
    """log P(label) [B, I, C] from hidden states [B, I, D], with labels per row [B, C]."""
    B, slots, D = hidden.shape
    logprobs = _vocab_logprobs(params, config, hidden.reshape(B * slots, D)).reshape(B, slots, -1)
    index = jnp.broadcast_to(label_ids[:, None, :], (B, slots, label_ids.shape[1]))
    return jnp.take_along_axis(logprobs, index, axis=2)
