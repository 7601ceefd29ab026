"""A random Qwen3-0.6B-shaped checkpoint, built with transformers, for benchmarks on machines
without the default model (the GPU machines have no `gguf` package and no hub access).

Token-id inputs only matter for speed, so the tokenizer is a byte-level BPE with no merges; the
weights are seeded noise (norms near 1), so scores are finite and comparable across backends.
"""

from __future__ import annotations

import pathlib

QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    tie_word_embeddings=True,
)


def qwen3_0_6b(path: str | pathlib.Path, seed: int = 0, dtype: str = "bfloat16") -> pathlib.Path:
    """Write config.json, model.safetensors and tokenizer.json of a random Qwen3-0.6B to path."""
    import tokenizers
    import torch
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, Qwen3Config

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if (path / "model.safetensors").exists():
        return path
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**QWEN3_0_6B))
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.02 * noise)
    model.to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
    vocab = {chr(c) if chr(c).isprintable() else f"<0x{c:02X}>": c for c in range(256)}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    return path
