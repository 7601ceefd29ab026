"""GGUF reading: tensors and tokenizer against transformers' own GGUF loader on the embedded
SmolLM2 file, and exact round trips of tiny random models written with llama.cpp's conventions."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tpuscore.models.config import ModelConfig, UnsupportedModelError
from tpuscore.models.loaders.gguf import read_gguf
from tpuscore.models.weights import CheckpointMismatchError


@pytest.fixture(scope="module")
def smollm2(default_model_path):
    return read_gguf(default_model_path)


@pytest.fixture(scope="module")
def hf_smollm2_tokenizer(default_model_path):
    return transformers.AutoTokenizer.from_pretrained(
        default_model_path.parent, gguf_file=default_model_path.name
    )


TEXTS = [
    "The capital of France is Paris.",
    "2026 and 3.14159, or 1,000,000 items at $19.99",
    "naïve café 東京 🙂 Ünïcödé",
    "  leading spaces,   runs   of spaces, and trailing   ",
    "line one\nline two\n\n\ttabbed\r\nwindows",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "don't I'm we'll THEY'RE",
    "def f(x):\n    return x ** 2  # square",
    "",
]


@pytest.mark.slow  # transformers converts the GGUF's tokenizer: about 20 s
@pytest.mark.default_model
@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_tokenizer_matches_transformers(
    smollm2, hf_smollm2_tokenizer, text, add_special_tokens
):
    ours = smollm2.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
    assert ours == hf_smollm2_tokenizer.encode(text, add_special_tokens=add_special_tokens)


@pytest.mark.default_model
def test_smollm2_chat_tokens_stay_whole(smollm2):
    ids = smollm2.tokenizer.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert ids[0] == smollm2.tokenizer.token_to_id("<|im_start|>") == 1
    assert ids[-1] == smollm2.tokenizer.token_to_id("<|im_end|>") == 2
    assert (
        smollm2.tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    )


@pytest.mark.slow  # transformers dequantizes the whole GGUF: about 25 s
@pytest.mark.default_model
def test_smollm2_tensors_match_transformers(smollm2, hf_default_model):
    hf = hf_default_model
    expected = {name: t.numpy() for name, t in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    assert sorted(smollm2.tensors) == sorted(expected)
    for name, value in smollm2.tensors.items():
        assert value.dtype == np.float32, name
        np.testing.assert_array_equal(value, expected[name], err_msg=name)
    # transformers keeps float32's widening (9.999999747e-06); we keep config.json's 1e-05.
    ours, theirs = smollm2.config.to_dict(), ModelConfig.from_hf(hf.config.to_dict()).to_dict()
    for key in ("rms_norm_eps", "rope_theta"):
        assert ours.pop(key) == pytest.approx(theirs.pop(key), rel=1e-7), key
    assert ours == theirs


# --- Round trips: a tiny random transformers model written to GGUF as llama.cpp's converter does.

BYTE_TOKENS = list(bytes_to_unicode().values())
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
SPECIAL = ["<|endoftext|>", "<|im_start|>"]
USER_DEFINED = ["<think>"]
VOCAB = 300


def _tokenizer_metadata(pre: str, add_bos: bool) -> dict:
    # "ab" has no merge: only a whole-word lookup (llama.cpp's ignore_merges) can produce it.
    tokens = SPECIAL + BYTE_TOKENS + [m.replace(" ", "") for m in MERGES] + ["ab"] + USER_DEFINED
    pads = [f"[PAD{i}]" for i in range(VOCAB - len(tokens))]
    types = [3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL) - 1) + [4] + [5] * len(pads)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens + pads,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.add_bos_token": add_bos,
    }


def _model_metadata(config, arch: str) -> dict:
    """What convert_hf_to_gguf.py writes for this config (key_length only when it is explicit)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    meta = {
        "general.architecture": arch,
        f"{arch}.block_count": config.num_hidden_layers,
        f"{arch}.context_length": config.max_position_embeddings,
        f"{arch}.embedding_length": config.hidden_size,
        f"{arch}.feed_forward_length": config.intermediate_size,
        f"{arch}.attention.head_count": config.num_attention_heads,
        f"{arch}.attention.head_count_kv": config.num_key_value_heads,
        f"{arch}.rope.freq_base": float(config.rope_parameters["rope_theta"]),
        f"{arch}.attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        f"{arch}.vocab_size": config.vocab_size,
    }
    if head_dim != config.hidden_size // config.num_attention_heads:
        meta[f"{arch}.attention.key_length"] = head_dim
        meta[f"{arch}.attention.value_length"] = head_dim
    return meta


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _gguf_tensors(model, arch: str) -> dict[str, np.ndarray]:
    config = model.config
    names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), config.num_hidden_layers
    )
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        value = t.numpy()
        if arch == "llama" and ".q_proj." in name:
            value = _llama_cpp_permute(value, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            value = _llama_cpp_permute(value, config.num_key_value_heads)
        out[names.get_name(name, try_suffixes=(".weight", ".bias"))] = value
    return out


def _write_gguf(path, metadata: dict, tensors: dict[str, np.ndarray]) -> str:
    writer = gguf.GGUFWriter(path, metadata["general.architecture"])
    for key, value in metadata.items():
        if key == "general.architecture":
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, value in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


TINY = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)
CASES = {
    # Llama with GQA, all four attention biases and an untied head: Q/K rows and biases permuted.
    "llama": (
        transformers.LlamaConfig,
        dict(attention_bias=True, tie_word_embeddings=False, rope_theta=5e5),
        "llama-bpe",
        True,
    ),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True), "qwen2", False),
    # head_dim 16 != 48 / 4, so key_length must be read.
    "qwen3": (transformers.Qwen3Config, dict(head_dim=16, rope_theta=1e6), "qwen2", False),
}


def _tiny_model(family: str):
    config_class, extra, _, _ = CASES[family]
    extra = dict(extra)
    theta = extra.pop("rope_theta", 1e4)
    config = config_class(
        **TINY, **extra, rope_parameters={"rope_type": "default", "rope_theta": theta}
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()  # norms and biases too, so no tensor is trivially ones or zeros
    return model


def _tiny_gguf(tmp_path, family: str, metadata: dict | None = None, tensors: dict | None = None):
    _, _, pre, add_bos = CASES[family]
    model = _tiny_model(family)
    meta = _model_metadata(model.config, family) | _tokenizer_metadata(pre, add_bos)
    meta |= metadata or {}
    meta = {k: v for k, v in meta.items() if v is not None}
    path = _write_gguf(
        tmp_path / f"{family}.gguf", meta, _gguf_tensors(model, family) | (tensors or {})
    )
    return path, model


@pytest.mark.parametrize("family", list(CASES))
def test_round_trip(tmp_path, family):
    path, model = _tiny_gguf(tmp_path, family)
    ckpt = read_gguf(path)
    assert ckpt.config == ModelConfig.from_hf(model.config.to_dict())
    expected = {name: t.numpy() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del expected["lm_head.weight"]
    assert sorted(ckpt.tensors) == sorted(expected)
    for name, value in ckpt.tensors.items():
        assert value.dtype == np.float32, name
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


@pytest.mark.parametrize(
    ("family", "bos", "ab"), [("llama", ["<|endoftext|>"], ["ab"]), ("qwen2", [], ["a", "b"])]
)
def test_round_trip_tokenizer(tmp_path, family, bos, ab):
    path, _ = _tiny_gguf(tmp_path, family)
    tok = read_gguf(path).tokenizer
    ids = tok.encode("<|im_start|>the <think>in a").ids
    assert tok.id_to_token(1) == "<|im_start|>"
    assert [tok.id_to_token(i) for i in ids] == bos + [
        "<|im_start|>", "t", "he", "Ġ", "<think>", "in", "Ġa"
    ]  # fmt: skip
    assert tok.encode("the", add_special_tokens=False).tokens == ["t", "he"]
    assert tok.decode(ids) == "the <think>in a"
    assert tok.encode("ab", add_special_tokens=False).tokens == ab


def test_unknown_pre_tokenizer_warns(tmp_path, caplog):
    path, _ = _tiny_gguf(tmp_path, "qwen2", {"tokenizer.ggml.pre": "mystery"})
    with caplog.at_level(logging.WARNING, logger="tpuscore.models.loaders.gguf"):
        tok = read_gguf(path).tokenizer
    assert "'mystery'" in caplog.text
    assert tok.encode("the").tokens == ["t", "he"]


def test_unknown_tensor_passes_through(tmp_path):
    path, _ = _tiny_gguf(tmp_path, "llama", tensors={"rope_freqs.weight": np.ones(6, np.float32)})
    np.testing.assert_array_equal(read_gguf(path).tensors["rope_freqs.weight"], np.ones(6))


@pytest.mark.parametrize(
    ("metadata", "error", "match"),
    [
        (
            {"general.architecture": "gemma2"},
            UnsupportedModelError,
            "'gemma2'.*llama, qwen2, qwen3",
        ),
        ({"llama.rope.scaling.type": "yarn"}, UnsupportedModelError, "yarn"),
        ({"tokenizer.ggml.model": "llama"}, UnsupportedModelError, "tokenizer.ggml.model 'llama'"),
        ({"llama.feed_forward_length": None}, ValueError, "'llama.feed_forward_length'"),
        ({"llama.rope.freq_base": None}, ValueError, "'llama.rope.freq_base'"),
    ],
)
def test_rejects(tmp_path, metadata, error, match):
    path, _ = _tiny_gguf(tmp_path, "llama", metadata)
    with pytest.raises(error, match=match):
        read_gguf(path)


def test_a_truncated_file_is_named_as_truncated(tmp_path):
    """A download cut short fails in gguf's reader with a bare numpy reshape error that names
    no file; the loader names the file and what is wrong with it."""
    path, _ = _tiny_gguf(tmp_path, "llama")
    data = Path(path).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 7])
    with pytest.raises(CheckpointMismatchError, match=r"cut\.gguf is not a whole GGUF file"):
        read_gguf(cut)
