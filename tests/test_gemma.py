"""Gemma 2 and Gemma 3 (text): every backend against transformers on tiny random checkpoints
whose sliding windows (7 and 9 tokens) are shorter than the test sequences, and the config read
from both spellings of config.json."""

import json

import numpy as np
import pytest

from helpers import random_tokens
from hf_reference import hf_logprobs
from tpuscore.models.config import ModelConfig

BACKENDS = ("serial", "prefill_extend", "packed_dense", "packed_segment", "reference")
ATOL = 1e-4  # float32


# Query lengths on both sides of the windows, items from empty to longer than a window. The
# quick run takes one length per family; `slow` adds the other.
@pytest.mark.parametrize(
    ("case", "query_len"),
    [
        ("gemma2_window", 3),
        ("gemma3_window", 20),
        pytest.param("gemma2_window", 20, marks=pytest.mark.slow),
        pytest.param("gemma3_window", 3, marks=pytest.mark.slow),
    ],
)
def test_backends_match_transformers_across_the_window(
    case, query_len, checkpoint_dir, scorers, rng
):
    scorer = scorers(case)
    vocab = scorer.config.vocab_size
    query = random_tokens(rng, query_len, vocab)
    items = [random_tokens(rng, n, vocab) for n in (0, 1, 5, 13)]
    labels = rng.choice(vocab, size=4, replace=False).tolist()
    expected = hf_logprobs(checkpoint_dir(case), [query + item for item in items], labels)
    for backend in BACKENDS:
        got = scorer.score(query, items, labels, backend=backend).logprobs
        np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0, err_msg=backend)


def test_the_window_changes_the_scores(scorers, rng):
    """Tokens beyond the window of the local layer still reach the last token through the global
    layer, but differently: a model read with the window removed scores otherwise."""
    import dataclasses

    from tpuscore import Scorer

    scorer = scorers("gemma2_window")
    unwindowed = Scorer(
        dataclasses.replace(scorer.config, local_layers=(), sliding_window=None),
        scorer.params,
        None,
        dtype="float32",
    )
    query = random_tokens(rng, 20, scorer.config.vocab_size)
    labels = [3, 5]
    windowed = scorer.score(query, [[7, 8]], labels, backend="serial").logprobs
    full = unwindowed.score(query, [[7, 8]], labels, backend="serial").logprobs
    assert np.abs(windowed - full).max() > 1e-3


GEMMA3_COMMON = {
    "model_type": "gemma3_text",
    "architectures": ["Gemma3ForCausalLM"],
    "vocab_size": 331,
    "hidden_size": 52,
    "intermediate_size": 67,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
    "query_pre_attn_scalar": 23,
    "sliding_window": 9,
    "hidden_activation": "gelu_pytorch_tanh",
}


def test_gemma3_config_reads_the_same_in_both_spellings():
    # transformers 4.x (hub checkpoints): top-level thetas, rope_scaling, a window pattern.
    v4 = GEMMA3_COMMON | {
        "rope_theta": 100000.0,
        "rope_local_base_freq": 1000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "sliding_window_pattern": 2,
    }
    # transformers 5: rope_parameters per layer type and layer_types.
    v5 = GEMMA3_COMMON | {
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "rope_theta": 100000.0, "factor": 2.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        },
    }
    config = ModelConfig.from_hf(v4)
    assert config == ModelConfig.from_hf(v5)
    assert config.local_layers == (True, False, True, False)
    assert (config.rope_theta, config.rope_local_theta, config.rope_factor) == (1e5, 1e3, 2.0)
    assert (config.norm_offset, config.qk_norm, config.sandwich_norms) == (1.0, True, True)
    assert config.tie_word_embeddings  # Gemma ties unless config.json says otherwise
    # What tpuscore writes beside an Orbax checkpoint reads back equal (tuples through JSON).
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_gemma2_config_without_layer_types_alternates_local_first():
    hf = GEMMA3_COMMON | {
        "model_type": "gemma2",
        "rope_theta": 10000.0,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    }
    config = ModelConfig.from_hf(hf)
    assert config.local_layers == (True, False, True, False)
    assert (config.attn_logit_softcap, config.final_logit_softcap) == (50.0, 30.0)
    assert not config.qk_norm and config.rope_local_theta is None
