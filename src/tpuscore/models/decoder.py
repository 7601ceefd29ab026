"""The decoder forward pass in JAX: Llama, Qwen2, Qwen3 and Gemma 1-3 from one set of pure
functions, the differences driven by the config (`models/config.py`).

Axis letters: B batch, T tokens, S keys, N query heads, K kv heads, G = N/K, H head dim,
D model dim, F MLP dim, V vocab, C labels. Parameters follow `models/weights.py`.

Matmuls run in their weight's dtype (attention's in the norm weights') and accumulate in float32
(int8 weights: in int32, `models/int8.py`); norms, RoPE and softmax run in float32. The head
(LM head or classification head) is applied only to the rows being scored, never to every token.

Sliding windows: layers are scanned, so a layer's window travels through `lax.scan` as data, a
per-layer int32 (`layer_windows`: the window of a local layer, `NO_WINDOW` for a global one).
A token at position i attends to keys at positions j with i - window < j <= i, as transformers'
sliding-window mask has it. Every mask a backend builds is intersected with `within_window`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tpuscore.models import int8, rope
from tpuscore.models.adapters import LayerLora, RowAdapters, layer_lora, plus_lora
from tpuscore.models.attention import (
    NO_WINDOW,
    LayerAttention,
    _merge,
    _own_parts,
    _prefix_parts,
    attention_scale,
    layer_windows,
    within_window,
)
from tpuscore.models.config import ModelConfig
from tpuscore.models.weights import Params, bits_as_bfloat16

f32 = jnp.float32


def _dot(spec: str, x: jax.Array, w: jax.Array | int8.Int8Weight | int8.Probe) -> jax.Array:
    # The int8 precision's weights are `Int8Weight`s; its calibration pass wraps float32 ones in
    # `Probe`s, which report their input and multiply as float32.
    if isinstance(w, int8.Int8Weight):
        return int8.dot(x, w)
    if isinstance(w, int8.Probe):
        w = int8.report(spec, x, w)
    # float32 weights ask for full precision, or TPUs and GPUs would round to bf16/tf32.
    precision = jax.lax.Precision.HIGHEST if w.dtype == f32 else None
    out = jnp.einsum(spec, x.astype(w.dtype), w, precision=precision, preferred_element_type=f32)
    return out


def rms_norm(x: jax.Array, w: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm scaled by (offset + w) in float32: offset 1 is Gemma's (1 + w)."""
    x = x.astype(f32)
    scale = w.astype(f32) + offset if offset else w.astype(f32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _norm(config: ModelConfig, x: jax.Array, w: jax.Array) -> jax.Array:
    return rms_norm(x, w, config.rms_norm_eps, config.norm_offset)


def rope_angles(
    config: ModelConfig, positions: jax.Array, local: bool = False
) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, 1, H/2] for integer positions [B, T] (local: a sliding layer's RoPE)."""
    inv_freq = jnp.asarray(rope.inv_frequencies(config, local))
    angles = positions[..., None].astype(f32) * inv_freq
    return jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]


PrefixKernel = Callable[..., "tuple[jax.Array, jax.Array, jax.Array] | None"]


class Prefix(NamedTuple):
    """K/V of a shared token prefix, in the layout the prefix matmul wants.

    k [layers, K, H, P], v [layers, K, P, H]: positions at or past `length` are padding.
    last_hidden [D]: the final hidden state of the prefix's last token (scores an empty item).
    """

    k: jax.Array
    v: jax.Array
    length: jax.Array
    last_hidden: jax.Array


def _qkv(config: ModelConfig, x, p, cos, sin, lora: LayerLora | None = None):
    # Attention runs in the norms' dtype: bfloat16 only where every weight is (the mixed
    # precision keeps norms, and so attention, in float32).
    dtype = p["attn_norm"].dtype
    h = _norm(config, x, p["attn_norm"])
    q = plus_lora(_dot("btd,dnh->btnh", h, p["wq"]), h, lora, "wq")
    k = plus_lora(_dot("btd,dkh->btkh", h, p["wk"]), h, lora, "wk")
    v = plus_lora(_dot("btd,dkh->btkh", h, p["wv"]), h, lora, "wv")
    if config.qkv_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    if config.qk_norm:
        q = _norm(config, q, p["q_norm"])
        k = _norm(config, k, p["k_norm"])
    q = rope.rotate(q, cos, sin, xp=jnp).astype(dtype)
    k = rope.rotate(k, cos, sin, xp=jnp).astype(dtype)
    return q, k, v.astype(dtype)


def _finish(config: ModelConfig, x, o, p, lora: LayerLora | None = None):
    """Output projection, residual and MLP after attention output o [B,T,N,H]."""
    attn = plus_lora(_dot("btnh,nhd->btd", o, p["wo"]), o, lora, "wo")
    if config.o_bias:
        attn = attn + p["bo"]
    if config.sandwich_norms:
        attn = _norm(config, attn, p["post_attn_norm"])
    x = x + attn
    h = _norm(config, x, p["mlp_norm"])
    gate = plus_lora(_dot("btd,df->btf", h, p["w_gate"]), h, lora, "w_gate")
    up = plus_lora(_dot("btd,df->btf", h, p["w_up"]), h, lora, "w_up")
    act = jax.nn.silu(gate) if config.hidden_act == "silu" else jax.nn.gelu(gate, approximate=True)
    mlp = plus_lora(_dot("btf,fd->btd", act * up, p["w_down"]), act * up, lora, "w_down")
    if config.sandwich_norms:
        mlp = _norm(config, mlp, p["post_mlp_norm"])
    return x + mlp


def _embed(params: Params, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    x = params["embed"][tokens].astype(f32)
    if config.embed_scale != 1.0:  # rounded to the weights' dtype first, as transformers does
        x = x * jnp.asarray(config.embed_scale, params["embed"].dtype).astype(f32)
    return x


def _layer_inputs(config: ModelConfig, positions: jax.Array):
    """What the layer scan carries per layer besides the weights: the window [L] (None without
    sliding layers), and each layer's RoPE (cos, sin), chosen between global and local."""
    if not config.windowed:
        return None, rope_angles(config, positions)
    windows = jnp.asarray(layer_windows(config))
    if config.rope_local_theta is None:
        return windows, rope_angles(config, positions)
    return windows, (rope_angles(config, positions), rope_angles(config, positions, local=True))


def _layer_rope(config: ModelConfig, angles, window):
    """This layer's (cos, sin) from `_layer_inputs`' angles."""
    if window is None or config.rope_local_theta is None:
        return angles
    (cos, sin), (local_cos, local_sin) = angles
    local = window != NO_WINDOW
    return jnp.where(local, local_cos, cos), jnp.where(local, local_sin, sin)


def _layer_attention(config: ModelConfig, window) -> LayerAttention:
    return LayerAttention(window, attention_scale(config), config.attn_logit_softcap)


# Platforms (as `jax.lax.platform_dependent` names them) whose steps run the layer loop
# unrolled. Rolled, XLA on a GPU issues each layer's kernels from the host once per iteration
# of the loop; unrolled, the step is one graph of kernels, which costs compile time.
UNROLLED_LAYERS_ON: frozenset[str] = frozenset()


def _scan_layers(step, x, layers, *per_layer):
    """lax.scan of step(x, (one layer's weights, *per-layer inputs)) over the stacked layers,
    whose bfloat16 weights may arrive as their uint16 bits (`weights.layers_as_bits`); unrolled
    where the step is lowered for a platform of `UNROLLED_LAYERS_ON`."""

    def layer_step(x, inputs):
        p, *rest = inputs
        return step(x, (bits_as_bfloat16(p), *rest))

    def scan(unroll):
        return lambda: jax.lax.scan(layer_step, x, (layers, *per_layer), unroll=unroll)

    if not UNROLLED_LAYERS_ON:
        return scan(1)()
    unrolled = {platform: scan(True) for platform in UNROLLED_LAYERS_ON}
    return jax.lax.platform_dependent(default=scan(1), **unrolled)


# attention(q [B,T,N,H], k [B,T,K,H], v [B,T,K,H], layer: LayerAttention) -> [B,T,N,H]
Attention = Callable[..., jax.Array]


def forward(
    params: Params,
    config: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    attention: Attention,
    adapters: RowAdapters | None = None,
) -> jax.Array:
    """Final hidden states [B, T, D] (before the final norm) for tokens [B, T].

    attention maps q [B,T,N,H], k/v [B,T,K,H] and the layer's `LayerAttention` to [B,T,N,H],
    e.g. `attend` under a mask intersected with `within_window` of the positions.

    adapters: LoRA adapters and each row's index into them (`models/adapters.py`); None runs
    the base model alone.
    """
    windows, angles = _layer_inputs(config, positions)
    lora_layers = layer_lora(adapters)

    def step(x, layer):
        p, window, lora = layer
        lora = None if lora is None else LayerLora(*lora, adapters.index)
        cos, sin = _layer_rope(config, angles, window)
        q, k, v = _qkv(config, x, p, cos, sin, lora)
        o = attention(q, k, v, _layer_attention(config, window))
        return _finish(config, x, o, p, lora), None

    x = _embed(params, config, tokens)
    x, _ = _scan_layers(step, x, params["layers"], windows, lora_layers)
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
    prefix_blocks: int = 1,
    prefix_kernel: PrefixKernel | None = None,
    adapters: RowAdapters | None = None,
    platform: str | None = None,
):
    """Run tokens [B, T], each row continuing a prefix, without copying a shared one.

    rows None: every row continues the one shared `prefix` (k [layers, K, H, P]), met through one
    matmul for the whole batch. rows [B]: `prefix` is a stack of prefixes (k [layers, Q, K, H, P],
    length [Q]; `stack_prefixes`) and row b continues prefix rows[b], gathered per row.

    Row tokens sit at positions prefix length + [0, T) and attend to the whole prefix plus their
    own row under mask [B, T, T] (which must allow each token itself), both cut to the layer's
    window on sliding layers. The two attention parts are
    merged exactly through their log-sum-exp (Hydragen, arXiv 2402.05099).

    prefix_blocks > 1 (a shared prefix only): the prefix is met in that many key blocks, those
    past the prefix's length skipped (`_prefix_parts`).

    prefix_kernel (a shared prefix only): a fused CPU kernel for the rows' attention to the
    prefix on layers without a window or soft-cap, called as (q, prefix_k, prefix_v, length,
    scale) and returning `_prefix_parts`' result, or None where it does not apply; `_prefix_parts`
    runs there, and wherever the step is lowered for a platform other than CPU.

    adapters: as `forward`'s, for the rows' own tokens; a row's prefix must have been computed
    under the same adapter (a prefix's K/V depend on it).
    platform: where the step runs (the model's, resolved once; None: this process's default),
    which sizes `_prefix_parts`' score blocks (`score_block_tokens`).

    Returns hidden [B, T, D], and with return_kv the rows' own k/v [layers, B, T, K, H].
    """
    B, T = tokens.shape
    length = prefix.length if rows is None else prefix.length[rows][:, None]  # [] or [B, 1]
    positions = jnp.broadcast_to(length + jnp.arange(T), (B, T))
    windows, angles = _layer_inputs(config, positions)
    P = prefix.k.shape[-1]
    prefix_mask = jnp.arange(P) < length  # [P] or [B, P]

    def prefix_parts(q, prefix_k, prefix_v, layer):
        if rows is not None:  # each row's own prefix, as keys [B, P, K, H] under mask [B, T, P]
            k, v = prefix_k[rows].transpose(0, 3, 1, 2), prefix_v[rows].transpose(0, 2, 1, 3)
            own_mask = prefix_mask[:, None] & within_window(positions, jnp.arange(P), layer.window)
            return _own_parts(q, k, v, own_mask, layer)

        def xla_ops():
            return _prefix_parts(
                q,
                prefix_k,
                prefix_v,
                prefix_mask,
                layer,
                positions[0],
                prefix_blocks,
                length,
                platform,
            )

        if prefix_kernel is None or layer.window is not None or layer.softcap is not None:
            return xla_ops()
        scale = q.shape[-1] ** -0.5 if layer.scale is None else layer.scale

        def fused():
            parts = prefix_kernel(q, prefix_k, prefix_v, prefix.length, scale)
            return xla_ops() if parts is None else parts

        # A CPU kernel: a step lowered for another platform keeps XLA's ops.
        return jax.lax.platform_dependent(cpu=fused, default=xla_ops)

    def step(x, layer_inputs):
        p, prefix_k, prefix_v, window, lora = layer_inputs
        lora = None if lora is None else LayerLora(*lora, adapters.index)
        layer = _layer_attention(config, window)
        cos, sin = _layer_rope(config, angles, window)
        q, k, v = _qkv(config, x, p, cos, sin, lora)
        own_mask = mask & within_window(positions, positions, window)
        o = _merge(prefix_parts(q, prefix_k, prefix_v, layer), _own_parts(q, k, v, own_mask, layer))
        return _finish(config, x, o, p, lora), (k, v) if return_kv else None

    x = _embed(params, config, tokens)
    lora_layers = layer_lora(adapters)
    return _scan_layers(step, x, params["layers"], prefix.k, prefix.v, windows, lora_layers)


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


def _head(
    params: Params, config: ModelConfig, hidden: jax.Array, adapters: RowAdapters | None = None
) -> jax.Array:
    """The head's output [B, V] for the hidden states [B, D]: log P(token) over the full
    vocabulary; for a classification model, its class logits [B, num_labels] instead (each
    row's adapter's own head where its modules_to_save replaced it)."""
    h = _norm(config, hidden, params["final_norm"])
    if config.classifier:
        logits = _dot("bd,dc->bc", h, params["score"])
        if adapters is None or adapters.stack.score is None:
            return logits
        score = adapters.stack.score[adapters.index]  # [B, D, C]
        own = jnp.einsum("bd,bdc->bc", h, score, precision=jax.lax.Precision.HIGHEST)
        return jnp.where(adapters.stack.own_score[adapters.index][:, None], own, logits)
    if config.tie_word_embeddings:
        logits = _dot("bd,vd->bv", h, params["embed"])
    else:
        logits = _dot("bd,dv->bv", h, params["lm_head"])
    if config.final_logit_softcap is not None:
        logits = jnp.tanh(logits / config.final_logit_softcap) * config.final_logit_softcap
    return jax.nn.log_softmax(logits, axis=-1)


def label_logprobs(
    params: Params,
    config: ModelConfig,
    hidden: jax.Array,
    label_ids: jax.Array,
    adapters: RowAdapters | None = None,
) -> jax.Array:
    """log P(label) over the full vocabulary [B, C] from the hidden states [B, D] of scored rows.

    For a classification model, label_ids are class indices and the result is those classes'
    logits (validation makes them every class in order). adapters: as `forward`'s, one index per
    scored row (a classification head an adapter saved replaces the base's for its rows)."""
    return _head(params, config, hidden, adapters)[:, label_ids]


def row_label_logprobs(
    params: Params,
    config: ModelConfig,
    hidden: jax.Array,
    label_ids: jax.Array,
    adapters: RowAdapters | None = None,
) -> jax.Array:
    """log P(label) [B, I, C] from hidden states [B, I, D], with labels per row [B, C] (class
    logits for a classification model, as `label_logprobs`; adapters: one index per row)."""
    B, slots, D = hidden.shape
    if adapters is not None:  # one index per scored position: each row's, repeated
        adapters = adapters._replace(index=jnp.repeat(adapters.index, slots))
    flat = _head(params, config, hidden.reshape(B * slots, D), adapters)
    logprobs = flat.reshape(B, slots, -1)
    index = jnp.broadcast_to(label_ids[:, None, :], (B, slots, label_ids.shape[1]))
    return jnp.take_along_axis(logprobs, index, axis=2)
