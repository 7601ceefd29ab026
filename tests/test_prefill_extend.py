"""prefill_extend against serial (and transformers): same scores, whatever the item count,
lengths and query."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import random_tokens
from hf_reference import hf_logprobs
from tpuscore import Scorer, ValidationError
from tpuscore.backends.buckets import bucket_item_tokens, bucket_prefix, bucket_tokens
from tpuscore.backends.contract import make_batch
from tpuscore.backends.prefill_extend import steps as prefill_extend
from tpuscore.models import attention, decoder

ATOL = 1e-4  # float32


def _items(rng, count: int, vocab: int, max_len: int = 30, empty: bool = True):
    lens = rng.integers(0 if empty else 1, max_len, size=count)
    return [random_tokens(rng, int(n), vocab) for n in lens]


# Each family meets serial and transformers in test_parity_hf.py; here the item counts rotate
# through the families, so every count and every family runs, at a quarter of the compiles.
@pytest.mark.parametrize(
    ("case", "count"),
    [
        ("llama_gqa_untied", 1),
        ("llama3_rope_tied", 2),
        ("qwen2_bias", 7),
        ("qwen3_qknorm", 33),
        ("llama_gqa_untied", 200),
        pytest.param("qwen3_qknorm", 200, marks=pytest.mark.slow),  # 200 in CI: one family
    ],
)
def test_equals_serial_for_any_item_count(case, scorers, rng, count):
    scorer = scorers(case)
    vocab = scorer.config.vocab_size
    query = random_tokens(rng, int(rng.integers(2, 90)), vocab)
    items = _items(rng, count, vocab)
    if count > 1:
        items[1] = []  # scores the query's last token
    labels = rng.choice(vocab, size=3, replace=False).tolist()
    serial = scorer.score(query, items, labels, backend="serial")
    fast = scorer.score(query, items, labels, backend="prefill_extend")
    np.testing.assert_allclose(fast.logprobs, serial.logprobs, atol=ATOL, rtol=0)
    assert fast.backend == "prefill_extend"


@pytest.mark.parametrize(
    ("case", "query_len"),
    [("llama_gqa_untied", 0), ("llama3_rope_tied", 1), ("qwen2_bias", 0), ("qwen3_qknorm", 1)],
)
def test_equals_serial_for_the_shortest_queries(case, scorers, rng, query_len):
    scorer = scorers(case)
    vocab = scorer.config.vocab_size
    query = random_tokens(rng, query_len, vocab)
    items = _items(rng, 9, vocab, empty=query_len > 0)  # an empty query needs non-empty items
    serial = scorer.score(query, items, [3, 4], backend="serial")
    fast = scorer.score(query, items, [3, 4], backend="prefill_extend")
    np.testing.assert_allclose(fast.logprobs, serial.logprobs, atol=ATOL, rtol=0)


def test_a_query_longer_than_one_prefill_chunk(scorers, rng):
    base = scorers("llama3_rope_tied")
    options = {"prefill_extend": {"prefill_chunk": 64}}  # 150 tokens: three chunks
    scorer = Scorer(base.config, base.params, base.tokenizer, backend_options=options)
    vocab = scorer.config.vocab_size
    query = random_tokens(rng, 150, vocab)
    items = _items(rng, 5, vocab)
    serial = scorer.score(query, items, [3, 4], backend="serial")
    batch = make_batch(query, items, [3, 4], item_first=False)
    stats = scorer.get_backend("prefill_extend").score(batch).stats
    assert [s.step for s in stats.shapes].count("prefill") == 3
    fast = scorer.score(query, items, [3, 4], backend="prefill_extend")
    np.testing.assert_allclose(fast.logprobs, serial.logprobs, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", ["llama3_rope_tied", "gemma2_window"])
def test_a_chunked_prefill_skips_key_blocks_and_matches_transformers(
    case, checkpoint_dir, scorers, rng
):
    """A 200-token query in chunks of 32 meets its 256-position buffer in 8 key blocks, each
    chunk skipping the blocks no earlier chunk filled; on Gemma 2's sliding layer (window 7) a
    block's keys keep their own positions."""
    base = scorers(case)
    options = {"prefill_extend": {"prefill_chunk": 32}}
    scorer = Scorer(base.config, base.params, base.tokenizer, backend_options=options)
    assert prefill_extend.key_blocks(bucket_prefix(200), bucket_tokens(32)) == 8
    _check_against_transformers(scorer, checkpoint_dir(case), rng, query_len=200, count=4)


@pytest.fixture
def narrow_key_blocks(monkeypatch):
    """Extend steps meet a query's K/V in key blocks of 32 positions (256 by default, wider than
    the test checkpoints' 512-position limit allows a skip in). The block count is fixed when
    a step is traced, so JAX's caches are cleared on the way in and out (the executables load
    back from the run's persistent cache). The fused CPU kernel, which reads keys up to the
    query's length whatever the blocks, is off, so the blocks are what runs."""
    monkeypatch.setattr(prefill_extend, "KEY_BLOCK_TOKENS", 32)
    monkeypatch.setattr(prefill_extend, "prefix_kernel", lambda: None)
    jax.clear_caches()
    yield
    monkeypatch.undo()
    jax.clear_caches()


@pytest.mark.parametrize("case", ["llama3_rope_tied", "gemma2_window"])
def test_items_skip_the_key_blocks_past_their_query_and_match_transformers(
    case, checkpoint_dir, scorers, rng, narrow_key_blocks
):
    """A 140-token query's K/V holds 256 positions, met by extend steps in 8 key blocks of 32:
    the items run the first 5 and skip the bucket's padding; on Gemma 2's sliding layer (window
    7) only the last block run holds keys inside the window."""
    scorer = scorers(case)
    assert prefill_extend.key_blocks(bucket_prefix(140)) == 8
    _check_against_transformers(scorer, checkpoint_dir(case), rng, query_len=140, count=3)


def _check_against_transformers(scorer, checkpoint, rng, query_len: int, count: int):
    """A random query of query_len tokens and count items of up to 11: prefill_extend's scores
    equal transformers'."""
    vocab = scorer.config.vocab_size
    query = random_tokens(rng, query_len, vocab)
    items = _items(rng, count, vocab, max_len=12)
    labels = rng.choice(vocab, size=3, replace=False).tolist()
    expected = hf_logprobs(checkpoint, [query + item for item in items], labels)
    got = scorer.score(query, items, labels, backend="prefill_extend").logprobs
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)


def test_skipped_key_blocks_are_never_read(rng):
    """The shared-prefix attention in 4 key blocks of a 64-position prefix holding 37 keys: the
    fourth block, filled with NaN, is never read (a read would spread NaN through p.v even where
    masked), and the result equals one block over the whole prefix within float rounding."""
    K, G, H, P, length = 2, 3, 8, 64, 37
    q = jnp.asarray(rng.standard_normal((2, 5, K * G, H)), jnp.float32)
    prefix_k = rng.standard_normal((K, H, P)).astype(np.float32)
    prefix_v = rng.standard_normal((K, P, H)).astype(np.float32)
    prefix_mask = jnp.arange(P) < length
    whole = attention._merge(attention._prefix_parts(q, prefix_k, prefix_v, prefix_mask))
    prefix_k[..., 48:], prefix_v[:, 48:] = np.nan, np.nan
    blocks = attention._merge(
        attention._prefix_parts(
            q, prefix_k, prefix_v, prefix_mask, key_blocks=4, length=jnp.asarray(length)
        )
    )
    assert np.isfinite(np.asarray(blocks)).all()
    np.testing.assert_allclose(blocks, whole, atol=1e-6, rtol=0)


def test_an_extend_step_reads_the_keys_its_price_counts(scorers, rng, narrow_key_blocks):
    """A 70-token query's K/V holds 128 positions, met in blocks of 32: the step reads 96
    (`keys_read`, what `work` prices). NaN written from position 96 on leaves the scores
    finite; one NaN at position 95 (padding, masked, but in the last block read) does not."""
    scorer = scorers("llama_gqa_untied")
    config = scorer.config
    P = bucket_prefix(70)
    assert prefill_extend.keys_read(P, 70) == 96 and P == 128
    assert prefill_extend.keys_read(32, 0) == 32  # one block runs without the loop: read whole
    shape = (config.num_layers, config.num_kv_heads, config.head_dim, P)
    k, v = rng.standard_normal(shape), rng.standard_normal(shape).swapaxes(2, 3)
    items = jnp.asarray([random_tokens(rng, 5, config.vocab_size) for _ in range(2)], jnp.int32)

    def scores(poison: slice) -> np.ndarray:
        kp, vp = k.copy(), v.copy()
        kp[..., poison], vp[..., poison, :] = np.nan, np.nan
        prefix = decoder.Prefix(
            k=jnp.asarray(kp, jnp.float32), v=jnp.asarray(vp, jnp.float32),
            length=jnp.int32(70), last_hidden=jnp.zeros(config.hidden_size, jnp.float32),
        )  # fmt: skip
        lens, labels = jnp.asarray([5, 5]), jnp.asarray([1, 2])
        got = prefill_extend.score_items(scorer.params, prefix, items, lens, labels, config)
        return np.asarray(got)

    assert np.isfinite(scores(slice(96, None))).all()
    assert np.isnan(scores(slice(95, 96))).all()


def test_an_extend_step_is_priced_by_the_key_blocks_it_reads(scorers, rng, monkeypatch):
    """Queries of 70 and 96 tokens (K/V of 128 positions, blocks of 32) read 3 blocks and are
    priced alike; one of 97 reads 4 and costs more. Pricing compiles nothing, so JAX's caches
    stay as they are (unlike `narrow_key_blocks`)."""
    monkeypatch.setattr(prefill_extend, "KEY_BLOCK_TOKENS", 32)
    scorer = scorers("llama_gqa_untied")
    runner, vocab = scorer.get_backend("prefill_extend"), scorer.config.vocab_size
    items = [random_tokens(rng, 5, vocab) for _ in range(4)]

    def extend_scores(query_len: int) -> float:
        batch = make_batch(random_tokens(rng, query_len, vocab), items, [1, 2], False)
        return runner.work([batch])[-1].scores  # the extend step: it comes after the prefill

    assert extend_scores(70) == extend_scores(96) < extend_scores(97)


@pytest.mark.slow  # long
def test_batches_of_any_size_give_the_same_scores(scorers, rng):
    base = scorers("qwen2_bias")
    vocab = base.config.vocab_size
    query = random_tokens(rng, 30, vocab)
    items = _items(rng, 9, vocab, max_len=40)
    expected = base.score(query, items, [1, 2], backend="serial").logprobs
    for batch_items in (1, 5):
        options = {"prefill_extend": {"batch_items": batch_items}}
        scorer = Scorer(base.config, base.params, base.tokenizer, backend_options=options)
        got = scorer.score(query, items, [1, 2], backend="prefill_extend").logprobs
        np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0, err_msg=str(batch_items))


def test_a_partly_filled_step_runs_as_power_of_two_steps_rather_than_padding(scorers, rng):
    """100 items of 10 tokens (bucket 12): 64 + 32 + 4 rows, not 128 rows of which 28 (336
    tokens) are padding; with the split off, one step of 128. Scores as serial's either way."""
    base = scorers("qwen2_bias")
    vocab = base.config.vocab_size
    query = random_tokens(rng, 20, vocab)
    items = [random_tokens(rng, 10, vocab) for _ in range(100)]
    batch = make_batch(query, items, [3, 4], item_first=False)
    expected = base.score(query, items, [3, 4], backend="serial").logprobs
    for split, rows in [(128, [64, 32, 4]), (0, [128]), (400, [128])]:
        options = {"prefill_extend": {"split_padding_tokens": split}}
        scorer = Scorer(base.config, base.params, base.tokenizer, backend_options=options)
        out = scorer.get_backend("prefill_extend").score(batch)
        shapes = out.stats.shapes
        assert [s.shape[0] for s in shapes if s.step == "score_items"] == rows, split
        got = out.logprobs[: len(items), :2]  # the two labels; padded label columns after
        assert out.valid[: len(items)].all()
        np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0, err_msg=str(split))


def test_counts_each_query_token_once(scorers, rng):
    scorer = scorers("qwen3_qknorm")
    # The scorer is shared: an earlier test's query may begin with this one's first tokens.
    scorer.get_backend("prefill_extend").cache.clear()
    vocab = scorer.config.vocab_size
    query = random_tokens(rng, 25, vocab)
    items = _items(rng, 10, vocab)
    result = scorer.score(query, items, [1], backend="prefill_extend")
    assert result.num_tokens == len(query) + sum(map(len, items))


def test_item_first_is_refused(scorers):
    with pytest.raises(ValidationError) as err:
        scorers("qwen3_qknorm").score([1, 2], [[3]], [4], item_first=True, backend="prefill_extend")
    assert err.value.code == "unsupported_option" and err.value.param == "item_first"


def test_bad_options_fail_when_the_scorer_is_built(scorers):
    base = scorers("qwen3_qknorm")
    for options, code, param in [
        ({"batch_items": 0}, "invalid_backend_option", "batch_items"),
        ({"batch_items": True}, "invalid_backend_option", "batch_items"),
        ({"prefix_cache_bytes": -1}, "invalid_backend_option", "prefix_cache_bytes"),
        ({"prefill_chunk": 2.5}, "invalid_backend_option", "prefill_chunk"),
        ({"split_padding_tokens": -1}, "invalid_backend_option", "split_padding_tokens"),
        ({"no_such_option": 1}, "invalid_backend_option", "no_such_option"),
    ]:
        with pytest.raises(ValidationError) as err:
            Scorer(
                base.config,
                base.params,
                base.tokenizer,
                backend_options={"prefill_extend": options},
            )
        assert err.value.code == code
        assert err.value.param == f"backend_options.prefill_extend.{param}"
    with pytest.raises(ValidationError) as err:
        Scorer(base.config, base.params, base.tokenizer, backend_options={"no_such_backend": {}})
    assert err.value.code == "unknown_backend"


def test_item_length_buckets_hold_their_items():
    for n in range(0, 200):
        size = bucket_item_tokens(n)
        assert size >= max(n, 1) and (n > 32 or size - max(n, 1) < 4)
