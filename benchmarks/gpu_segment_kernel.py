"""The Triton segment kernel on a GPU: compiled (not interpreted), checked against the jnp
reference and the tile count, and timed against XLA attention under the dense mask.

    python benchmarks/gpu_segment_kernel.py

Layouts are packed scoring sequences with Qwen3-0.6B's heads (16 query, 8 kv, head dim 128), B=1.
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from tpuscore.kernels.segment import executed_tiles, segment_attention
from tpuscore.kernels.segment.gpu import GpuBlockSizes
from tpuscore.kernels.segment.mask import segment_attention_reference, segment_mask

LAYOUTS = {"long": (2000, 500, 20), "sglang": (300, 10, 10), "short": (100, 100, 10)}
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}


def packed(query_len: int, count: int, item_len: int, tile: int):
    tokens = -(-(query_len + count * item_len) // tile) * tile
    seg_start = np.arange(tokens, dtype=np.int32)
    seg_start[:query_len] = 0
    for i in range(count):
        start = query_len + i * item_len
        seg_start[start : start + item_len] = start
    return tokens, jnp.array([query_len]), jnp.asarray(seg_start[None])


def median_ms(fn, repeats: int = 10) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    print(f"command: python {' '.join(sys.argv)}")
    print(f"jax {jax.__version__}, devices {jax.devices()}")
    blocks = GpuBlockSizes()
    dense = jax.jit(segment_attention_reference)
    print("| layout | dtype | tokens | tiles run / causal | max abs diff | kernel ms | dense ms |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    rng = np.random.default_rng(0)
    for name, geometry in LAYOUTS.items():
        tokens, prefix_len, seg_start = packed(*geometry, blocks.tile)
        for dtype in ("float32", "bfloat16"):
            q, k, v = (jnp.asarray(rng.normal(size=(1, h, tokens, 128)), dtype) for h in (16, 8, 8))
            args = (q, k, v, prefix_len, seg_start)
            got = segment_attention(*args, block_sizes=blocks)
            want = dense(*args)
            diff = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
            ran = executed_tiles(*args, block_sizes=blocks)
            mask = np.asarray(segment_mask(prefix_len, seg_start, tokens))[0]
            nq, nk = tokens // blocks.block_q, tokens // blocks.block_kv
            tiles = mask.reshape(nq, blocks.block_q, nk, blocks.block_kv).any(axis=(1, 3))
            causal = sum(min(nk, (i + 1) * blocks.block_q // blocks.block_kv) for i in range(nq))
            assert ran == tiles.sum() * 8, (ran, tiles.sum())  # per kv head
            ok = "ok" if diff <= TOLERANCE[dtype] else "FAILED"
            kernel_ms = median_ms(lambda a=args: segment_attention(*a, block_sizes=blocks))
            dense_ms = median_ms(lambda a=args: dense(*a))
            print(
                f"| {name} | {dtype} | {tokens} | {ran // 8} / {causal} | {diff:.1e} {ok} "
                f"| {kernel_ms:.3f} | {dense_ms:.3f} |"
            )
            sys.stdout.flush()


if __name__ == "__main__":
    main()
