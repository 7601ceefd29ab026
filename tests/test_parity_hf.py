"""Every backend against Hugging Face transformers on tiny random checkpoints of each family."""

import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast

from helpers import random_tokens
from hf_reference import hf_logprobs

BACKENDS = ("serial", "prefill_extend", "packed_dense", "packed_segment", "reference")
ITEM_FIRST_BACKENDS = ("serial", "reference")  # the others need the query first
ATOL = 1e-4  # float32


@pytest.mark.parametrize("query_len", [1, 300])
def test_token_inputs_match_transformers(case, checkpoint_dir, scorers, rng, query_len):
    scorer = scorers(case)
    vocab = scorer.config.vocab_size
    query = random_tokens(rng, query_len, vocab)
    items = [random_tokens(rng, n, vocab) for n in (0, 1, 6, 29)]
    labels = rng.choice(vocab, size=5, replace=False).tolist()
    expected = hf_logprobs(checkpoint_dir(case), [query + item for item in items], labels)
    for backend in BACKENDS:
        got = scorer.score(query, items, labels, backend=backend).logprobs
        np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0, err_msg=backend)


def test_item_first_matches_transformers(case, checkpoint_dir, scorers, rng):
    scorer = scorers(case)
    vocab = scorer.config.vocab_size
    query = random_tokens(rng, 17, vocab)
    items = [random_tokens(rng, n, vocab) for n in (3, 0, 11)]
    labels = rng.choice(vocab, size=3, replace=False).tolist()
    expected = hf_logprobs(checkpoint_dir(case), [item + query for item in items], labels)
    for backend in ITEM_FIRST_BACKENDS:
        got = scorer.score(query, items, labels, item_first=True, backend=backend).logprobs
        np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0, err_msg=backend)


TEXT_ITEMS = ["", " yes", " the lazy dog", " naïve café 東京 🙂", "\n\n  spaced   out\t"]


# Token inputs above cover every family at both lengths; text adds tokenization, so the lengths
# rotate through the families.
@pytest.mark.slow  # long; token-input parity stays in the quick loop
@pytest.mark.parametrize(
    ("case", "query_words"),
    [("llama_gqa_untied", 1), ("llama3_rope_tied", 120), ("qwen2_bias", 1), ("qwen3_qknorm", 120)],
)
def test_text_inputs_match_transformers(case, checkpoint_dir, scorers, rng, query_words):
    scorer = scorers(case)
    words = ["fox", "market", "Paris", "token", "model", "the", "é", "42"]
    query = " ".join(rng.choice(words, size=query_words))
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(checkpoint_dir(case) / "tokenizer.json")
    )
    query_ids = hf_tokenizer(query, add_special_tokens=True)["input_ids"]
    item_ids = [hf_tokenizer(item, add_special_tokens=False)["input_ids"] for item in TEXT_ITEMS]
    labels = [5, 77, 300]
    expected = hf_logprobs(checkpoint_dir(case), [query_ids + ids for ids in item_ids], labels)
    for backend in BACKENDS:
        text = scorer.score(query, TEXT_ITEMS, labels, backend=backend)
        np.testing.assert_allclose(text.logprobs, expected, atol=ATOL, rtol=0, err_msg=backend)
        tokens = scorer.score(query_ids, item_ids, labels, backend=backend)
        np.testing.assert_array_equal(text.logprobs, tokens.logprobs)
