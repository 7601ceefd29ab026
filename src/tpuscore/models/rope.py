"""Rotary position embeddings, in the "rotate half" layout Hugging Face checkpoints use."""

from __future__ import annotations

import math

import numpy as np

from tpuscore.models.config import ModelConfig


def inv_frequencies(config: ModelConfig, local: bool = False) -> np.ndarray:
    """Per-pair rotation frequencies [H/2] (float32), with the config's RoPE scaling applied.

    local: for a sliding-window layer, which rotates with its own base and no scaling where the
    config has one (`rope_local_theta`, Gemma 3), else as the global layers do.
    """
    H = config.head_dim
    exponents = np.arange(0, H, 2, dtype=np.float64) / H
    if local and config.rope_local_theta is not None:
        return (1.0 / config.rope_local_theta**exponents).astype(np.float32)
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_type == "linear":
        inv_freq = inv_freq / config.rope_factor
    elif config.rope_type == "llama3":
        inv_freq = _llama3_scaling(config, inv_freq)
    return inv_freq.astype(np.float32)


def _llama3_scaling(config: ModelConfig, inv_freq: np.ndarray) -> np.ndarray:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    old_len = config.rope_original_max_position
    low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / config.rope_factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / config.rope_factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, scaled)


def rotate(x, cos, sin, xp=np):
    """Rotate x [..., H] by angles whose cos/sin are [..., H/2]; `xp` is numpy or jax.numpy."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return xp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
