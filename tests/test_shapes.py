"""The finite shape set (issue 25): `Scorer.shapes(limits)` lists every step shape a scorer can
compile for requests within its limits, `warmup(all=True)` compiles exactly those, and after it
no request within the limits compiles anything.

One tiny checkpoint with small limits and small steps (batch_items, activation budgets), so its
set is tens of shapes: the same lattice as the default model's, in fewer buckets.
"""

import collections

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import compile_events, random_tokens, seeded_rng
from tpuscore import Scorer, ValidationError
from tpuscore.backends.contract import ShapeLimits, make_batch

CASE = "qwen3_qknorm"
LIMITS = {"query_tokens": 30, "item_tokens": 4, "labels": 2}
BACKENDS = ("prefill_extend", "packed_dense", "serial")
# Small steps: a few row buckets per length, queries prefilled in chunks of 16, so the set is
# about 30 shapes and requests span several steps of each backend.
OPTIONS = {
    "prefill_extend": {"batch_items": 4, "prefill_chunk": 16, "activation_bytes": 100_000},
    "packed_dense": {"activation_bytes": 100_000},
    "serial": {"activation_bytes": 100_000},
}


@pytest.fixture(scope="module")
def small_steps(scorers):
    """A scorer on small steps and its shape set, listed without compiling anything."""
    base = scorers(CASE)
    scorer = Scorer(base.config, base.params, base.tokenizer, backend_options=OPTIONS)
    return scorer, scorer.shapes(LIMITS, backends=BACKENDS)


@pytest.fixture(scope="module")
def warmed(small_steps):
    """The scorer on small steps, its shape set and the compilations `warmup(all=True)` made."""
    scorer, shapes = small_steps
    compiles = compile_events()  # clears JAX's caches: every shape compiles afresh
    warmed = scorer.warmup(all=True, limits=LIMITS, backends=BACKENDS)
    return scorer, shapes, len(compiles), warmed, compiles


def random_request(rng, vocab: int, shared: list[int]) -> dict:
    """A request within LIMITS: some queries continue a shared prefix (partial cache hits), some
    repeat it exactly, items of 0..8 tokens (empty ones too), 1..3 labels."""
    kind = rng.integers(0, 3)
    if kind == 0:  # at least one token: an empty query with an empty item has nothing to score
        query = random_tokens(rng, int(rng.integers(1, LIMITS["query_tokens"] + 1)), vocab)
    elif kind == 1:
        query = shared[: int(rng.integers(1, len(shared) + 1))]
    else:
        extra = int(rng.integers(1, LIMITS["query_tokens"] - len(shared) + 1))
        query = shared + random_tokens(rng, extra, vocab)
    items = [
        random_tokens(rng, int(rng.integers(0, LIMITS["item_tokens"] + 1)), vocab)
        for _ in range(int(rng.integers(1, 24)))
    ]
    labels = rng.choice(vocab, size=int(rng.integers(1, LIMITS["labels"] + 1)), replace=False)
    return {"query": query, "items": items, "label_token_ids": labels.tolist()}


def random_prompt(rng, vocab: int, shared: list[int]) -> list[int]:
    """A prompt within LIMITS: a random one, or a start of the shared prefix with random tokens
    after it (prompts of one call share prefixes of several lengths)."""
    Q = LIMITS["query_tokens"]
    if rng.integers(0, 2):
        return random_tokens(rng, int(rng.integers(1, Q + 1)), vocab)
    start = shared[: int(rng.integers(1, len(shared) + 1))]
    return start + random_tokens(rng, int(rng.integers(0, Q - len(start) + 1)), vocab)


@pytest.mark.slow
def test_warmup_all_compiles_exactly_the_shape_set(warmed):
    scorer, shapes, compiled, records, _ = warmed
    assert compiled == len(shapes)  # one executable per listed shape, none besides
    assert {w.backend: w.steps for w in records} == dict(
        collections.Counter(s.backend for s in shapes)
    )
    steps = {(s.backend, s.step) for s in shapes}
    for step in ("prefill", "prefill_rows", "resize", "stack", "unstack", "score_items"):
        assert ("prefill_extend", step) in steps
    assert ("prefill_extend", "score_mixed_items") in steps
    assert ("prefill_extend", "continuation_logprobs") in steps  # loglikelihood's step
    assert ("prefill_extend", "prompt_logprobs") in steps  # prompt_logprobs'
    assert len(shapes) < 60, collections.Counter((s.backend, s.step) for s in shapes)
    # Computable without compiling, and the same again.
    assert scorer.shapes(LIMITS, backends=BACKENDS) == shapes


@pytest.mark.slow
def test_nothing_compiles_after_warmup_all(warmed):
    """A few hundred random requests within the limits, several per call (different queries
    sharing steps), through each backend: not one compilation."""
    scorer, _, _, _, compiles = warmed
    rng = seeded_rng("test_shapes.after_warmup")
    vocab = scorer.config.vocab_size
    shared = random_tokens(rng, 12, vocab)
    before, sent = len(compiles), 0
    for call in range(60):
        requests = [random_request(rng, vocab, shared) for _ in range(int(rng.integers(1, 7)))]
        backend = BACKENDS[call % len(BACKENDS)]
        results = scorer.score_batch(requests, backend=backend)
        assert len(results) == len(requests)
        sent += len(requests)
        assert len(compiles) == before, f"call {call} on {backend} compiled"
    assert sent >= 150
    for call in range(20):  # loglikelihood's steps are in the set too
        context = random_tokens(rng, int(rng.integers(1, LIMITS["query_tokens"] + 1)), vocab)
        continuations = [
            random_tokens(rng, int(rng.integers(1, LIMITS["item_tokens"] + 1)), vocab)
            for _ in range(int(rng.integers(1, 12)))
        ]
        assert len(scorer.loglikelihood(context, continuations)) == len(continuations)
        assert len(compiles) == before, f"loglikelihood call {call} compiled"
    for call in range(20):  # and prompt_logprobs' (prompts of at most query_tokens tokens)
        prompts = [random_prompt(rng, vocab, shared) for _ in range(int(rng.integers(1, 9)))]
        assert len(scorer.prompt_logprobs(prompts)) == len(prompts)
        assert len(compiles) == before, f"prompt_logprobs call {call} compiled"


def test_auto_covers_its_candidates(small_steps):
    scorer = small_steps[0]
    auto = {s.backend for s in scorer.shapes(LIMITS, backends=["auto"])}
    assert auto == {"prefill_extend", "packed_segment", "packed_dense", "serial"}
    assert scorer.shapes(LIMITS, backends=["reference"]) == []  # numpy: nothing compiles


def test_limits_are_checked(small_steps):
    scorer = small_steps[0]
    with pytest.raises(ValidationError) as e:
        scorer.shapes({"query_tokens": -1})
    assert e.value.code == "invalid_limits" and e.value.param == "query_tokens"
    with pytest.raises(ValidationError) as e:
        scorer.shapes({"items": 3})
    assert e.value.code == "invalid_limits"
    default = scorer.shapes(backends=["serial"])  # the model's context length
    assert len(default) > len(scorer.shapes(LIMITS, backends=["serial"]))
    # No request is longer than the model: past its positions the set is the default's (a
    # limit of 10**12 tokens listed buckets for hours).
    positions = scorer.config.max_position_embeddings
    for past in (4 * positions, 10**12):
        limits = {"query_tokens": past, "item_tokens": past}
        assert scorer.shapes(limits, backends=["serial"]) == default, past


geometry = st.tuples(
    st.integers(1, LIMITS["query_tokens"]),  # query tokens
    st.lists(st.integers(0, LIMITS["item_tokens"]), min_size=1, max_size=40),  # item tokens
    st.integers(1, LIMITS["labels"]),  # labels
)


@pytest.mark.slow
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(groups=st.lists(geometry, min_size=1, max_size=6), seed=st.integers(0, 2**31))
def test_every_scheduled_shape_is_in_the_set(warmed, groups, seed):
    """Whatever groups a call holds, every step each backend runs has a listed shape."""
    scorer, shapes = warmed[0], warmed[1]
    listed = {(s.backend, s.step, s.shape) for s in shapes}
    rng = np.random.default_rng(seed)
    vocab = scorer.config.vocab_size
    batches = [
        make_batch(
            random_tokens(rng, q, vocab),
            [random_tokens(rng, n, vocab) for n in items],
            list(range(1, labels + 1)),
            False,
        )
        for q, items, labels in groups
    ]
    for name in BACKENDS:
        backend = scorer.get_backend(name)
        for output in backend.score_groups(batches):
            for s in output.stats.shapes:
                assert (name, s.step, s.shape) in listed


def test_limits_shrink_with_the_lattice(small_steps):
    """Each limit is a dimension of the lattice: lowering one never adds a shape."""
    scorer, shapes = small_steps
    smaller = ShapeLimits(query_tokens=16, item_tokens=4, labels=1)
    fewer = scorer.shapes(smaller, backends=BACKENDS)
    assert set(fewer) < set(shapes)


def test_serve_warmup_limits_parse():
    from tpuscore.cli.common import InputError
    from tpuscore.cli.serve import parse_limits

    assert parse_limits("query_tokens=512, labels=2") == {"query_tokens": 512, "labels": 2}
    assert parse_limits(None) == {}
    with pytest.raises(InputError):
        parse_limits("query_tokens=lots")
