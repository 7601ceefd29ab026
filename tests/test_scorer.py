"""Facade behaviour: result semantics, labels, registry, determinism, serial == reference."""

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special

from helpers import ALONE_VS_BATCHED, random_tokens
from tpuscore import Scorer, ScoreResult, ValidationError, backends
from tpuscore.backends import BackendOutput
from tpuscore.backends.reference import last_token_logprobs
from tpuscore.backends.serial import SerialBackend


def test_serial_equals_reference(case, scorers, rng):
    scorer = scorers(case)
    vocab = scorer.config.vocab_size
    query = random_tokens(rng, int(rng.integers(0, 60)), vocab)
    # 70 items: more than one serial chunk, lengths spanning several buckets, empty ones included.
    # An empty query needs non-empty items: query + item must hold a token to score after.
    lens = rng.integers(0 if query else 1, 40, size=70)
    items = [random_tokens(rng, int(n), vocab) for n in lens]
    items[0] = [] if query else [7]
    labels = rng.choice(vocab, size=4, replace=False).tolist()
    serial = scorer.score(query, items, labels, backend="serial")
    reference = scorer.score(query, items, labels, backend="reference")
    assert serial.backend == "serial" and reference.backend == "reference"
    np.testing.assert_allclose(serial.logprobs, reference.logprobs, atol=1e-5, rtol=0)
    assert serial.num_tokens == reference.num_tokens == sum(len(query) + len(i) for i in items)


def test_result_semantics(scorers):
    scorer = scorers("qwen3_qknorm")
    plain = scorer.score("the fox", [" jumps", " sleeps", ""], [3, 50, 120, 7])
    soft = scorer.score("the fox", [" jumps", " sleeps", ""], [3, 50, 120, 7], apply_softmax=True)
    assert isinstance(plain, ScoreResult) and plain.logprobs.dtype == np.float32
    assert plain.logprobs.shape == (3, 4) and (plain.logprobs < 0).all()
    np.testing.assert_array_equal(plain.logprobs, soft.logprobs)
    np.testing.assert_allclose(plain.probs, np.exp(plain.logprobs), rtol=1e-6)
    np.testing.assert_allclose(plain.label_probs.sum(axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(
        plain.label_probs,
        scipy.special.softmax(plain.logprobs.astype(np.float64), axis=1),
        rtol=1e-5,
    )
    np.testing.assert_array_equal(plain.scores, plain.probs)
    np.testing.assert_array_equal(soft.scores, soft.label_probs)
    assert plain.probs.sum(axis=1).max() < 1.0  # true probabilities over a few labels only
    with pytest.raises(ValueError):
        plain.logprobs[0, 0] = 0.0  # results are read-only


def test_labels_as_strings_equal_their_token_ids(scorers):
    scorer = scorers("llama3_rope_tied")
    labels = [" the", " a", "x"]  # single tokens in the tiny vocabulary
    ids = [scorer.tokenizer.encode(lab, add_special_tokens=False).ids[0] for lab in labels]
    by_text = scorer.score("The quick brown", [" fox", ""], labels=labels)
    by_ids = scorer.score("The quick brown", [" fox", ""], ids)
    np.testing.assert_array_equal(by_text.logprobs, by_ids.logprobs)


def test_query_gets_special_tokens_and_items_do_not(scorers):
    scorer = scorers("llama3_rope_tied")  # its tokenizer adds BOS
    bos = scorer.tokenizer.token_to_id("<|bos|>")
    query_ids = scorer.tokenizer.encode("the fox").ids
    assert query_ids[0] == bos
    item_ids = scorer.tokenizer.encode(" jumps", add_special_tokens=False).ids
    text = scorer.score("the fox", [" jumps"], [1, 2], backend="serial")
    tokens = scorer.score(query_ids, [item_ids], [1, 2], backend="serial")
    np.testing.assert_array_equal(text.logprobs, tokens.logprobs)
    assert text.num_tokens == len(query_ids) + len(item_ids)


def test_repeated_calls_are_bit_identical(scorers, rng):
    scorer = scorers("qwen2_bias")
    query = random_tokens(rng, 33, scorer.config.vocab_size)
    items = [random_tokens(rng, n, scorer.config.vocab_size) for n in (1, 9, 4)]
    first = scorer.score(query, items, [1, 2, 3]).logprobs
    for _ in range(3):
        np.testing.assert_array_equal(scorer.score(query, items, [1, 2, 3]).logprobs, first)


def test_an_item_scores_the_same_alone_and_in_a_crowd(scorers, rng):
    scorer = scorers("llama_gqa_untied")
    vocab = scorer.config.vocab_size
    query = random_tokens(rng, 21, vocab)
    items = [random_tokens(rng, n, vocab) for n in (5, 30, 2, 17)]
    together = scorer.score(query, items, [4, 9]).logprobs
    for i, item in enumerate(items):
        alone = scorer.score(query, [item], [4, 9]).logprobs
        np.testing.assert_allclose(alone[0], together[i], **ALONE_VS_BATCHED)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScaledOptions:
    factor: float = 1.0


class Scaled(backends.PerGroupBackend):
    """A user backend on the documented contract: the reference's scores times a factor."""

    def __init__(self, model, options: ScaledOptions):
        self.config, self.factor = model.config, options.factor
        self.params = jax.tree.map(np.asarray, model.weights)  # numpy code wants host arrays
        self.batches = []

    def score(self, batch):
        self.batches.append(batch.num_items)
        out = BackendOutput.for_batch(batch)
        for i in range(batch.num_items):
            sequence = batch.sequence(i)
            full = last_token_logprobs(self.config, self.params, sequence)
            out.step("scaled", sequence.shape, len(sequence))
            out.scores([i], self.factor * full[None, batch.label_ids])
        return out.build()


def test_a_user_backend_is_registered_and_selected(scorers):
    backends.register("scaled", Scaled, options=ScaledOptions, item_first=False)
    assert "scaled" in backends.available()
    assert {"serial", "reference"} <= set(backends.available())
    base = scorers("qwen3_qknorm")
    options = {"scaled": {"factor": 2.0}}
    scorer = Scorer(base.config, base.params, base.tokenizer, backend_options=options)
    expected = scorer.score([1, 2], [[3], [4, 5]], [6, 7], backend="reference")
    mine = scorer.score([1, 2], [[3], [4, 5]], [6, 7], backend="scaled")
    assert mine.backend == "scaled" and scorer.get_backend("scaled").batches == [2]
    assert mine.num_tokens == expected.num_tokens == 2 * 2 + 3
    np.testing.assert_allclose(mine.logprobs, 2 * expected.logprobs, rtol=1e-6)
    with pytest.raises(ValidationError) as err:  # declared at registration: no items first
        scorer.score([1, 2], [[3]], [6], item_first=True, backend="scaled")
    assert err.value.code == "unsupported_option"
    with pytest.raises(ValidationError) as err:
        Scorer(base.config, base.params, base.tokenizer, backend_options={"scaled": {"f": 2}})
    assert err.value.code == "invalid_backend_option"
    assert err.value.param == "backend_options.scaled.f"


def test_register_rejects_bad_names_factories_and_capabilities():
    with pytest.raises(ValueError):
        backends.register("auto", SerialBackend)
    with pytest.raises(ValueError):
        backends.register("", SerialBackend)
    with pytest.raises(TypeError):
        backends.register("x", "not callable")
    with pytest.raises(ValueError):
        backends.register("x", SerialBackend, options=dict)
    with pytest.raises(ValueError):
        backends.register("x", SerialBackend, compiled_on={"cuda"})
    assert "x" not in backends.available()


def test_bfloat16_scores_track_float32(scorers, rng):
    f32 = scorers("llama_gqa_untied")
    bf16 = Scorer(f32.config, f32.params, f32.tokenizer, dtype="bfloat16")
    assert jax.tree.leaves(bf16.params)[0].dtype == jnp.bfloat16
    query = random_tokens(rng, 50, f32.config.vocab_size)
    items = [random_tokens(rng, n, f32.config.vocab_size) for n in (0, 4, 13)]
    exact = f32.score(query, items, [1, 2, 3]).logprobs
    rounded = bf16.score(query, items, [1, 2, 3]).logprobs
    assert rounded.dtype == np.float32
    np.testing.assert_allclose(rounded, exact, atol=0.1, rtol=0)  # bf16 weights: loose by design


def test_unknown_dtype_is_rejected(scorers):
    with pytest.raises(ValueError, match="dtype must be one of"):
        Scorer(scorers("qwen2_bias").config, scorers("qwen2_bias").params, None, dtype="float16")


def test_threads_get_their_sequential_results(scorers, rng):
    scorer = scorers("qwen3_qknorm")
    vocab = scorer.config.vocab_size
    requests = [
        (random_tokens(rng, int(q), vocab), [random_tokens(rng, int(n), vocab) for n in lens])
        for q, lens in [(5, (1, 2)), (40, (9,)), (0, (3, 3, 3)), (77, (0, 20))]
    ]
    sequential = [scorer.score(q, items, [1, 2]).logprobs for q, items in requests]
    with ThreadPoolExecutor(max_workers=4) as pool:
        for _ in range(3):
            futures = [pool.submit(scorer.score, q, items, [1, 2]) for q, items in requests]
            for future, expected in zip(futures, sequential, strict=True):
                np.testing.assert_array_equal(future.result().logprobs, expected)


def test_a_fresh_engine_shares_the_model_and_not_the_backends(scorers, rng):
    base = scorers("qwen3_qknorm")
    scorer = Scorer(base.config, base.params, base.tokenizer)
    query = random_tokens(rng, 9, scorer.config.vocab_size)
    first = scorer.score(query, [[1], [2, 3]], [4], backend="prefill_extend")
    engine = scorer.engine.fresh()
    assert engine.model is scorer.engine.model and engine.backends is not scorer.backends
    again = engine.run([scorer.prepare(query, [[1], [2, 3]], [4])], backend="prefill_extend")
    np.testing.assert_array_equal(again[0].logprobs, first.logprobs)
    assert engine.backends.get("prefill_extend").cache.misses == 1  # its own, empty cache
    assert scorer.get_backend("prefill_extend").cache.misses == 1
