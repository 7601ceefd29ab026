"""The segment-attention Pallas kernel (interpret mode off TPU) against its jnp reference."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpuscore.kernels.segment import executed_tiles, segment_attention
from tpuscore.kernels.segment.mask import segment_attention_reference, segment_mask
from tpuscore.kernels.segment.tpu import BlockSizes


def test_mask_matches_the_docstring_picture():
    # prefix 2, segments [2, 4) and [4, 6), row 6 padding.
    mask = segment_mask(jnp.array([2]), jnp.array([[0, 0, 2, 2, 4, 4, 6]]), 7)[0]
    picture = ["x......", "xx.....", "xxx....", "xxxx...", "xx..x..", "xx..xx.", "xx....x"]
    expected = np.array([[c == "x" for c in row] for row in picture])
    np.testing.assert_array_equal(np.asarray(mask), expected)


def test_window_mask_matches_the_docstring_picture():
    mask = segment_mask(jnp.array([2]), jnp.array([[0, 0, 2, 2, 4, 4, 6]]), 7, jnp.int32(2))[0]
    picture = ["x......", "xx.....", ".xx....", "..xx...", ".x..x..", "....xx.", ".x....x"]
    expected = np.array([[c == "x" for c in row] for row in picture])
    np.testing.assert_array_equal(np.asarray(mask), expected)


def layout(rng, tokens: int, prefix_len: int, max_segment: int, padding: int) -> np.ndarray:
    """seg_start [tokens]: a causal prefix, then random segments, then `padding` rows of one."""
    seg_start = np.arange(tokens, dtype=np.int32)
    seg_start[:prefix_len] = 0
    start, end = prefix_len, tokens - padding
    while start < end:
        stop = min(end, start + int(rng.integers(1, max_segment + 1)))
        seg_start[start:stop] = start
        start = stop
    return seg_start


def random_qkv(rng, batch, heads, kv_heads, tokens, head_dim, dtype=jnp.float32):
    def normal(shape):
        return jnp.asarray(rng.normal(size=shape), dtype)

    q = normal((batch, heads, tokens, head_dim))
    return (
        q,
        normal((batch, kv_heads, tokens, head_dim)),
        normal((batch, kv_heads, tokens, head_dim)),
    )


@pytest.mark.slow  # interpreted kernels on 8 random geometries: 10-20 s
@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 3]),
    tiles=st.integers(1, 3),
    block_q=st.sampled_from([8, 32, 128]),
    max_segment=st.sampled_from([3, 40, 300]),  # shorter than a tile, spanning tiles
    prefix_frac=st.floats(0, 1),
    padding=st.integers(0, 60),
    window=st.sampled_from([None, 1, 37, 200]),  # within a tile, across tiles
    softcap=st.sampled_from([None, 2.0]),
)
def test_kernel_equals_reference(
    seed, batch, kv_heads, group, tiles, block_q, max_segment, prefix_frac, padding, window,
    softcap,
):  # fmt: skip
    rng = np.random.default_rng(seed)
    tokens = 128 * tiles
    padding = min(padding, tokens - 1)
    prefix_lens = [int(prefix_frac * (tokens - padding)) for _ in range(batch)]
    seg_start = np.stack([layout(rng, tokens, p, max_segment, padding) for p in prefix_lens])
    q, k, v = random_qkv(rng, batch, kv_heads * group, kv_heads, tokens, 16)
    window = None if window is None else jnp.int32(window)
    args = (q, k, v, jnp.array(prefix_lens), jnp.asarray(seg_start), window)
    scores = {"scale": 0.2, "softcap": softcap}  # Gemma's: another scale, a tanh cap
    got = segment_attention(*args, **scores, block_sizes=BlockSizes(block_q, 128))
    expected = segment_attention_reference(*args, **scores)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)


def test_bfloat16_inputs_track_the_float32_reference(rng):
    q, k, v = random_qkv(rng, 1, 4, 2, 256, 32, jnp.bfloat16)
    seg_start = layout(rng, 256, 50, 20, 10)[None]
    args = (q, k, v, jnp.array([50]), jnp.asarray(seg_start))
    got = segment_attention(*args, block_sizes=BlockSizes(64, 128))
    assert got.dtype == jnp.bfloat16
    expected = segment_attention_reference(*args).astype(jnp.float32)
    np.testing.assert_allclose(got.astype(jnp.float32), expected, atol=2e-2, rtol=0)


@pytest.mark.parametrize("window", [None, 100])  # a window skips the query's early tiles too
def test_only_tiles_with_a_visible_key_run(rng, window):
    # A 200-token query and 64 items of 5-30 tokens, as packed for scoring.
    lens = rng.integers(5, 31, size=64)
    tokens = -(-(200 + lens.sum()) // 128) * 128
    seg_start = np.arange(tokens, dtype=np.int32)
    seg_start[:200] = 0
    for start, n in zip(200 + np.cumsum(lens) - lens, lens, strict=True):
        seg_start[start : start + n] = start
    blocks = BlockSizes(32, 128)
    q, k, v = random_qkv(rng, 1, 2, 1, tokens, 8)
    window = None if window is None else jnp.int32(window)
    metadata = (jnp.array([200]), jnp.asarray(seg_start[None]), window)
    ran = executed_tiles(q, k, v, *metadata, block_sizes=blocks)

    mask = np.asarray(segment_mask(*metadata[:2], tokens, window))[0]
    tiles = mask.reshape(tokens // 32, 32, tokens // 128, 128).any(axis=(1, 3))
    causal = np.tril(np.ones((tokens, tokens), bool)).reshape(tiles.shape[0], 32, -1, 128)
    dense, causal = tiles.size, int(causal.any(axis=(1, 3)).sum())
    print(f"tiles run: {ran}, causal: {causal}, dense: {dense}")
    assert ran == tiles.sum()  # exactly the non-empty tiles: none skipped wrongly, none wasted
    assert ran < 0.6 * causal < 0.6 * dense


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"block_q": 12}, "block_q must be a positive multiple of 8"),
        ({"block_q": 0}, "block_q must be a positive multiple of 8"),
        ({"block_kv": 64}, "block_kv must be a positive multiple of 128"),
        ({"block_kv": 128.0}, "block_kv must be a positive multiple of 128"),
    ],
)
def test_block_sizes_are_validated(fields, message):
    with pytest.raises(ValueError, match=message):
        BlockSizes(**fields)


def test_block_sizes_are_frozen():
    with pytest.raises(AttributeError):
        BlockSizes().block_q = 8


@pytest.mark.parametrize(
    "change, message",
    [
        ({"q": (1, 4, 128)}, r"q must be \[batch, heads, tokens, head_dim\]"),
        ({"k": (1, 2, 256, 16)}, r"k must be \[batch=1, kv_heads, tokens=128, head_dim=16\]"),
        ({"v": (1, 2, 128, 8)}, r"v must be \[batch=1, kv_heads, tokens=128, head_dim=16\]"),
        ({"v": (1, 1, 128, 16)}, "k and v kv_heads differ: 2 != 1"),
        ({"k": (1, 3, 128, 16), "v": (1, 3, 128, 16)}, "heads=4 must be a multiple of kv_heads=3"),
        ({"prefix_len": (2,)}, r"prefix_len must be \[batch=1\]"),
        ({"seg_start": (1, 64)}, r"seg_start must be \[batch=1, tokens=128\]"),
    ],
)
def test_bad_shapes_name_the_dimension(change, message):
    shapes = {"q": (1, 4, 128, 16), "k": (1, 2, 128, 16), "v": (1, 2, 128, 16)}
    shapes |= {"prefix_len": (1,), "seg_start": (1, 128)} | change
    args = {
        name: jnp.zeros(shape, jnp.int32 if "_" in name else jnp.float32)
        for name, shape in shapes.items()
    }
    with pytest.raises(ValueError, match=message):
        segment_attention(**args)


def test_tokens_must_fill_whole_tiles():
    q, k, v = (jnp.zeros((1, 2, 192, 8)) for _ in range(3))
    with pytest.raises(ValueError, match="tokens=192 must be a multiple of block_q=128"):
        segment_attention(q, k, v, jnp.zeros(1, jnp.int32), jnp.zeros((1, 192), jnp.int32))
