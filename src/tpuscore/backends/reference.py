"""reference: the CPU oracle. Plain numpy float32, one sequence at a time, dense causal attention.

Written independently of `models/decoder.py` (no JAX, K/V heads repeated the obvious way) so that
the two can check each other. Slow is fine; clear is required.
"""

from __future__ import annotations

import numpy as np

from tpuscore.backends.contract import BackendOutput, ScoreBatch
from tpuscore.models import rope
from tpuscore.models.config import ModelConfig
from tpuscore.models.model import Model
from tpuscore.models.weights import Params
from tpuscore.parallel.sharding import to_host


def _einsum(spec: str, *operands: np.ndarray) -> np.ndarray:
    return np.einsum(spec, *operands, optimize=True)  # optimize: contract through BLAS


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum())


def last_token_logprobs(config: ModelConfig, params: Params, tokens: np.ndarray) -> np.ndarray:
    """log P(next token) over the full vocabulary [V] after the token sequence [T]."""
    T, N, K = len(tokens), config.num_heads, config.num_kv_heads
    angles = np.arange(T, dtype=np.float32)[:, None] * rope.inv_frequencies(config)  # [T, H/2]
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]  # [T, 1, H/2]
    causal = np.tril(np.ones((T, T), bool))
    x = params["embed"][tokens]  # [T, D]
    for i in range(config.num_layers):
        p = {name: value[i] for name, value in params["layers"].items()}
        h = _rms_norm(x, p["attn_norm"], config.rms_norm_eps)
        q = _einsum("td,dnh->tnh", h, p["wq"])
        k = _einsum("td,dkh->tkh", h, p["wk"])
        v = _einsum("td,dkh->tkh", h, p["wv"])
        if config.qkv_bias:
            q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
        if config.qk_norm:
            q = _rms_norm(q, p["q_norm"], config.rms_norm_eps)
            k = _rms_norm(k, p["k_norm"], config.rms_norm_eps)
        q, k = rope.rotate(q, cos, sin), rope.rotate(k, cos, sin)
        k, v = np.repeat(k, N // K, axis=1), np.repeat(v, N // K, axis=1)  # [T, N, H]
        scores = _einsum("tnh,snh->nts", q, k) / np.sqrt(config.head_dim)
        scores = np.where(causal, scores, -np.inf)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        attn = _einsum("nts,snh->tnh", probs, v)
        out = _einsum("tnh,nhd->td", attn, p["wo"])
        x = x + (out + p["bo"] if config.o_bias else out)
        h = _rms_norm(x, p["mlp_norm"], config.rms_norm_eps)
        x = x + (_silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]
    h = _rms_norm(x[-1], params["final_norm"], config.rms_norm_eps)
    logits = params["embed"] @ h if config.tie_word_embeddings else h @ params["lm_head"]
    return _log_softmax(logits)


class ReferenceBackend:
    def __init__(self, model: Model, options: None = None):
        self.config = model.config
        self.params = _as_float32(model.params)

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
