"""loglikelihood(): per-token log-probabilities of continuations equal transformers and serial
scoring; text follows lm-evaluation-harness's split; bad input has its code."""

import numpy as np
import pytest
import torch

from helpers import random_tokens
from hf_reference import load_model
from tpuscore import Scorer, ValidationError

VOCAB = 313  # the tokenizer's; the models' is 331
ATOL = 1e-4
# Runs share shapes so the steps compile few times: a context of at most 16 tokens and four
# continuations of at most 16 (or, for text, 4).
CONTEXT_LEN = 12


def hf_continuation(model, context, continuation):
    """transformers' log P(token | everything before) per continuation token (float64), and
    whether each token is the argmax."""
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].to(torch.float64)
    before = logits[len(context) - 1 : len(context) + len(continuation) - 1]  # [n, V]
    logprobs = torch.log_softmax(before, dim=-1)
    target = torch.tensor(continuation)
    picked = logprobs[torch.arange(len(continuation)), target].numpy()
    return picked, bool((logprobs.argmax(dim=-1) == target).all())


def hf_greedy(model, context, n):
    tokens = list(context)
    for _ in range(n):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, -1]
        tokens.append(int(logits.argmax()))
    return tokens[len(context) :]


def test_matches_transformers(scorers, checkpoint_dir, case, rng):
    model = load_model(checkpoint_dir(case))
    context = random_tokens(rng, CONTEXT_LEN, VOCAB)
    continuations = [random_tokens(rng, n, VOCAB) for n in (1, 6, 16)]
    continuations.append(hf_greedy(model, context, 4))
    results = scorers(case).loglikelihood(context, continuations)
    for continuation, result in zip(continuations, results, strict=True):
        picked, greedy = hf_continuation(model, context, continuation)
        np.testing.assert_allclose(result.token_logprobs, picked, atol=ATOL, rtol=0)
        assert result.logprob == pytest.approx(picked.sum(), abs=ATOL)
        assert result.is_greedy == greedy
        assert result.num_tokens == len(continuation) == len(result.token_logprobs)
    assert results[-1].is_greedy  # the greedy continuation is greedy
    assert not results[1].is_greedy  # a random one is not (the chance is about 331^-6)


def test_equals_summing_serial_scores_per_token(scorers, rng):
    scorer = scorers("llama3_rope_tied")
    context = random_tokens(rng, CONTEXT_LEN, VOCAB)
    continuations = [random_tokens(rng, n, VOCAB) for n in (3, 9)]
    results = scorer.loglikelihood(context, continuations)
    # Token j of a continuation, scored by serial as the label after context + the tokens
    # before it: one serial call over every prefix, with every continuation token a label.
    labels = [t for c in continuations for t in c]
    prefixes = [c[:j] for c in continuations for j in range(len(c))]
    serial = scorer.score(context, prefixes, labels, backend="serial").logprobs
    per_token = np.diag(serial)  # prefix k's own next token is label k
    start = 0
    for continuation, result in zip(continuations, results, strict=True):
        expected = per_token[start : start + len(continuation)]
        start += len(continuation)
        np.testing.assert_allclose(result.token_logprobs, expected, atol=ATOL, rtol=0)
        assert result.logprob == pytest.approx(expected.astype(np.float64).sum(), abs=ATOL)


def test_text_moves_the_context_trailing_whitespace_to_the_continuations(scorers):
    scorer = scorers("llama3_rope_tied")  # its tokenizer adds a BOS to the context only
    got = scorer.loglikelihood("The answer is ", ["fox", " the lazy dog", "12", "\n"])

    def encode(text, special=False):
        return scorer.tokenizer.encode(text, add_special_tokens=special).ids

    expected = scorer.loglikelihood(
        encode("The answer is", special=True),
        [encode(" fox"), encode("  the lazy dog"), encode(" 12"), encode(" \n")],
    )
    assert encode("The answer is", special=True)[0] == scorer.tokenizer.token_to_id("<|bos|>")
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a.token_logprobs, b.token_logprobs)
        assert (a.logprob, a.is_greedy, a.num_tokens) == (b.logprob, b.is_greedy, b.num_tokens)
    # An empty context is its BOS on this tokenizer.
    texts = ["fox", "dog", "the", "12"]
    empty = scorer.loglikelihood("", texts)
    bos = scorer.loglikelihood(encode("", special=True), [encode(t) for t in texts])
    for a, b in zip(empty, bos, strict=True):
        np.testing.assert_array_equal(a.token_logprobs, b.token_logprobs)


def test_the_context_is_prefilled_once_and_cached(scorers, rng):
    scorer = scorers("llama3_rope_tied")
    cache = scorer.get_backend("prefill_extend").cache
    context = random_tokens(rng, CONTEXT_LEN + 2, VOCAB)
    hits = cache.hits
    first = scorer.loglikelihood(context, [random_tokens(rng, 4, VOCAB) for _ in range(4)])
    assert cache.hits == hits
    again = scorer.loglikelihood(context, [random_tokens(rng, 4, VOCAB) for _ in range(3)] + [[5]])
    assert cache.hits == hits + 1
    assert len(first) == len(again) == 4


def test_many_batches_equal_one(checkpoint_dir, scorers, rng):
    # An activation budget that holds two rows of [16, vocab] log-probabilities per batch.
    small = Scorer.from_pretrained(
        checkpoint_dir("llama3_rope_tied"),
        dtype="float32",
        backend_options={"prefill_extend": {"activation_bytes": 150_000}},
    )
    context = random_tokens(rng, CONTEXT_LEN, VOCAB)
    continuations = [random_tokens(rng, n, VOCAB) for n in (16, 13, 15, 14)]
    batched = small.loglikelihood(context, continuations)
    whole = scorers("llama3_rope_tied").loglikelihood(context, continuations)
    for a, b in zip(batched, whole, strict=True):
        np.testing.assert_allclose(a.token_logprobs, b.token_logprobs, atol=1e-5, rtol=0)
        assert a.is_greedy == b.is_greedy


BAD = [
    # (code, param, context, continuations, kwargs)
    ("empty_continuation", "continuations[1]", "q", ["a", ""], {}),
    ("empty_continuation", "continuations[0]", [1, 2], [[]], {}),
    ("empty_sequence", "context", [], [[1]], {}),
    ("invalid_query", "context", None, ["a"], {}),
    ("invalid_items", "continuations", "q", "a", {}),
    ("invalid_items", "continuations[0]", "q", [None], {}),
    ("mixed_input_types", "continuations[0]", "q", [[1]], {}),
    ("mixed_input_types", "continuations[1]", [1], [[1], "a"], {}),
    ("invalid_text", "context", "\ud800", ["a"], {}),
    ("invalid_text", "continuations[1]", "q", ["a", "b\udc80"], {}),
    ("token_id_exceeds_vocab", "continuations[0]", [1], [[331]], {}),
    ("token_id_negative", "context", [-1], [[1]], {}),
    ("sequence_too_long", "continuations[0]", [1] * 500, [[1] * 13], {}),
    ("unsupported_option", "backend", "q", ["a"], {"backend": "serial"}),
    ("unknown_backend", "backend", "q", ["a"], {"backend": "nope"}),
]


@pytest.mark.parametrize(
    "code, param, context, continuations, kwargs", BAD, ids=[b[1] for b in BAD]
)
def test_bad_input_raises_its_code(scorers, code, param, context, continuations, kwargs):
    with pytest.raises(ValidationError) as raised:
        scorers("llama3_rope_tied").loglikelihood(context, continuations, **kwargs)
    assert (raised.value.code, raised.value.param) == (code, param)


def test_an_empty_text_context_without_bos_is_an_error(scorers):
    with pytest.raises(ValidationError) as raised:
        scorers("qwen3_qknorm").loglikelihood("   ", ["a"])  # no BOS; whitespace moves out
    assert (raised.value.code, raised.value.param) == ("empty_sequence", "context")
