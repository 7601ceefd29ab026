"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers loading
the same file."""

import numpy as np
import pytest

from hf_reference import model_logprobs
from tpuscore import Scorer

pytestmark = pytest.mark.default_model
ATOL = 1e-3  # float32; the dequantized weights are bit-identical (test_gguf.py)


@pytest.fixture(scope="module")
def scorer(default_model_path):
    return Scorer.from_pretrained(dtype="float32")


def test_its_config_is_the_one_the_lowering_test_lowers(scorer):
    from helpers import SMOLLM2_135M

    assert scorer.config == SMOLLM2_135M


@pytest.mark.slow  # loads transformers' own copy of the model
def test_capital_of_france(scorer, hf_default_model):
    result = scorer.score("The capital of France is", [""], labels=[" Paris", " London"])
    query = scorer.tokenizer.encode("The capital of France is").ids
    labels = [scorer.tokenizer.token_to_id(t) for t in ("ĠParis", "ĠLondon")]
    expected = model_logprobs(hf_default_model, [query], labels)
    np.testing.assert_allclose(result.logprobs, expected, atol=ATOL, rtol=0)
    assert result.logprobs[0, 0] == pytest.approx(-0.258, abs=0.01)
    assert result.logprobs[0, 1] == pytest.approx(-4.384, abs=0.01)


QUERY = (
    "<|im_start|>user\nYou rank products for a shopper. The shopper bought hiking boots, a "
    "rain jacket and a headlamp last month, and reads reviews about trail running, camping "
    "gear and lightweight cooking. Is the following product relevant? Answer yes or no.\n"
)
ITEMS = [
    "Product: ultralight titanium camping stove<|im_end|>\n<|im_start|>assistant\n",
    "Product: porcelain tea set with gold rim<|im_end|>\n<|im_start|>assistant\n",
    "",
    " Produit: lampe frontale 400 lumens, étanche 🙂",
]


@pytest.mark.parametrize("item_first", [False, True])
def test_parity_with_transformers(scorer, hf_default_model, item_first):
    labels = [" yes", " no", "yes", "no"]
    result = scorer.score(QUERY, ITEMS, labels=labels, item_first=item_first)
    query = scorer.tokenizer.encode(QUERY).ids
    items = [scorer.tokenizer.encode(i, add_special_tokens=False).ids for i in ITEMS]
    sequences = [i + query if item_first else query + i for i in items]
    label_ids = [scorer.tokenizer.encode(lab, add_special_tokens=False).ids[0] for lab in labels]
    expected = model_logprobs(hf_default_model, sequences, label_ids)
    np.testing.assert_allclose(result.logprobs, expected, atol=ATOL, rtol=0)
    reference = scorer.score(
        QUERY, ITEMS, labels=labels, item_first=item_first, backend="reference"
    )
    np.testing.assert_allclose(result.logprobs, reference.logprobs, atol=1e-4, rtol=0)
