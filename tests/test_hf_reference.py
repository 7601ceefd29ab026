"""Sanity checks of the transformers reference helper itself (tests/hf_reference.py)."""

from __future__ import annotations

import math
import pathlib

import numpy as np
import pytest
import tokenizers
from safetensors.numpy import load_file
from transformers import AutoConfig

from hf_reference import FAMILY_CASES, hf_logprobs, load_model, make_checkpoint, train_tokenizer

CASES = sorted(FAMILY_CASES)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("hf_ckpt")
    return {case: make_checkpoint(root / case, case, seed=3) for case in CASES}


@pytest.mark.parametrize("case", CASES)
def test_logprobs_are_finite_distributions(checkpoints, case):
    path = checkpoints[case]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in path.iterdir()
    }
    vocab = AutoConfig.from_pretrained(path).vocab_size
    assert vocab >= tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
    rng = np.random.default_rng(0)
    seqs = [[7], rng.integers(0, 300, size=300).tolist()]
    lp = hf_logprobs(path, seqs, list(range(vocab)))
    assert lp.shape == (2, vocab) and lp.dtype == np.float64
    assert np.isfinite(lp).all()
    lse = np.logaddexp.reduce(lp, axis=1)
    np.testing.assert_allclose(lse, 0.0, atol=1e-9)
    assert lp.std(axis=1).min() > 0.1  # random weights give a non-flat distribution

    subset = hf_logprobs(path, seqs[::-1], [5, 2, 5])
    np.testing.assert_array_equal(subset, lp[::-1][:, [5, 2, 5]])


@pytest.mark.parametrize("case", CASES)
def test_checkpoint_params_are_nontrivial_and_load_faithfully(checkpoints, case):
    path = checkpoints[case]
    tensors = load_file(path / "model.safetensors")
    norms = [k for k in tensors if k.endswith("norm.weight")]
    biases = [k for k in tensors if k.endswith(".bias")]
    for k in norms:
        assert np.abs(tensors[k] - 1.0).max() > 0.1, k
    for k in biases:
        assert np.abs(tensors[k]).max() > 0.05, k
    if case == "qwen2_bias":
        assert len(biases) == 2 * 3  # q, k, v in each of the 2 layers
    if case == "qwen3_qknorm":
        assert sum(".q_norm." in k or ".k_norm." in k for k in norms) == 2 * 2

    classifier = FAMILY_CASES[case].get("head") == "seq_cls"
    tied = AutoConfig.from_pretrained(path).tie_word_embeddings  # the family's default if unset
    if classifier:  # a classification head in place of the LM head
        assert "score.weight" in tensors and "lm_head.weight" not in tensors
    else:
        assert ("lm_head.weight" in tensors) != tied

    # What transformers loads is exactly what is on disk (no silently re-initialized tensor).
    model = load_model(path, classifier=classifier)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    for k, v in tensors.items():
        np.testing.assert_array_equal(state[k], v, err_msg=k)
    if tied and not classifier:
        np.testing.assert_array_equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    assert set(state) - set(tensors) <= {"lm_head.weight"}


def test_config_round_trip_keeps_head_dim_and_llama3_rope(checkpoints):
    gqa = AutoConfig.from_pretrained(checkpoints["llama_gqa_untied"])
    assert (gqa.head_dim, gqa.hidden_size, gqa.num_key_value_heads) == (10, 42, 2)

    config = AutoConfig.from_pretrained(checkpoints["llama3_rope_tied"])
    rope = config.rope_parameters
    assert rope["rope_type"] == "llama3"
    assert (rope["rope_theta"], rope["factor"]) == (500000.0, 8.0)
    assert (rope["low_freq_factor"], rope["high_freq_factor"]) == (1.0, 4.0)
    assert rope["original_max_position_embeddings"] == 64
    assert config.tie_word_embeddings

    # The loaded model applies it: recompute Llama-3's inv_freq independently.
    path = checkpoints["llama3_rope_tied"]
    model = load_model(path)
    head_dim = config.hidden_size // config.num_attention_heads
    inv_freq = 500000.0 ** (-np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    low, high = wavelen > 64 / 1.0, wavelen < 64 / 4.0
    mid = ~low & ~high
    assert low.any() and high.any() and mid.any()  # all three bands occur
    smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
    expected = np.where(low, inv_freq / 8, inv_freq)
    expected = np.where(mid, (1 - smooth) * inv_freq / 8 + smooth * inv_freq, expected)
    np.testing.assert_allclose(model.model.rotary_emb.inv_freq.numpy(), expected, rtol=1e-6)


@pytest.mark.parametrize("add_bos", [False, True])
def test_tokenizer_bos_and_bytes(tmp_path, add_bos):
    tok = train_tokenizer(tmp_path, add_bos=add_bos)
    assert 300 <= tok.get_vocab_size() <= 320
    bos = tok.token_to_id("<|bos|>")
    assert bos is not None and tok.token_to_id("<|eos|>") is not None
    text = "The café costs 3€ — 東京 🙂"
    plain = tok.encode(text, add_special_tokens=False).ids
    assert bos not in plain
    assert tok.decode(plain) == text
    with_special = tok.encode(text, add_special_tokens=True).ids
    assert with_special == ([bos] + plain if add_bos else plain)

    reloaded = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert reloaded.encode(text).ids == with_special
    assert train_tokenizer(tmp_path / "again", add_bos=add_bos).to_str() == tok.to_str()
