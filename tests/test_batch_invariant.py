"""Batch-invariant mode: a request's scores bit-identical alone, in any batch, through the Batcher.

`Scorer(batch_invariant=True)` plans every step from one request's own geometry (fixed shapes per
query and item bucket, padding rows included; docs/batch-invariance.md). These tests compare
bytes, not values within a tolerance: the difference must be exactly 0.0. Companions are drawn by
hypothesis: other queries, the same query, other item counts and lengths, other labels.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpuscore import Batcher, Scorer, ValidationError
from tpuscore.backends.contract import make_batch
from tpuscore.backends.prefill_extend.steps import score_items
from tpuscore.backends.serial import score_sequences

CASE = "qwen3_qknorm"
INVARIANT = ("prefill_extend", "serial", "reference")
REFUSED = ("packed_dense", "packed_segment")
SETTINGS = settings(
    max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def scorer(checkpoint_dir) -> Scorer:
    return Scorer.from_pretrained(checkpoint_dir(CASE), dtype="float32", batch_invariant=True)


def _tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(0, vocab, n).tolist()


def _request(rng, vocab, query=None, *, labels=(3, 7, 11)) -> dict:
    """A random request: a query of 1-16 tokens (or the given one), 1-6 items of 0-8 tokens
    (few buckets, so few compilations)."""
    if query is None:
        query = _tokens(rng, int(rng.integers(1, 17)), vocab)
    items = [_tokens(rng, int(rng.integers(0, 9)), vocab) for _ in range(rng.integers(1, 7))]
    return {"query": query, "items": items, "label_token_ids": list(labels)}


def _companions(rng, vocab, target: dict, kinds: list[str]) -> list[dict]:
    """Requests to score beside target: other queries, its own query, other labels."""
    out = []
    for kind in kinds:
        if kind == "same_query":
            out.append(_request(rng, vocab, target["query"]))
        elif kind == "other_labels":
            out.append(_request(rng, vocab, target["query"], labels=(5, 3)))
        else:
            out.append(_request(rng, vocab))
    return out


def _bytes(result) -> bytes:
    return np.ascontiguousarray(result.logprobs).tobytes()


def _clear(scorer: Scorer, backend: str) -> None:
    if backend == "prefill_extend":
        scorer.get_backend(backend).cache.clear()


KINDS = st.lists(st.sampled_from(["other_query", "same_query", "other_labels"]), max_size=5)


@pytest.mark.parametrize("backend", INVARIANT)
@SETTINGS
@given(
    seed=st.integers(0, 2**32 - 1), kinds=KINDS, position=st.integers(0, 5), cached=st.booleans()
)
def test_alone_equals_in_batch(scorer, backend, seed, kinds, position, cached):
    """Scored alone (prefix cache cold) and in a score_batch with random companions (the cache
    cold or warm with the companions' queries), the target's logprobs have the same bytes."""
    rng = np.random.default_rng(seed)
    vocab = scorer.config.vocab_size
    target = _request(rng, vocab)
    others = _companions(rng, vocab, target, kinds)
    _clear(scorer, backend)
    alone = scorer.score(**target, backend=backend)
    if not cached:
        _clear(scorer, backend)
    batch = [*others[:position], target, *others[position:]]
    results = scorer.score_batch(batch, backend=backend)
    assert _bytes(results[min(position, len(others))]) == _bytes(alone)
    assert results[min(position, len(others))].backend == backend


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), kinds=KINDS)
def test_auto_alone_equals_in_batch(scorer, seed, kinds):
    """auto's pick does not depend on the batch: the same backend, the same bytes."""
    rng = np.random.default_rng(seed)
    vocab = scorer.config.vocab_size
    target = _request(rng, vocab)
    others = _companions(rng, vocab, target, kinds)
    alone = scorer.score(**target)
    results = scorer.score_batch([*others, target])
    assert results[-1].backend == alone.backend == "prefill_extend"
    assert _bytes(results[-1]) == _bytes(alone)


@pytest.mark.parametrize("backend", ["prefill_extend", "serial"])
def test_batcher_under_threads(scorer, backend):
    """Through the Batcher with 16 concurrent callers (companions sharing and not sharing the
    query), every request's bytes equal those of the request scored alone."""
    rng = np.random.default_rng(int.from_bytes(np.random.bytes(4), "little"))
    vocab = scorer.config.vocab_size
    requests = [_request(rng, vocab) for _ in range(6)]
    requests += [_request(rng, vocab, requests[i % 6]["query"]) for i in range(10)]
    alone = []
    for request in requests:
        _clear(scorer, backend)
        alone.append(_bytes(scorer.score(**request, backend=backend)))
    _clear(scorer, backend)
    with Batcher(scorer, max_wait_ms=20) as batcher, ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(batcher.score, **r, backend=backend) for r in requests]
        batched = [_bytes(f.result(timeout=120)) for f in futures]
    assert batched == alone


def test_item_first_serial(scorer):
    """item_first requests go to serial under auto, and are invariant there too."""
    rng = np.random.default_rng(7)
    vocab = scorer.config.vocab_size
    target = {**_request(rng, vocab), "item_first": True}
    others = [{**_request(rng, vocab), "item_first": True} for _ in range(3)]
    alone = scorer.score(**target)
    results = scorer.score_batch([*others, target, _request(rng, vocab)])
    assert alone.backend == results[3].backend == "serial"
    assert _bytes(results[3]) == _bytes(alone)


@pytest.mark.parametrize("backend", REFUSED)
def test_refuses_backends_that_cannot(checkpoint_dir, scorer, backend):
    with pytest.raises(ValidationError) as construct:
        Scorer.from_pretrained(
            checkpoint_dir(CASE), dtype="float32", backend=backend, batch_invariant=True
        )
    assert construct.value.code == "batch_invariant_unsupported"
    assert construct.value.param == "backend"
    rng = np.random.default_rng(0)
    with pytest.raises(ValidationError) as call:
        scorer.score(**_request(rng, scorer.config.vocab_size), backend=backend)
    assert call.value.code == "batch_invariant_unsupported"
    with pytest.raises(ValidationError) as batch:
        scorer.score_batch([_request(rng, scorer.config.vocab_size)], backend=backend)
    assert batch.value.code == "batch_invariant_unsupported"


def test_default_mode_still_runs_packed(scorers):
    """The refusal is the mode's: a default scorer still runs packed_dense."""
    rng = np.random.default_rng(1)
    plain = scorers(CASE)
    assert plain.score(**_request(rng, plain.config.vocab_size), backend="packed_dense")


def test_invariant_steps_have_own_shapes(scorer):
    """The planned extend steps: one group each, every item in its own length's bucket, at the
    bucket's fixed row count whatever the number of items or what else the call holds."""
    runner = scorer.get_backend("prefill_extend")
    lone = make_batch([1, 2, 3], [[4] * 5], [3], False)
    crowd = make_batch([1, 2, 3], [[4] * 5] * 40 + [[5] * 20], [3], False)
    other = make_batch([9] * 30, [[4] * 6] * 3, [3, 5], False)
    (step,) = runner.plan_extend([lone], [0])
    assert (step.item_len, step.size, list(step.rows)) == (8, runner.invariant_rows(8), [0])
    steps = runner.plan_extend([crowd, other, lone], [0, 1, 0])
    for s in steps:
        assert len(set(s.groups.tolist())) == 1
        assert s.size == runner.invariant_rows(s.item_len)
    assert {s.item_len for s in steps} == {8, 20}
    assert runner.invariant_rows(8) < 40  # so the crowd's length-5 items span several steps
    assert sum(len(s.rows) for s in steps if s.groups[0] == 0) == 41


@pytest.mark.parametrize("function", ["score_items", "score_sequences"])
def test_fixed_shape_row_independent_on_xla(scorer, function):
    """The premise, checked on this device: in a step of fixed shape, a row's result does not
    depend on its position or on what the other rows hold."""
    rng = np.random.default_rng(int.from_bytes(np.random.bytes(4), "little"))
    config, params = scorer.config, scorer.params
    vocab, B, L = config.vocab_size, 8, 12
    labels = np.array([3, 7, 11, 0], np.int32)
    row = rng.integers(0, vocab, L).astype(np.int32)
    row_len = np.int32(9)

    if function == "score_items":
        query = rng.integers(0, vocab, 20).astype(np.int32)
        runner = scorer.get_backend("prefill_extend")
        runner.cache.clear()
        prefix = runner.query_prefix(query)

        def step(tokens, lens):
            return np.asarray(score_items(params, prefix, tokens, lens, labels, config))
    else:

        def step(tokens, lens):
            return np.asarray(score_sequences(params, tokens, lens, labels, config=config))

    results = []
    for position in (0, 3, B - 1):
        tokens = rng.integers(0, vocab, (B, L)).astype(np.int32)
        lens = rng.integers(0, L + 1, B).astype(np.int32)
        if position == 3:
            tokens[:], lens[:] = 0, 0  # every other row padding
        tokens[position], lens[position] = row, row_len
        results.append(step(tokens, lens)[position].tobytes())
    assert results[0] == results[1] == results[2]


def test_cli_flag(checkpoint_dir, scorer, tmp_path, capsys):
    """--batch-invariant builds the scorer in the mode: the library's bytes, and packed
    refused before anything runs."""
    from tpuscore.cli import commands as cli

    model = str(checkpoint_dir(CASE))
    status = cli.main(["serve", "--model", model, "--batch-invariant", "--backend", "packed_dense"])
    assert status == 2
    assert "batch_invariant=True" in capsys.readouterr().err
    request = {"query": [5, 6, 7], "items": [[8], [9, 10]], "label_token_ids": [3, 7]}
    path = tmp_path / "in.json"
    path.write_text(json.dumps(request))
    assert (
        cli.main(["score", "--model", model, "--dtype", "float32", "--batch-invariant", str(path)])
        == 0
    )
    printed = json.loads(capsys.readouterr().out)
    expected = scorer.score(**request).logprobs
    assert np.array_equal(np.array(printed["logprobs"], np.float32), expected)
