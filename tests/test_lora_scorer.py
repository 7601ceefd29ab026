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

from helpers import ServerThread, fresh, random_tokens, seeded_rng
from hf_reference import MODEL_VOCAB_SIZE, hf_logprobs, make_checkpoint
from lora_reference import ADAPTERS, TOLERANCE, peft_logprobs, save_adapter
from tpuscore import Scorer
from tpuscore.api import templates
from tpuscore.api.errors import ValidationError
from tpuscore.backends import registry

# packed_segment runs its Pallas kernel in interpret mode on CPU: slow, but the adapters' rows
# must be checked through it too.
BACKENDS = ["prefill_extend", "serial", "packed_dense", "packed_segment"]


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


# -- the server: `model` picks the adapter ------------------------------------------------------

SERVED = "tiny-base"


@pytest.fixture(scope="module")
def client(lora):
    import httpx

    from tpuscore.serving import app as server

    _, _, scorer = lora
    template = templates.Template(
        name="lora",
        query="Query: {query}\n",
        item="Document: {item}",
        item_suffix=None,
        labels=("y", "n"),
        default_instruction=None,
    )  # the tiny tokenizer's labels are single tokens
    app = server.create_app(fresh(scorer), model_name=SERVED, rerank_template=template)
    running = ServerThread(app)
    with httpx.Client(base_url=running.url, timeout=120) as c:
        yield c
    running.stop()


def test_v1_models_lists_the_base_and_its_adapters(client):
    cards = client.get("/v1/models").json()["data"]
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
        (SERVED, None, SERVED),
        *((name, SERVED, SERVED) for name in ADAPTERS),
    ]


def test_the_model_field_selects_the_adapter(client, traffic):
    """SGLang's /v1/score: an adapter's name scores with it (peft's scores), the served name and
    no model with the base; concurrent requests for different adapters share the Batcher."""
    requests, expected = traffic
    from concurrent.futures import ThreadPoolExecutor

    def body(request, model):
        keys = ("query", "items", "label_token_ids")
        return {**{k: request[k] for k in keys}, "model": model}

    calls = [(requests[i], requests[i]["adapter"] or SERVED, expected[i][0]) for i in range(4)]
    calls.append((requests[0], None, expected[0][0]))
    with ThreadPoolExecutor(len(calls)) as pool:
        answers = list(pool.map(lambda c: client.post("/v1/score", json=body(*c[:2])), calls))
    for (_, model, want), answer in zip(calls, answers, strict=True):
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == (model or SERVED)
        got = np.log(np.asarray(answer.json()["scores"]))
        np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0, err_msg=str(model))


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/score", {"query": [1, 2], "items": [[3]], "label_token_ids": [4]}),
        ("/score", {"text_1": "a", "text_2": ["b"]}),
        ("/v1/rerank", {"query": "a", "documents": ["b"]}),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 0, "echo": True, "logprobs": 1}),
    ],
)
def test_an_unknown_model_is_not_found_in_the_dialects_shape(client, path, body):
    answer = client.post(path, json={**body, "model": "nope"})
    assert answer.status_code == 404, answer.text
    assert answer.headers["x-error-code"] == "model_not_found"
    assert "'nope' does not exist" in answer.text and repr(SERVED) in answer.text


def test_rerank_and_vllm_score_take_the_adapter(client, lora):
    """Cohere/Jina's /v1/rerank and vLLM's /score under an adapter: the same relevance, and not
    the base's."""
    docs = ["b c", "d"]
    base = client.post("/v1/rerank", json={"query": "a", "documents": docs}).json()
    tuned = client.post("/v1/rerank", json={"query": "a", "documents": docs, "model": "rslora"})
    assert tuned.status_code == 200 and tuned.json()["model"] == "rslora"
    by_index = {r["index"]: r["relevance_score"] for r in tuned.json()["results"]}
    pairs = client.post("/score", json={"text_1": "a", "text_2": docs, "model": "rslora"}).json()
    assert pairs["model"] == "rslora"
    for d in pairs["data"]:
        assert d["score"] == pytest.approx(by_index[d["index"]], abs=1e-6)
    base_scores = {r["index"]: r["relevance_score"] for r in base["results"]}
    assert max(abs(by_index[i] - base_scores[i]) for i in by_index) > 1e-4
