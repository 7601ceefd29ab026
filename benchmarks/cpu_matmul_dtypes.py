"""float32 against bfloat16 (float32 accumulation) matmul GFLOP/s in JAX, at 2048^3 and at the
default model's step shapes, with what XLA:CPU compiled each dot to.

Tells whether a bfloat16 precision can pay on this CPU: without AVX512_BF16 or AMX, XLA (and
oneDNN) widen bfloat16 to float32 and the bfloat16 dot runs slower than the float32 one.

    python benchmarks/cpu_matmul_dtypes.py
    XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=-individual_dot \
        python benchmarks/cpu_matmul_dtypes.py  # XLA's own dot instead of YNNPACK
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

# (tokens, in, out): a square; a 512-token step's q projection, MLP up and down; the LM head.
SHAPES = [(2048, 2048, 2048), (512, 576, 576), (512, 576, 1536), (512, 1536, 576), (64, 576, 49152)]


def cpu_flags() -> str:
    with open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), "")
    wanted = ("avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")
    present = set(flags.split())
    return ", ".join(f"{w} {'yes' if w in present else 'no'}" for w in wanted)


def rate(m: int, k: int, n: int, dtype) -> tuple[float, str]:
    rng = np.random.default_rng(0)
    a, b = (jnp.asarray(rng.random(s, np.float32), dtype) for s in ((m, k), (k, n)))
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    fn = jax.jit(
        lambda x, y: jnp.matmul(x, y, precision=precision, preferred_element_type=jnp.float32)
    )
    hlo = fn.lower(a, b).compile().as_text().split("ENTRY")[1]
    kind = "ynn_fusion" if "__ynn_fusion" in hlo else "xla dot"
    fn(a, b).block_until_ready()
    reps = max(3, int(2e10 / (2 * m * k * n)))
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            out = fn(a, b)
        out.block_until_ready()
        runs.append((time.perf_counter() - start) / reps)
    return 2 * m * k * n / statistics.median(runs) / 1e9, kind


def main() -> None:
    print(f"- cpu flags: {cpu_flags()}; {os.cpu_count()} cores; jax {jax.__version__}")
    print(f"- XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; load {os.getloadavg()[0]:.2f}\n")
    print("| m x k x n | float32 GFLOP/s | bfloat16 GFLOP/s | bf16 / f32 | dot |")
    print("| --- | ---: | ---: | ---: | --- |")
    for shape in SHAPES:
        f32, kind = rate(*shape, jnp.float32)
        bf16, _ = rate(*shape, jnp.bfloat16)
        print(
            f"| {'x'.join(map(str, shape))} | {f32:.0f} | {bf16:.0f} | {bf16 / f32:.2f} | {kind} |"
        )
    print(f"\nload at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
