"""reference: the CPU oracle. Plain numpy float32, one sequence at a time, dense causal attention
(cut to the window on sliding layers), every family's differences written out.

Written independently of `models/decoder.py` (no JAX, K/V heads repeated the obvious way) so that
the two can check each other. Slow is fine; clear is required.
"""

from __future__ import annotations

import numpy as np

from tpuscore.backends.base import PerGroupBackend
from tpuscore.backends.contract import BackendOutput, ScoreBatch
from tpuscore.models import rope
from tpuscore.models.config import ModelConfig
from tpuscore.models.model import Model
from tpuscore.models.weights import Params
from tpuscore.parallel.sharding import to_host


def _einsum(spec: str, *operands: np.ndarray) -> np.ndarray:
    return np.einsum(spec, *operands, optimize=True)  # optimize: contract through BLAS


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float, offset: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (offset + w)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def _softcap(x: np.ndarray, cap: float | None) -> np.ndarray:
    return x if cap is None else np.tanh(x / cap) * cap


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum())


def last_token_logprobs(config: ModelConfig, params: Params, tokens: np.ndarray) -> np.ndarray:
    """log P(next token) over the full vocabulary [V] after the token sequence [T]; for a
    classification model, the class logits [num_labels] at the last token instead."""
    T, N, K = len(tokens), config.num_heads, config.num_kv_heads
    eps, offset = config.rms_norm_eps, config.norm_offset
    position = np.arange(T)
    causal = position[None, :] <= position[:, None]  # [T, S]
    scale = float(config.query_pre_attn_scalar or config.head_dim) ** -0.5
    act = _silu if config.hidden_act == "silu" else _gelu_tanh
    # The embedding scale is rounded to the checkpoint's dtype (float32 here), as transformers does.
    x = params["embed"][tokens] * np.float32(config.embed_scale)  # [T, D]
    for i in range(config.num_layers):
        p = {name: value[i] for name, value in params["layers"].items()}
        local = bool(config.local_layers) and config.local_layers[i]
        inv_freq = rope.inv_frequencies(config, local=local)  # [H/2]
        angles = position[:, None].astype(np.float32) * inv_freq  # [T, H/2]
        cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]  # [T, 1, H/2]
        mask = causal
        if local:  # the last sliding_window positions, this one included
            mask = causal & (position[None, :] > position[:, None] - config.sliding_window)
        h = _rms_norm(x, p["attn_norm"], eps, offset)
        q = _einsum("td,dnh->tnh", h, p["wq"])
        k = _einsum("td,dkh->tkh", h, p["wk"])
        v = _einsum("td,dkh->tkh", h, p["wv"])
        if config.qkv_bias:
            q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
        if config.qk_norm:
            q = _rms_norm(q, p["q_norm"], eps, offset)
            k = _rms_norm(k, p["k_norm"], eps, offset)
        q, k = rope.rotate(q, cos, sin), rope.rotate(k, cos, sin)
        k, v = np.repeat(k, N // K, axis=1), np.repeat(v, N // K, axis=1)  # [T, N, H]
        scores = _softcap(_einsum("tnh,snh->nts", q, k) * scale, config.attn_logit_softcap)
        scores = np.where(mask, scores, -np.inf)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        attn = _einsum("nts,snh->tnh", probs, v)
        out = _einsum("tnh,nhd->td", attn, p["wo"])
        out = out + p["bo"] if config.o_bias else out
        if config.sandwich_norms:
            out = _rms_norm(out, p["post_attn_norm"], eps, offset)
        x = x + out
        h = _rms_norm(x, p["mlp_norm"], eps, offset)
        mlp = (act(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]
        if config.sandwich_norms:
            mlp = _rms_norm(mlp, p["post_mlp_norm"], eps, offset)
        x = x + mlp
    h = _rms_norm(x[-1], params["final_norm"], eps, offset)
    if config.classifier:
        return h @ params["score"]
    logits = params["embed"] @ h if config.tie_word_embeddings else h @ params["lm_head"]
    return _log_softmax(_softcap(logits, config.final_logit_softcap))


class ReferenceBackend(PerGroupBackend):
    def __init__(self, model: Model, options: None = None):
        self.config = model.config
        self.params = _as_float32(model.weights)

    def score(self, batch: ScoreBatch) -> BackendOutput:
        out = BackendOutput.for_batch(batch)
        for i in range(batch.num_items):
            sequence = batch.sequence(i)
            full = last_token_logprobs(self.config, self.params, sequence)
            out.step("last_token_logprobs", sequence.shape, len(sequence))
            out.scores(np.array([i]), full[None, batch.label_ids])
        return out.build()


def _as_float32(params: Params) -> Params:
    if isinstance(params, dict):
        return {name: _as_float32(value) for name, value in params.items()}
    return to_host(params).astype(np.float32)
