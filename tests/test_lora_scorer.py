"""LoRA adapters through the Scorer: every backend that runs them against transformers + peft.

One tiny random base and three peft-built adapters (test_lora.py's, different ranks, alphas,
rsLoRA, targets and a layer subset) loaded by `Scorer.from_pretrained(base, adapters=...)`. One
`score_batch` mixes every adapter and the base, one query under several adapters among them, and
each supporting backend's scores equal peft's with that adapter (and merged into the weights)
within 1e-4 in float32. The prefix cache is checked to keep adapters apart, and bad requests to
be refused with typed errors.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import fresh, random_tokens, seeded_rng
from hf_reference import MODEL_VOCAB_SIZE, hf_logprobs, make_checkpoint
from lora_reference import ADAPTERS, TOLERANCE, peft_logprobs, save_adapter
from tpuscore import Scorer
from tpuscore.api.errors import ValidationError
from tpuscore.backends import registry

# packed_segment runs its Pallas kernel in interpret mode on CPU: right, but slow; its rows reach
# the decoder exactly as packed_dense's do, so CPU checks packed_dense (docs/adapters.md).
BACKENDS = ["prefill_extend", "serial", "packed_dense"]


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """(base path, adapter paths by name, a scorer with the adapters)."""
    root = tmp_path_factory.mktemp("lora_scorer")
    base = make_checkpoint(root / "base", "llama_gqa_untied", seed=3)
    paths = {
        name: save_adapter(base, root / name, seed=10 + i, **kwargs)
        for i, (name, kwargs) in enumerate(ADAPTERS.items())
    }
    return base, paths, Scorer.from_pretrained(base, dtype="float32", adapters=paths)


@pytest.fixture(scope="module")
def traffic(lora):
    """Requests mixing the adapters and the base, with their peft scores (unmerged, merged).

    The first query runs under every adapter and the base, so a group keyed by query alone (or a
    prefix cache keyed by tokens alone) would give one adapter's K/V to another."""
    base, paths, _ = lora
    rng = seeded_rng("test_lora_scorer.traffic")
    labels = rng.choice(MODEL_VOCAB_SIZE, size=3, replace=False).tolist()
    shared = random_tokens(rng, 23, MODEL_VOCAB_SIZE)
    requests = []
    for adapter in [None, *paths, *paths]:
        query = shared if len(requests) <= len(paths) else random_tokens(rng, 17, MODEL_VOCAB_SIZE)
        items = [random_tokens(rng, int(rng.integers(3, 9)), MODEL_VOCAB_SIZE) for _ in range(3)]
        requests.append(
            {"query": query, "items": items, "label_token_ids": labels, "adapter": adapter}
        )
    expected = []
    for request in requests:
        seqs = [request["query"] + item for item in request["items"]]
        name = request["adapter"]
        if name is None:
            want = hf_logprobs(base, seqs, labels)
            expected.append((want, want))
        else:
            expected.append(
                tuple(peft_logprobs(base, paths[name], seqs, labels, merged) for merged in (0, 1))
            )
    return requests, expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_adapters_match_peft(lora, traffic, backend):
    _, _, scorer = lora
    requests, expected = traffic
    results = fresh(scorer).score_batch(requests, backend=backend)
    for request, result, (unmerged, merged) in zip(requests, results, expected, strict=True):
        where = f"{backend} adapter={request['adapter']}"
        assert result.backend == backend
        np.testing.assert_allclose(result.logprobs, unmerged, atol=TOLERANCE, rtol=0, err_msg=where)
        np.testing.assert_allclose(result.logprobs, merged, atol=TOLERANCE, rtol=0, err_msg=where)


def test_mixed_batch_equals_each_adapter_alone(lora, traffic):
    """A score_batch mixing adapters (prefill_extend runs their leftover items in shared extend
    steps, each row its own adapter) equals each request scored alone."""
    _, _, scorer = lora
    requests, _ = traffic
    mixed = fresh(scorer).score_batch(requests, backend="prefill_extend")
    assert len({r["adapter"] for r in requests}) == len(ADAPTERS) + 1
    for request, result in zip(requests, mixed, strict=True):
        alone = fresh(scorer).score(**request, backend="prefill_extend")
        np.testing.assert_allclose(result.logprobs, alone.logprobs, atol=1e-5, rtol=0)


def test_auto_and_rank_take_the_adapter(lora, traffic):
    _, paths, scorer = lora
    requests, expected = traffic
    request, (want, _) = requests[1], expected[1]
    got = scorer.score(**request)  # auto
    assert registry.registration(got.backend).capabilities.adapters
    np.testing.assert_allclose(got.logprobs, want, atol=TOLERANCE, rtol=0)
    ranked = scorer.rank(
        request["query"], request["items"], label_token_ids=request["label_token_ids"],
        adapter=request["adapter"],
    )  # fmt: skip
    by_item = {item.index: item for item in ranked}
    probs = np.exp(want[:, 0]) / np.exp(want).sum(axis=1)
    for i, p in enumerate(probs):
        assert by_item[i].score == pytest.approx(p, abs=1e-4)


def test_prefix_cache_is_keyed_by_adapter(lora, traffic):
    """One query scored under one adapter, then (from the cache, a call later) under another and
    the base, then a longer query sharing it as a prefix: each equals peft with its own adapter.
    A cache keyed by tokens alone hands the first adapter's K/V to the later calls."""
    base, paths, scorer = lora
    requests, expected = traffic
    scorer = fresh(scorer)
    backend = scorer.get_backend("prefill_extend")
    order = [2, 1, 0, 3]  # rslora, attn_mlp, the base, all_one_layer: all on the shared query
    for i in order:
        got = scorer.score(**requests[i], backend="prefill_extend")
        np.testing.assert_allclose(got.logprobs, expected[i][0], atol=TOLERANCE, rtol=0)
    assert backend.cache.hits == 0 and len(backend.cache) == len(order)
    again = scorer.score(**requests[1], backend="prefill_extend")  # an exact hit of its own
    assert backend.cache.hits == 1
    np.testing.assert_allclose(again.logprobs, expected[1][0], atol=TOLERANCE, rtol=0)
    # A partial hit stays within the adapter: the shared query plus 5 tokens, under attn_mlp.
    longer = dict(requests[1], query=requests[1]["query"] + requests[4]["query"][:5])
    got = scorer.score(**longer, backend="prefill_extend")
    assert backend.cache.partial_hits == 1
    seqs = [longer["query"] + item for item in longer["items"]]
    want = peft_logprobs(base, paths["attn_mlp"], seqs, longer["label_token_ids"], False)
    np.testing.assert_allclose(got.logprobs, want, atol=TOLERANCE, rtol=0)


def test_unknown_adapter_is_refused(lora, traffic):
    _, _, scorer = lora
    requests, _ = traffic
    with pytest.raises(ValidationError) as info:
        scorer.score(**dict(requests[0], adapter="nope"))
    assert info.value.code == "unknown_adapter" and info.value.loc == ("adapter",)
    assert "'attn_mlp', 'rslora', 'all_one_layer'" in str(info.value)
    batch = [requests[0], dict(requests[1], adapter="nope")]
    with pytest.raises(ValidationError) as info:
        scorer.score_batch(batch)
    assert info.value.loc == ("requests", 1, "adapter")
    assert scorer.adapters == list(ADAPTERS)


def test_backend_without_adapters_is_refused(lora, traffic):
    _, _, scorer = lora
    requests, expected = traffic
    with pytest.raises(ValidationError, match="does not run LoRA adapters") as info:
        scorer.score(**requests[1], backend="reference")
    assert info.value.code == "adapter_unsupported"
    base = scorer.score(**requests[0], backend="reference")  # the base model runs anywhere
    np.testing.assert_allclose(base.logprobs, expected[0][0], atol=TOLERANCE, rtol=0)


def test_bad_adapters_argument_is_located(lora, tmp_path):
    base, _, _ = lora
    with pytest.raises(ValidationError) as info:
        Scorer.from_pretrained(base, dtype="float32", adapters={"gone": tmp_path / "missing"})
    assert info.value.code == "adapter_not_found" and info.value.loc == ("adapters", "gone")
