"""The decoder forward pass in JAX: Llama, Qwen2 and Qwen3 from one set of pure functions.

Axis letters: B batch, T tokens, S keys, N query heads, K kv heads, G = N/K, H head dim,
D model dim, F MLP dim, V vocab, C labels. Parameters follow `models/weights.py`.

Matmuls run in the parameter dtype and accumulate in float32; norms, RoPE and softmax run in
float32. The LM head is applied only to the rows being scored, never to every token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tpuscore.models import rope
from tpuscore.models.config import ModelConfig
from tpuscore.models.weights import Params

f32 = jnp.float32


def _dot(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    # float32 weights ask for full precision, or TPUs and GPUs would round to bf16/tf32.
    precision = jax.lax.Precision.HIGHEST if w.dtype == f32 else None
    out = jnp.einsum(spec, x.astype(w.dtype), w, precision=precision, preferred_element_type=f32)
    return out


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x = x.astype(f32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w.astype(f32)


def rope_angles(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, 1, H/2] for integer positions [B, T]."""
    angles = positions[..., None].astype(f32) * jnp.asarray(rope.inv_frequencies(cfg))
    return jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax attention with GQA, no K/V repeat. q [B,T,N,H], k/v [B,S,K,H], mask [B,T,S]."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    # [B, K, G*T, H] @ [B, K, H, S]: one batched matmul per kv head.
    q = q.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)
    k = k.transpose(0, 2, 3, 1)
    v = v.transpose(0, 2, 1, 3)
    precision = jax.lax.Precision.HIGHEST if q.dtype == f32 else None
    scores = jnp.matmul(q, k, precision=precision, preferred_element_type=f32) / jnp.sqrt(H)
    scores = scores.reshape(B, K, G, T, S)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(f32).min)
    probs = jax.nn.softmax(scores, axis=-1).reshape(B, K, G * T, S).astype(v.dtype)
    out = jnp.matmul(probs, v, precision=precision, preferred_element_type=f32)
    return out.reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)


def _layer(cfg: ModelConfig, x, p, cos, sin, mask):
    dtype = p["wq"].dtype
    h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
    q = _dot("btd,dnh->btnh", h, p["wq"])
    k = _dot("btd,dkh->btkh", h, p["wk"])
    v = _dot("btd,dkh->btkh", h, p["wv"])
    if cfg.qkv_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    q = rope.rotate(q, cos, sin, xp=jnp).astype(dtype)
    k = rope.rotate(k, cos, sin, xp=jnp).astype(dtype)
    o = attend(q, k, v.astype(dtype), mask)
    attn = _dot("btnh,nhd->btd", o, p["wo"])
    if cfg.o_bias:
        attn = attn + p["bo"]
    x = x + attn
    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
    gate = _dot("btd,df->btf", h, p["w_gate"])
    up = _dot("btd,df->btf", h, p["w_up"])
    return x + _dot("btf,fd->btd", jax.nn.silu(gate) * up, p["w_down"])


def forward(
    params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array, mask: jax.Array
) -> jax.Array:
    """Final hidden states [B, T, D] (before the final norm) for tokens [B, T].

    mask [B, T, T] says which keys each query token may attend to. Every row must allow at least
    one key (padding rows: their own position).
    """
    cos, sin = rope_angles(cfg, positions)
    x = params["embed"][tokens].astype(f32)

    def step(x, layer_params):
        return _layer(cfg, x, layer_params, cos, sin, mask), None

    x, _ = jax.lax.scan(step, x, params["layers"])
    return x


def label_logprobs(
    params: Params, cfg: ModelConfig, hidden: jax.Array, label_ids: jax.Array
) -> jax.Array:
    """log P(label) over the full vocabulary [B, C] from the hidden states [B, D] of scored rows."""
    h = rms_norm(hidden, params["final_norm"], cfg.rms_norm_eps)
    if cfg.tie_word_embeddings:
        logits = _dot("bd,vd->bv", h, params["embed"])
    else:
        logits = _dot("bd,dv->bv", h, params["lm_head"])
    return jax.nn.log_softmax(logits, axis=-1)[:, label_ids]
