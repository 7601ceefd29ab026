"""LoRA adapters (models/adapters.py and the decoder's batched low-rank product) against peft.

Tiny random adapters built by peft (different ranks, alphas, rsLoRA, target modules, a layer
subset and a classification head) on a tiny random base; a batch mixing every adapter and rows
without one is scored by the decoder and compared with transformers + peft running that adapter
(and with it merged into the weights), each sequence alone.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch

from helpers import random_tokens, seeded_rng
from hf_reference import MODEL_VOCAB_SIZE, make_checkpoint
from lora_reference import ADAPTERS, TOLERANCE, fresh_hf, peft_logprobs, save_adapter
from tpuscore.api.errors import ValidationError
from tpuscore.models import decoder
from tpuscore.models.adapters import RowAdapters, load_adapter, stack_adapters
from tpuscore.models.attention import attend, within_window
from tpuscore.models.loaders import load


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_checkpoint(root / "base", "llama_gqa_untied", seed=3)
    paths = {
        name: save_adapter(base, root / name, seed=10 + i, **kwargs)
        for i, (name, kwargs) in enumerate(ADAPTERS.items())
    }
    return base, paths


@functools.partial(jax.jit, static_argnames="config")
def _score(params, tokens, lengths, label_ids, config, adapters=None):
    """serial's step, with adapters: label logprobs at each row's last real token."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))

    def attention(q, k, v, layer):
        window = within_window(positions, positions, layer.window)
        return attend(q, k, v, causal & window, layer)

    hidden = decoder.forward(params, config, tokens, positions, attention, adapters)
    last = hidden[jnp.arange(B), lengths - 1]
    return decoder.label_logprobs(params, config, last, label_ids, adapters)


def _padded(seqs):
    T = max(map(len, seqs))
    tokens = np.zeros((len(seqs), T), np.int32)
    for i, seq in enumerate(seqs):
        tokens[i, : len(seq)] = seq
    return jnp.asarray(tokens), jnp.asarray([len(s) for s in seqs], jnp.int32)


def test_mixed_adapter_batch_matches_peft_and_merged(lora_setup, request):
    base, paths = lora_setup
    rng = seeded_rng(request.node.nodeid)
    config, params, _ = load(base, dtype=np.float32)
    names = list(paths)
    stack = stack_adapters([load_adapter(paths[n], config) for n in names], config)
    # Every adapter twice and two base rows, shuffled; lengths long enough to exercise RoPE.
    index = rng.permutation(np.array([0, 0] + [i for i in range(1, len(names) + 1)] * 2))
    seqs = [random_tokens(rng, int(rng.integers(20, 48)), MODEL_VOCAB_SIZE) for _ in index]
    labels = rng.choice(MODEL_VOCAB_SIZE, size=4, replace=False).tolist()
    tokens, lengths = _padded(seqs)
    label_ids = jnp.asarray(labels, jnp.int32)

    got = np.asarray(
        _score(params, tokens, lengths, label_ids, config, RowAdapters(stack, jnp.asarray(index)))
    )
    plain = np.asarray(_score(params, tokens, lengths, label_ids, config))
    base_rows = index == 0
    np.testing.assert_array_equal(got[base_rows], plain[base_rows])  # bit-identical
    for i, name in enumerate(names, start=1):
        rows = np.flatnonzero(index == i)
        for merged in (False, True):
            want = peft_logprobs(base, paths[name], [seqs[r] for r in rows], labels, merged)
            np.testing.assert_allclose(
                got[rows], want, atol=TOLERANCE, rtol=0, err_msg=f"{name} merged={merged}"
            )
        # the adapter really moves the scores, so the comparison above could fail
        assert np.abs(got[rows] - plain[rows]).max() > 100 * TOLERANCE, name


def test_classification_head_in_modules_to_save(tmp_path, request):
    rng = seeded_rng(request.node.nodeid)
    base = make_checkpoint(tmp_path / "base", "qwen2_seq_cls", seed=5)
    path = save_adapter(
        base, tmp_path / "cls", seed=21, classifier=True, r=4, lora_alpha=3,
        target_modules=["v_proj", "up_proj"],
    )  # fmt: skip
    config, params, _ = load(base, dtype=np.float32)
    adapter = load_adapter(path, config)
    assert adapter.score is not None
    stack = stack_adapters([adapter], config)
    index = np.array([1, 0, 1])
    seqs = [random_tokens(rng, int(rng.integers(10, 30)), MODEL_VOCAB_SIZE) for _ in index]
    tokens, lengths = _padded(seqs)
    classes = jnp.arange(config.num_labels, dtype=jnp.int32)
    got = np.asarray(
        _score(params, tokens, lengths, classes, config, RowAdapters(stack, jnp.asarray(index)))
    )
    plain = np.asarray(_score(params, tokens, lengths, classes, config))
    np.testing.assert_array_equal(got[1], plain[1])
    model = peft.PeftModel.from_pretrained(fresh_hf(base, classifier=True), path).eval()
    for row in (0, 2):
        with torch.no_grad():
            want = model(input_ids=torch.tensor([seqs[row]])).logits[0].double().numpy()
        np.testing.assert_allclose(got[row], want, atol=TOLERANCE, rtol=0)
        assert np.abs(got[row] - plain[row]).max() > 100 * TOLERANCE


def _edit_config(path, **changes):
    file = path / "adapter_config.json"
    file.write_text(json.dumps(json.loads(file.read_text()) | changes))


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"peft_type": "IA3"}, "peft_type 'IA3'"),
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "bias='all'"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
        ({"r": 4}, "shape (3, 42), expected (4, 42)"),
    ],
)
def test_unsupported_or_mismatched_adapters_are_refused(lora_setup, tmp_path, changes, words):
    base, paths = lora_setup
    config, _, _ = load(base, dtype=np.float32)
    copy = tmp_path / "adapter"
    copy.mkdir()
    for file in paths["attn_mlp"].iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    _edit_config(copy, **changes)
    with pytest.raises(ValidationError, match="adapter") as info:
        load_adapter(copy, config)
    assert words in str(info.value)
    assert info.value.code in {"adapter_unsupported", "adapter_mismatch"}


@pytest.mark.parametrize("name", ["adapter_config.json", "adapter_model.safetensors"])
def test_an_adapter_file_cut_short_is_adapter_invalid(lora_setup, tmp_path, name):
    """A cut copy or download of either file is the adapter's error, naming the file (the
    safetensors parser's own error is not even a ValueError)."""
    base, paths = lora_setup
    config, _, _ = load(base, dtype=np.float32)
    copy = tmp_path / "adapter"
    copy.mkdir()
    for file in paths["attn_mlp"].iterdir():
        data = file.read_bytes()
        (copy / file.name).write_bytes(data[: len(data) // 2] if file.name == name else data)
    with pytest.raises(ValidationError, match=name) as info:
        load_adapter(copy, config)
    assert info.value.code == "adapter_invalid"


def test_adapter_for_another_model_is_refused(lora_setup, tmp_path):
    """An adapter of a model with other dimensions and a module this decoder has no LoRA for."""
    _, paths = lora_setup
    other = make_checkpoint(tmp_path / "other", "qwen3_qknorm", seed=1)
    config, _, _ = load(other, dtype=np.float32)
    with pytest.raises(ValidationError, match="shape") as info:
        load_adapter(paths["attn_mlp"], config)
    assert info.value.code == "adapter_mismatch"
    base, _ = lora_setup
    lm_head = save_adapter(base, tmp_path / "head", seed=2, r=2, target_modules=["lm_head"])
    config, _, _ = load(base, dtype=np.float32)
    with pytest.raises(ValidationError, match="not a LoRA weight of a decoder projection"):
        load_adapter(lm_head, config)


@functools.partial(jax.jit, static_argnames=("config", "split"))
def _score_extended(params, tokens, label_ids, config, adapters, split):
    """Each row's first `split` tokens as its own prefix (extended from an empty one under the
    row's adapter), then the rest extending it: label logprobs at the last token."""
    B, T = tokens.shape
    L, K, H = config.num_layers, config.num_kv_heads, config.head_dim
    empty = decoder.Prefix(
        k=jnp.zeros((L, B, K, H, 1)),
        v=jnp.zeros((L, B, K, 1, H)),
        length=jnp.zeros(B, jnp.int32),
        last_hidden=jnp.zeros((B, config.hidden_size)),
    )
    causal = lambda n: jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (B, n, n))  # noqa: E731
    rows = jnp.arange(B)
    _, (k, v) = decoder.extend(
        params, config, empty, tokens[:, :split], causal(split),
        rows=rows, return_kv=True, adapters=adapters,
    )  # fmt: skip
    prefix = decoder.Prefix(
        k=k.transpose(0, 1, 3, 4, 2),
        v=v.transpose(0, 1, 3, 2, 4),
        length=jnp.full(B, split, jnp.int32),
        last_hidden=empty.last_hidden,
    )
    hidden, _ = decoder.extend(
        params, config, prefix, tokens[:, split:], causal(T - split), rows=rows, adapters=adapters
    )
    return decoder.label_logprobs(params, config, hidden[:, -1], label_ids, adapters)


def test_extend_with_adapters_equals_forward(lora_setup, request):
    """The prefix path (a prefix computed under each row's adapter, then continued) gives the
    full-sequence forward's scores, which the test above ties to peft."""
    base, paths = lora_setup
    rng = seeded_rng(request.node.nodeid)
    config, params, _ = load(base, dtype=np.float32)
    stack = stack_adapters([load_adapter(p, config) for p in paths.values()], config)
    index = jnp.asarray(rng.permutation(np.arange(len(paths) + 1)))
    T = 29
    tokens = jnp.asarray(rng.integers(0, MODEL_VOCAB_SIZE, size=(len(index), T)), jnp.int32)
    labels = jnp.asarray(rng.choice(MODEL_VOCAB_SIZE, size=3, replace=False), jnp.int32)
    adapters = RowAdapters(stack, index)
    lengths = jnp.full(len(index), T, jnp.int32)
    want = np.asarray(_score(params, tokens, lengths, labels, config, adapters))
    got = np.asarray(_score_extended(params, tokens, labels, config, adapters, split=17))
    np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)
