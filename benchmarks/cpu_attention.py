"""The fused CPU attention kernel against XLA's ops, on the embedded default model, in one run.

prefill_extend's rows attend to their query's K/V either through the fused kernel
(`kernels/cpu_attention`, x86-64 with AVX-512) or through XLA's ops (`attention._prefix_parts`:
two matmuls with the masked softmax between them); the second variant sets
`prefix_kernel` to None, as `TPUSCORE_CPU_KERNELS=off` does.

    python benchmarks/cpu_attention.py --query-tokens 2000 --repeats 5

Printed, medians over the repeats, the variants alternating each repeat (each after
`jax.clear_caches()`; executables load back from a compilation cache in a temporary directory):
- attention: one layer's attention of 128 x 20 item tokens to the query's keys, alone, in
  GFLOP/s and as a share of the same run's 2048^3 float32 matmul rate;
- prefill: a fresh random query (no prefix cache hit) and one 3-token item;
- extend: 128 items of 20 tokens after a query already cached (one extend step).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from tpuscore import Scorer
from tpuscore.backends.buckets import bucket_prefix
from tpuscore.backends.prefill_extend import steps as prefill_extend
from tpuscore.engine import compilation_cache
from tpuscore.kernels import cpu_attention


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def matmul_rate(repeats: int = 5) -> float:
    a = jnp.asarray(np.random.default_rng(0).standard_normal((2048, 2048)), jnp.float32)
    mm = jax.jit(lambda a: jnp.matmul(a, a, precision="highest"))
    mm(a).block_until_ready()
    return 2 * 2048**3 / statistics.median(seconds(lambda: mm(a)) for _ in range(repeats)) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--query-tokens", default="2000")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"command: python {' '.join(sys.argv)}")
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    print(f"machine: {machine}, jax {jax.__version__} on {jax.devices()}, "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    if not cpu_attention.available():
        sys.exit(
            "the CPU attention kernel does not run here (see kernels/cpu_attention/library.py)"
        )
    compilation_cache.enable(tempfile.mkdtemp(prefix="cpu-attention-"))
    scorer = Scorer.from_pretrained(dtype="float32", backend="prefill_extend")
    config = scorer.config
    rng = np.random.default_rng(0)
    items = [rng.integers(100, config.vocab_size, 20).tolist() for _ in range(128)]
    kernel = prefill_extend.prefix_kernel
    variants = {"kernel": kernel, "XLA ops": lambda: None}
    K, N, H = config.num_kv_heads, config.num_heads, config.head_dim
    q = jnp.asarray(rng.standard_normal((128, 20, N, H)), jnp.float32)

    def attention(fused: bool, P: int) -> Callable:
        layer = attention.LayerAttention(window=None, scale=H**-0.5, softcap=None)
        blocks = prefill_extend.key_blocks(P)
        if fused:
            return jax.jit(lambda q, k, v, n: cpu_attention.prefix_attention(q, k, v, n, H**-0.5))
        return jax.jit(
            lambda q, k, v, n: attention._prefix_parts(
                q, k, v, jnp.arange(P) < n, layer, jnp.arange(20), blocks, n
            )
        )

    def fresh(n: int) -> list[int]:
        return rng.integers(100, config.vocab_size, n).tolist()

    def one_round(attend: Callable, k, v, n: int, cached: list[int]) -> dict[str, float]:
        return {
            "attention": seconds(lambda: attend(q, k, v, jnp.int32(n))),
            "prefill": seconds(lambda: scorer.score(fresh(n), [[5, 6, 7]], [1, 2])),
            "extend": seconds(lambda: scorer.score(cached, items, [1, 2])),
        }

    for n in map(int, args.query_tokens.split(",")):
        P = bucket_prefix(n)
        k = jnp.asarray(rng.standard_normal((K, H, P)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((K, P, H)), jnp.float32)
        attend = {name: attention(name == "kernel", P) for name in variants}
        cached = fresh(n)
        times = {
            (name, part): [] for name in variants for part in ("attention", "prefill", "extend")
        }
        rates = []
        for repeat in range(args.repeats + 1):
            rates.append(matmul_rate())
            for name, choice in variants.items():
                prefill_extend.prefix_kernel = choice
                jax.clear_caches()
                took = one_round(attend[name], k, v, n, cached)
                if repeat:  # the first repeat compiles, and caches the query
                    for part, t in took.items():
                        times[name, part].append(t)
        prefill_extend.prefix_kernel = kernel
        rate = statistics.median(rates)
        print(f"{n}-token query ({P} positions): 2048^3 float32 matmul {rate:.0f} GFLOP/s "
              f"(runs {min(rates):.0f}-{max(rates):.0f})")  # fmt: skip
        flop = 4 * q.shape[0] * q.shape[1] * N * n * H
        for part in ("attention", "prefill", "extend"):
            runs = {name: times[name, part] for name in variants}
            medians = {name: statistics.median(t) for name, t in runs.items()}
            line = []
            for name, t in runs.items():
                spread = (max(t) - min(t)) / medians[name]
                extra = ""
                if part == "attention":
                    achieved = flop / medians[name] / 1e9
                    extra = f", {achieved:.0f} GFLOP/s, {achieved / rate:.0%} of the matmul rate"
                line.append(f"{name} {medians[name]:.3f} s (spread {spread:.0%}{extra})")
            speedup = medians["XLA ops"] / medians["kernel"]
            print(f"  {part}: {'; '.join(line)}: {speedup:.2f}x")


if __name__ == "__main__":
    main()
