"""The fused CPU segment kernel's float32 dots against its bfloat16 ones (AVX-512 BF16), in one run.

packed_segment on a CPU attends through `kernels/cpu_attention/segment_attention.cc`; in the
precisions whose weights are bfloat16 (`mixed`, `bfloat16`) its q.k and e.v dots run on bfloat16
operands (`CpuTiles.bf16`) where the CPU has AVX-512 BF16. This measures both ways:

    python benchmarks/segment_kernel_dtypes.py --geometry 300,10,10 --geometry 50,20,100

Printed, medians over the rounds, the variants alternating each round:
- kernel: the attention alone of one packed row of T tokens (a query and items of the
  geometry, SmolLM2's 9 heads over 3 kv heads of 64), in GFLOP/s of the visible pairs;
- scorer: `mixed` items/s of the default model's packed_segment at the geometry, a fresh
  query each call, and the largest |logprob difference| between the two variants.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from tpuscore import Scorer
from tpuscore.backends.contract import make_batch
from tpuscore.backends.packed import packing
from tpuscore.kernels import cpu_attention
from tpuscore.kernels.cpu_attention import CpuTiles
from tpuscore.kernels.segment.mask import segment_mask

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return platform.processor()
    name = next((line.split(":", 1)[1].strip() for line in lines if "model name" in line), "?")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    units = [f for f in ("avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(units) or 'no matrix-unit flags'})"


def kernel_rates(geometry, rounds: int, rng) -> dict[bool, float]:
    """GFLOP/s of the kernel's visible pairs (q.k and e.v) in float32 and bfloat16 dots."""
    q_len, count, length = geometry
    batch = make_batch([1] * q_len, [[2] * length] * count, [5], item_first=False)
    T = -(-(q_len + count * length) // 32) * 32
    chunk = packing.pack(batch, np.arange(count), T)
    prefix_len = jnp.asarray([chunk.prefix_len], jnp.int32)
    seg_start = jnp.asarray(chunk.seg_start[None])
    visible = int(segment_mask(prefix_len, seg_start, T).sum())
    flops = 4 * visible * HEADS * HEAD_DIM
    q, k, v = (
        jnp.asarray(rng.standard_normal((1, T, n, HEAD_DIM)), jnp.float32)
        for n in (HEADS, KV_HEADS, KV_HEADS)
    )
    call = jax.jit(cpu_attention.segment_attention, static_argnames=("scale", "bf16"))
    times: dict[bool, list[float]] = {False: [], True: []}
    for bf16 in times:
        call(q, k, v, prefix_len, seg_start, None, scale=0.125, bf16=bf16).block_until_ready()
    for _ in range(rounds):
        for bf16 in times:
            start = time.perf_counter()
            for _ in range(10):
                call(q, k, v, prefix_len, seg_start, None, scale=0.125, bf16=bf16)
            jax.block_until_ready(
                call(q, k, v, prefix_len, seg_start, None, scale=0.125, bf16=bf16)
            )
            times[bf16].append((time.perf_counter() - start) / 11)
    return {bf16: flops / statistics.median(t) / 1e9 for bf16, t in times.items()}


def scorer_rates(scorer: Scorer, geometry, rounds: int, rng) -> tuple[dict[bool, float], float]:
    """mixed items/s of packed_segment with the kernel's float32 and bfloat16 dots, and the
    largest |logprob difference| between them."""
    q_len, count, length = geometry
    vocab = scorer.config.vocab_size
    backend = scorer.get_backend("packed_segment")
    variants = {False: CpuTiles(bf16=False), True: CpuTiles(bf16=True)}

    def draw():
        return rng.integers(100, vocab, q_len).tolist(), rng.integers(
            100, vocab, (count, length)
        ).tolist()

    def run(bf16, request):
        backend.block_sizes = variants[bf16]
        return scorer.score(*request, [5, 7], backend="packed_segment").logprobs

    for bf16 in variants:  # compile both
        run(bf16, draw())
    times: dict[bool, list[float]] = {False: [], True: []}
    gap = 0.0
    for _ in range(rounds):
        request, got = draw(), {}
        for bf16 in variants:
            start = time.perf_counter()
            got[bf16] = run(bf16, request)
            times[bf16].append(time.perf_counter() - start)
        gap = max(gap, float(np.abs(got[True] - got[False]).max()))
    return {bf16: count / statistics.median(t) for bf16, t in times.items()}, gap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", action="append", help="query,items,item tokens")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    geometries = [
        tuple(map(int, g.split(","))) for g in args.geometry or ["300,10,10", "50,20,100"]
    ]
    if not cpu_attention.bf16_dots():
        raise SystemExit(
            "the kernel's bfloat16 dots do not run here (no AVX-512 BF16, or no kernel)"
        )
    print(f"CPU: {cpu_name()}; jax {jax.__version__}; load {os.getloadavg()[0]:.1f}")
    rng = np.random.default_rng(0)
    scorer = Scorer.from_pretrained(None, dtype="mixed")
    print(
        "| geometry | kernel float32 GFLOP/s | kernel bfloat16 GFLOP/s "
        "| mixed items/s, float32 dots | bfloat16 dots | max abs dlogprob |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for geometry in geometries:
        kernel = kernel_rates(geometry, args.rounds, rng)
        items, gap = scorer_rates(scorer, geometry, args.rounds, rng)
        print(
            f"| {', '.join(map(str, geometry))} | {kernel[False]:.0f} | {kernel[True]:.0f} | "
            f"{items[False]:.2f} | {items[True]:.2f} | {gap:.3f} |",
            flush=True,
        )
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
