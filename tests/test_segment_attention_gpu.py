"""The GPU (Triton) segment kernel: interpret mode against the jnp reference, the same tiles as
the TPU kernel, and a CUDA lowering for the model geometries it serves."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_segment_attention import layout, random_qkv
from tpuscore.kernels.segment import executed_tiles, gpu, segment_attention
from tpuscore.kernels.segment.gpu import GpuBlockSizes, tuned_block_sizes
from tpuscore.kernels.segment.mask import segment_attention_reference, segment_mask
from tpuscore.kernels.segment.tpu import BlockSizes


@pytest.mark.slow  # interpreted kernels on 4 random geometries: 10-20 s
@settings(max_examples=4, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 3]),
    tiles=st.integers(1, 3),
    block_q=st.sampled_from([16, 32, 64]),
    max_segment=st.sampled_from([3, 40, 300]),  # shorter than a tile, spanning tiles
    prefix_frac=st.floats(0, 1),
    padding=st.integers(0, 60),
    head_dim=st.sampled_from([10, 16]),  # 10: zero-padded to a power of two
    window=st.sampled_from([None, 1, 37, 100]),
)
def test_kernel_equals_reference(
    seed, batch, kv_heads, group, tiles, block_q, max_segment, prefix_frac, padding, head_dim,
    window,
):  # fmt: skip
    rng = np.random.default_rng(seed)
    tokens = 64 * tiles
    padding = min(padding, tokens - 1)
    prefix_lens = [int(prefix_frac * (tokens - padding)) for _ in range(batch)]
    seg_start = np.stack([layout(rng, tokens, p, max_segment, padding) for p in prefix_lens])
    q, k, v = random_qkv(rng, batch, kv_heads * group, kv_heads, tokens, head_dim)
    window = None if window is None else jnp.int32(window)
    args = (q, k, v, jnp.array(prefix_lens), jnp.asarray(seg_start), window)
    scores = {"scale": 0.2, "softcap": 2.0}
    got = segment_attention(*args, **scores, block_sizes=GpuBlockSizes(block_q, 64), interpret=True)
    expected = segment_attention_reference(*args, **scores)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)


def test_bfloat16_inputs_track_the_float32_reference(rng):
    q, k, v = random_qkv(rng, 1, 4, 2, 128, 32, jnp.bfloat16)
    seg_start = layout(rng, 128, 50, 20, 10)[None]
    args = (q, k, v, jnp.array([50]), jnp.asarray(seg_start))
    got = segment_attention(*args, block_sizes=GpuBlockSizes(), interpret=True)
    assert got.dtype == jnp.bfloat16
    expected = segment_attention_reference(*args).astype(jnp.float32)
    np.testing.assert_allclose(got.astype(jnp.float32), expected, atol=2e-2, rtol=0)


def items_after_query(query_len: int, lens: np.ndarray, tile: int) -> np.ndarray:
    """seg_start [tokens]: a causal query of query_len, then one segment per item length, then
    single-row padding to a multiple of `tile`."""
    tokens = -(-(query_len + lens.sum()) // tile) * tile
    seg_start = np.arange(tokens, dtype=np.int32)
    seg_start[:query_len] = 0
    for start, n in zip(query_len + np.cumsum(lens) - lens, lens, strict=True):
        seg_start[start : start + n] = start
    return seg_start


# A query shorter than a tile (40) with the slow tests: each case runs the kernel in Triton's
# interpreter here (~4 s), and the 203-token query's tiles include whole and partial ones.
@pytest.mark.parametrize(
    "query_len, window",
    [(203, None), (203, 150), pytest.param(40, None, marks=pytest.mark.slow)],
)
def test_tiles_seen_whole_skip_the_mask_and_change_nothing(rng, query_len, window):
    """A long query's interior tiles run unmasked (`mask_every_tile=False`): the reference's
    numbers, and masking every tile's to float32 rounding (the same tiles in the same order)."""
    seg_start = items_after_query(query_len, rng.integers(3, 25, size=12), 64)
    q, k, v = random_qkv(rng, 1, 4, 2, len(seg_start), 16)
    window = None if window is None else jnp.int32(window)
    args = (q, k, v, jnp.array([query_len]), jnp.asarray(seg_start[None]), window)
    got = {
        masked: segment_attention(
            *args,
            softcap=3.0,
            block_sizes=GpuBlockSizes(32, 16, mask_every_tile=masked),
            interpret=True,
        )  # fmt: skip
        for masked in (False, True)
    }
    np.testing.assert_allclose(got[False], got[True], atol=1e-6, rtol=0)
    expected = segment_attention_reference(*args, softcap=3.0)
    np.testing.assert_allclose(got[False], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("query_len, max_len, window", [(200, 30, None), (40, 150, 70)])
def test_runs_the_same_tiles_as_the_tpu_kernel(rng, query_len, max_len, window):
    seg_start = items_after_query(query_len, rng.integers(5, max_len + 1, size=24), 128)
    tokens = len(seg_start)
    q, k, v = random_qkv(rng, 1, 2, 1, tokens, 16)
    window = None if window is None else jnp.int32(window)
    args = (q, k, v, jnp.array([query_len]), jnp.asarray(seg_start[None]), window)
    gpu = executed_tiles(*args, block_sizes=GpuBlockSizes(32, 128), interpret=True)
    tpu = executed_tiles(*args, block_sizes=BlockSizes(32, 128), interpret=True)
    mask = np.asarray(segment_mask(args[3], args[4], tokens, window))[0]
    visible = mask.reshape(tokens // 32, 32, tokens // 128, 128).any(axis=(1, 3)).sum()
    assert gpu == tpu == visible


HEADS = {  # (heads, kv heads, head dim)
    "smollm2-135m": (9, 3, 64),
    "qwen3-0.6b": (16, 8, 128),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("model", HEADS)
def test_lowers_for_cuda(model, dtype):
    heads, kv_heads, head_dim = HEADS[model]
    tokens = 512
    shape = jax.ShapeDtypeStruct
    args = (
        shape((1, heads, tokens, head_dim), dtype),
        shape((1, kv_heads, tokens, head_dim), dtype),
        shape((1, kv_heads, tokens, head_dim), dtype),
        shape((1,), jnp.int32),
        shape((1, tokens), jnp.int32),
    )
    f = functools.partial(segment_attention, block_sizes=GpuBlockSizes(), interpret=False)
    # jax.export refuses to serialize Triton calls (no stable format), so lower without export.
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text or "triton_kernel_call" in text


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"block_q": 24}, "block_q must be a power of two >= 16"),
        ({"block_kv": 8}, "block_kv must be a power of two >= 16"),
        ({"num_warps": 0}, "num_warps must be a positive int"),
        ({"mask_every_tile": 1}, "mask_every_tile must be a bool"),
    ],
)
def test_block_sizes_are_validated(fields, message):
    with pytest.raises(ValueError, match=message):
        GpuBlockSizes(**fields)


def test_tokens_must_fill_whole_tiles():
    q, k, v = (jnp.zeros((1, 2, 96, 16)) for _ in range(3))
    with pytest.raises(ValueError, match="tokens=96 must be a multiple of block_q=64"):
        segment_attention(
            q,
            k,
            v,
            jnp.zeros(1, jnp.int32),
            jnp.zeros((1, 96), jnp.int32),
            block_sizes=GpuBlockSizes(),
        )


def test_shipped_swept_tiles_are_valid():
    """Every entry `benchmarks/triton_sweep.py --write` recorded builds its GpuBlockSizes."""
    for kind, entries in json.loads(gpu.TILES_FILE.read_text()).items():
        for key, fields in entries.items():
            assert tuned_block_sizes(kind, *_key_parts(key)) == GpuBlockSizes(**fields)


def test_swept_tiles_apply_to_their_gpu_kind_only(tmp_path, monkeypatch):
    swept = {"GPU X": {gpu.tiles_key(128, jnp.bfloat16): dict(block_q=128, num_warps=8)}}
    (tmp_path / "tiles.json").write_text(json.dumps(swept))
    monkeypatch.setattr(gpu, "TILES_FILE", tmp_path / "tiles.json")
    assert tuned_block_sizes("GPU X", 128, jnp.bfloat16) == GpuBlockSizes(block_q=128, num_warps=8)
    assert tuned_block_sizes("GPU X", 128, jnp.float32) == GpuBlockSizes()
    assert tuned_block_sizes("GPU X", 64, jnp.bfloat16) == GpuBlockSizes()
    assert tuned_block_sizes("GPU Y", 128, jnp.bfloat16) == GpuBlockSizes()


def _key_parts(key: str) -> tuple[int, str]:
    fields = dict(part.split("=") for part in key.split(","))
    return int(fields["head_dim"]), fields["dtype"]
