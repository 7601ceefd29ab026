"""packed_dense and packed_segment: the layout, and scores equal to serial with items isolated."""

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from helpers import compile_events, random_tokens
from tpuscore import Scorer, ValidationError
from tpuscore.backends.contract import make_batch
from tpuscore.backends.packed import packing
from tpuscore.backends.packed.memory import packed_bytes
from tpuscore.backends.packed.steps import HEAD_SLOTS, SCORE_PACKED
from tpuscore.backends.work import logits_bytes

PACKED = ("packed_dense", "packed_segment")
ATOL = 1e-4  # float32


def test_layout_matches_the_docstring_picture():
    batch = make_batch([11, 12], [[21, 22], [], [31]], [5], item_first=False)
    chunk = packing.pack(batch, np.arange(3), 8)
    np.testing.assert_array_equal(chunk.tokens, [11, 12, 21, 22, 31, 0, 0, 0])
    np.testing.assert_array_equal(chunk.positions, [0, 1, 2, 3, 2, 0, 0, 0])
    np.testing.assert_array_equal(chunk.seg_start, [0, 0, 2, 2, 4, 5, 6, 7])
    np.testing.assert_array_equal(chunk.score_index, [3, 1, 4, packing.NO_SLOT])  # 4 slots
    assert chunk.prefix_len == 2


def test_plan_keeps_order_and_splits_where_the_next_item_would_not_fit():
    batch = make_batch([1] * 10, [[2] * n for n in (5, 0, 20, 3, 30, 1)], [5], item_first=False)
    chunks = [list(items) for items in packing.plan(batch, max_tokens=40)]
    assert chunks == [[0, 1, 2, 3], [4], [5]]  # 38, 40 and 11 tokens
    alone = [list(items) for items in packing.plan(batch, max_tokens=1)]
    assert alone == [[i] for i in range(6)]  # never an empty chunk
    capped = [list(items) for items in packing.plan(batch, max_tokens=40, max_items=3)]
    assert capped == [[0, 1, 2], [3], [4], [5]]


def test_many_short_items_split_so_their_logits_fit_the_budget_too(scorers, rng):
    base = scorers("qwen3_qknorm")
    vocab = base.config.vocab_size
    query, items = random_tokens(rng, 20, vocab), [random_tokens(rng, 1, vocab) for _ in range(90)]
    # Room for a 128-token row with 16 items' logits: 90 one-token items would fit its length.
    budget = packed_bytes(base.config, 128, dense_mask=True) + logits_bytes(base.config, 16)
    options = {"packed_dense": {"activation_bytes": budget}}
    scorer = Scorer(base.config, base.params, base.tokenizer, backend_options=options)
    backend = scorer.get_backend("packed_dense")
    assert backend.chunk_limits == (128, 16)
    batch = make_batch(query, items, [1, 2], False)
    assert all(step.peak <= budget for step in backend.work([batch]))
    assert backend.score(batch).stats.chunks == 6  # 90 items, 16 a chunk
    serial = scorer.score(query, items, [1, 2], backend="serial")
    got = scorer.score(query, items, [1, 2], backend="packed_dense")
    np.testing.assert_allclose(got.logprobs, serial.logprobs, atol=ATOL, rtol=0)


def _items(rng, count: int, vocab: int, max_len: int = 20):
    return [random_tokens(rng, int(n), vocab) for n in rng.integers(0, max_len, size=count)]


# Each family meets serial and transformers in test_parity_hf.py; here the item counts rotate
# through the families.
@pytest.mark.parametrize("backend", PACKED)
@pytest.mark.parametrize(
    ("case", "count"),
    [("llama_gqa_untied", 1), ("llama3_rope_tied", 128), ("qwen2_bias", 1), ("qwen3_qknorm", 128)],
)
def test_equals_serial(case, scorers, rng, backend, count):
    scorer = scorers(case)
    vocab = scorer.config.vocab_size
    query = random_tokens(rng, int(rng.integers(1, 60)), vocab)
    items = _items(rng, count, vocab)
    items[0] = []  # scores the query's last token
    labels = rng.choice(vocab, size=3, replace=False).tolist()
    serial = scorer.score(query, items, labels, backend="serial")
    got = scorer.score(query, items, labels, backend=backend)
    np.testing.assert_allclose(got.logprobs, serial.logprobs, atol=ATOL, rtol=0)
    assert got.backend == backend
    chunks = scorer.get_backend(backend).score(make_batch(query, items, labels, False)).stats.chunks
    assert got.num_tokens == chunks * len(query) + sum(map(len, items))  # the query per chunk


def test_a_row_that_would_pad_much_is_split_into_equal_chunks_that_pad_less(scorers, rng):
    backend = "packed_segment"  # whose budget holds the whole row (packed_dense's splits it)
    scorer = scorers("llama_gqa_untied")
    vocab = scorer.config.vocab_size
    query, items = random_tokens(rng, 50, vocab), [random_tokens(rng, 100, vocab)] * 20
    runner = scorer.get_backend(backend)
    batch = make_batch(query, items, [1, 2], False)
    chunks = runner.chunks(batch)
    fewest = list(packing.plan(batch, runner.max_tokens, runner.slots(runner.max_tokens)))
    assert len(chunks) > len(fewest)
    assert runner.padded_tokens(batch, chunks) < runner.padded_tokens(batch, fewest)
    np.testing.assert_array_equal(np.concatenate(chunks), np.arange(20))  # in order, all once
    assert max(map(len, chunks)) - min(map(len, chunks)) <= 1  # equal items: equal chunks
    serial = scorer.score(query, items, [1, 2], backend="serial")
    got = scorer.score(query, items, [1, 2], backend=backend)
    np.testing.assert_allclose(got.logprobs, serial.logprobs, atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", PACKED)
def test_a_step_with_more_slots_than_items_takes_the_head_over_the_filled_ones(
    scorers, rng, backend
):
    """On a CPU the LM head runs HEAD_SLOTS slots at a time, as many times as the fullest row
    needs; rows filled to different depths, past one such part, score as serial does."""
    scorer = scorers("llama3_rope_tied")
    vocab = scorer.config.vocab_size
    runner = scorer.get_backend(backend)
    requests = [  # one step, its rows filled to different depths
        {"query": random_tokens(rng, 200, vocab), "items": _items(rng, n, vocab, max_len=4)}
        | {"label_token_ids": rng.choice(vocab, size=2, replace=False).tolist()}
        for n in (25, 3)
    ]
    batches = [make_batch(r["query"], r["items"], r["label_token_ids"], False) for r in requests]
    (step,) = runner.plan(batches).steps
    for got, r in zip(scorer.score_batch(requests, backend=backend), requests, strict=True):
        want = scorer.score(**r, backend="serial").logprobs
        np.testing.assert_allclose(got.logprobs, want, atol=ATOL, rtol=0)
    table = runner.steps[SCORE_PACKED]
    rows, length, slots = step.rows, step.length, runner.slots(step.length)
    assert len(step.chunks) >= 2 and slots > HEAD_SLOTS
    args, kwargs = table.zeros((rows, length, slots, 2))
    hlo = table.function.lower(*args, **kwargs).compile().as_text()
    head = f"[{rows * HEAD_SLOTS},{vocab}]"  # the head's logits of one part
    assert head in hlo and f"[{rows * slots},{vocab}]" not in hlo


@pytest.mark.parametrize("backend", PACKED)
def test_equals_serial_with_an_empty_query(scorers, rng, backend):
    scorer = scorers("qwen2_bias")
    items = [random_tokens(rng, int(n), scorer.config.vocab_size) for n in (1, 7, 3)]
    serial = scorer.score([], items, [3, 4], backend="serial")
    got = scorer.score([], items, [3, 4], backend=backend)
    np.testing.assert_allclose(got.logprobs, serial.logprobs, atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", PACKED)
def test_chunks_split_to_fit_the_memory_budget(scorers, rng, backend):
    base = scorers("llama_gqa_untied")
    vocab = base.config.vocab_size
    query = random_tokens(rng, 40, vocab)
    items = _items(rng, 30, vocab)
    serial = base.score(query, items, [1, 2], backend="serial").logprobs
    dense = backend == "packed_dense"
    budget = packed_bytes(base.config, 256, dense_mask=dense)  # room for ~256 tokens
    options = {backend: {"activation_bytes": budget}}
    scorer = Scorer(base.config, base.params, base.tokenizer, backend_options=options)
    got = scorer.score(query, items, [1, 2], backend=backend)
    np.testing.assert_allclose(got.logprobs, serial, atol=ATOL, rtol=0)
    stats = scorer.get_backend(backend).score(make_batch(query, items, [1, 2], False)).stats
    assert stats.chunks == stats.steps > 1
    assert all(s.shape[1] <= 256 for s in stats.shapes)
    assert got.num_tokens == stats.tokens == stats.chunks * len(query) + sum(map(len, items))


@pytest.mark.parametrize("backend", PACKED)
def test_a_step_that_would_pad_many_rows_runs_as_power_of_two_steps(scorers, rng, backend):
    """Five requests are five packed rows: padded to 8 in one step, or where those 3 rows would
    hold `split_padding_tokens` tokens or more (CPU default 128), steps of 4 and 1."""
    base = scorers("llama_gqa_untied")
    vocab = base.config.vocab_size
    requests = [
        {"query": random_tokens(rng, 30, vocab), "items": _items(rng, 3, vocab)}
        | {"label_token_ids": [1, 2]}
        for _ in range(5)
    ]
    expected = [base.score(**r, backend="serial").logprobs for r in requests]
    batches = [make_batch(r["query"], r["items"], [1, 2], False) for r in requests]
    for split, rows in [(None, [4, 1]), (0, [8]), (10**6, [8])]:
        options = {backend: {"split_padding_tokens": split}}
        scorer = Scorer(base.config, base.params, base.tokenizer, backend_options=options)
        assert [s.rows for s in scorer.get_backend(backend).plan(batches).steps] == rows, split
        for got, want in zip(scorer.score_batch(requests, backend=backend), expected, strict=True):
            np.testing.assert_allclose(got.logprobs, want, atol=ATOL, rtol=0, err_msg=str(split))


@pytest.mark.parametrize("backend", PACKED)
@pytest.mark.parametrize("same_length", [True, False])
def test_changing_one_item_leaves_the_others_unchanged(scorers, rng, backend, same_length):
    scorer = scorers("qwen3_qknorm")
    vocab = scorer.config.vocab_size
    query = random_tokens(rng, 25, vocab)
    items = _items(rng, 12, vocab)
    j = 5
    items[j] = random_tokens(rng, int(rng.integers(1, 20)), vocab)  # so a same-length change exists
    changed = list(items)
    n = len(items[j]) if same_length else len(items[j]) + int(rng.integers(1, 4))
    while changed[j] == items[j]:  # a one-token item redrawn the same: 1 in 331
        changed[j] = random_tokens(rng, n, vocab)
    before = scorer.score(query, items, [1, 2, 3], backend=backend).logprobs
    after = scorer.score(query, changed, [1, 2, 3], backend=backend).logprobs
    others = np.arange(len(items)) != j
    if same_length:  # the same shapes and the others' same positions: bit-identical
        np.testing.assert_array_equal(after[others], before[others])
    else:  # the items after j move in a longer row, so sums reorder: float32 rounding only
        np.testing.assert_array_max_ulp(after[others], before[others], maxulp=8)
    assert not np.allclose(after[j], before[j], atol=1e-6)  # the change itself did reach item j


@pytest.mark.parametrize("backend", PACKED)
def test_item_first_is_refused(scorers, backend):
    with pytest.raises(ValidationError) as err:
        scorers("qwen2_bias").score([1, 2], [[3]], [4], item_first=True, backend=backend)
    assert err.value.code == "unsupported_option"


def test_block_sizes_option_is_validated(scorers):
    scorer = scorers("qwen2_bias")
    for bad in ({"block_q": 7}, {"block_z": 8}, "big"):
        options = {"packed_segment": {"block_sizes": bad}}
        with pytest.raises(ValidationError) as err:
            Scorer(scorer.config, scorer.params, scorer.tokenizer, backend_options=options)
        assert err.value.code == "invalid_backend_option"
        assert err.value.param == "backend_options.packed_segment.block_sizes"
    for backend in PACKED:
        options = {backend: {"split_padding_tokens": -1}}
        with pytest.raises(ValidationError) as err:
            Scorer(scorer.config, scorer.params, scorer.tokenizer, backend_options=options)
        assert err.value.param == f"backend_options.{backend}.split_padding_tokens"


# packed_segment's steps are bucketed by the same code (`StepShapes`): its case runs as slow.
@pytest.mark.parametrize(
    "backend", [PACKED[0], *(pytest.param(b, marks=pytest.mark.slow) for b in PACKED[1:])]
)
def test_request_stream_compiles_once_per_bucket(scorers, rng, backend):
    scorer = scorers("llama3_rope_tied")
    vocab = scorer.config.vocab_size
    requests = []
    for _ in range(16):
        query = random_tokens(rng, int(rng.integers(1, 100)), vocab)
        items = _items(rng, int(rng.integers(1, 40)), vocab)
        labels = random_tokens(rng, int(rng.integers(1, 7)), vocab)
        requests.append((query, items, labels))

    runner = scorer.get_backend(backend)
    compiles = compile_events()
    shapes = []
    for query, items, labels in requests:
        shapes += runner.score(make_batch(query, items, labels, False)).stats.shapes
    first_pass = len(compiles)
    distinct = {s.shape for s in shapes}
    assert first_pass == len(distinct)  # each bucket shape compiles once
    # Every step is on the backend's lattice for these limits (a row of many short items may be
    # padded past its tokens' bucket, so that its item slots hold them: `shapes()` says so).
    limits = {"query_tokens": 99, "item_tokens": 19, "labels": 6}
    lattice = {(s.step, s.shape) for s in scorer.shapes(limits, backends=[backend])}
    assert {(s.step, s.shape) for s in shapes} <= lattice
    print(f"{len(distinct)} shapes from {len(requests)} requests; {len(lattice)} in the lattice")
    for query, items, labels in requests:  # the same stream again compiles nothing
        scorer.score(query, items, labels, backend=backend)
    assert len(compiles) == first_pass


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(
    query=st.lists(st.integers(1, 99), max_size=12),
    items=st.lists(st.lists(st.integers(1, 99), max_size=6), min_size=1, max_size=10),
    data=st.data(),
)
def test_pack_lays_out_the_query_and_chosen_items_token_by_token(query, items, data):
    """`pack` against the layout written out one token at a time (the module docstring's)."""
    if not query:
        items = [item or [7] for item in items]  # no token to score after
    rows = sorted(data.draw(st.sets(st.integers(0, len(items) - 1), min_size=1)))
    tokens, positions, seg_start = list(query), list(range(len(query))), [0] * len(query)
    score_at = []
    for i in rows:
        start = len(tokens)
        tokens += items[i]
        positions += range(len(query), len(query) + len(items[i]))
        seg_start += [start] * len(items[i])
        score_at.append(len(tokens) - 1 if items[i] else len(query) - 1)
    length = len(tokens) + data.draw(st.integers(0, 5))
    padding = range(len(tokens), length)
    chunk = packing.pack(make_batch(query, items, [1], item_first=False), rows, length)
    np.testing.assert_array_equal(chunk.tokens, tokens + [0] * len(padding))
    np.testing.assert_array_equal(chunk.positions, positions + [0] * len(padding))
    np.testing.assert_array_equal(chunk.seg_start, seg_start + list(padding))
    assert chunk.score_index[: len(rows)].tolist() == score_at and chunk.prefix_len == len(query)
    assert (chunk.score_index[len(rows) :] == packing.NO_SLOT).all() and chunk.rows.tolist() == rows
