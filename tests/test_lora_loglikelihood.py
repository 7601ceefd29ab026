"""LoRA adapters through `Scorer.loglikelihood`, `Scorer.prompt_logprobs` and `/v1/completions`:
every continuation token's log-probability under an adapter equals transformers + peft's (within
1e-4, float32), the base model's K/V cached for a context never serves an adapter's request, and a
bad adapter is refused with the code `score` gives."""

from __future__ import annotations

import numpy as np
import peft
import pytest

from helpers import random_tokens
from hf_reference import load_model
from lora_reference import TOLERANCE, fresh_hf
from test_loglikelihood import VOCAB, hf_continuation
from test_lora_scorer import SERVED, client, lora  # noqa: F401 (its fixtures, used here)
from tpuscore.api.errors import ValidationError


@pytest.fixture(scope="module")
def peft_models(lora):  # noqa: F811
    base, paths, _ = lora
    return {
        name: peft.PeftModel.from_pretrained(fresh_hf(base), path).eval()
        for name, path in paths.items()
    }


def test_loglikelihood_under_each_adapter_matches_peft(lora, peft_models, rng):  # noqa: F811
    base, _, scorer = lora
    context = random_tokens(rng, 12, VOCAB)
    continuations = [random_tokens(rng, n, VOCAB) for n in (1, 5, 9)]
    # The base first: its K/V for the context go to the prefix cache, which must not serve them
    # to the adapters' calls after it.
    plain = scorer.loglikelihood(context, continuations)
    reference = load_model(base)
    for continuation, result in zip(continuations, plain, strict=True):
        picked, _ = hf_continuation(reference, context, continuation)
        np.testing.assert_allclose(result.token_logprobs, picked, atol=TOLERANCE, rtol=0)
    for name, model in peft_models.items():
        results = scorer.loglikelihood(context, continuations, adapter=name)
        for continuation, result, base_result in zip(continuations, results, plain, strict=True):
            picked, greedy = hf_continuation(model, context, continuation)
            np.testing.assert_allclose(
                result.token_logprobs, picked, atol=TOLERANCE, rtol=0, err_msg=name
            )
            assert result.is_greedy == greedy
            assert result.logprob == pytest.approx(picked.sum(), abs=TOLERANCE)
            assert abs(result.logprob - base_result.logprob) > 1e-3  # the adapter moved it


def test_prompt_logprobs_and_completions_under_an_adapter_match_peft(
    lora,  # noqa: F811
    peft_models,
    client,  # noqa: F811
    rng,
):
    _, _, scorer = lora
    prompt = random_tokens(rng, 9, VOCAB)
    picked, _ = hf_continuation(peft_models["rslora"], prompt[:1], prompt[1:])
    (result,) = scorer.prompt_logprobs([prompt], adapter="rslora")
    np.testing.assert_allclose(result.token_logprobs[1:], picked, atol=TOLERANCE, rtol=0)
    body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    tuned = client.post("/v1/completions", json={**body, "model": "rslora"})
    assert tuned.status_code == 200, tuned.text
    assert tuned.json()["model"] == "rslora"
    got = tuned.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert got[0] is None
    np.testing.assert_allclose(got[1:], picked, atol=TOLERANCE, rtol=0)
    plain = client.post("/v1/completions", json={**body, "model": SERVED}).json()
    assert plain["model"] == SERVED
    assert (
        np.abs(np.subtract(plain["choices"][0]["logprobs"]["token_logprobs"][1:], got[1:])).max()
        > 1e-3
    )


@pytest.mark.parametrize("adapter", ["nope", 3, ["rslora"]])
def test_an_adapter_that_is_not_loaded_is_refused_as_score_refuses_it(lora, adapter):  # noqa: F811
    _, _, scorer = lora
    for call in (
        lambda: scorer.loglikelihood([1, 2], [[3]], adapter=adapter),
        lambda: scorer.prompt_logprobs([[1, 2]], adapter=adapter),
        lambda: scorer.score([1, 2], [[3]], label_token_ids=[4], adapter=adapter),
    ):
        with pytest.raises(ValidationError) as e:
            call()
        assert (e.value.code, e.value.param) == ("unknown_adapter", "adapter")


def test_a_classifier_has_no_loglikelihood_under_an_adapter_either(scorers):
    with pytest.raises(ValidationError) as e:
        scorers("llama_seq_cls").loglikelihood([1, 2], [[3]], adapter="any")
    assert e.value.code == "no_language_model_head"
