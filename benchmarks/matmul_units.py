"""The CPU's matrix units as JAX reaches them: matmul GFLOP/s (GOP/s for int8) in float32,
bfloat16 (float32 accumulation) and int8 (int32 accumulation), at 2048^3 and at the default
model's (SmolLM2-135M, 576 wide) projection and MLP shapes with the token counts of
vs_peers.py's geometries, under XLA's default CPU dot and its oneDNN and XNNPACK fusion paths.

Each variant (an XLA_FLAGS value) runs in its own subprocess: XLA reads its flags once, and an
unknown flag aborts the process, so a flag this jaxlib lacks is reported as such, not fatal.
The header lists the CPU flags that decide what the units can do (AVX-512 BF16/VNNI, AMX).

    python benchmarks/matmul_units.py
    python benchmarks/matmul_units.py --tokens 400 --budget 2e9     # a quick look
    python benchmarks/matmul_units.py --variant ynn-off=--xla_cpu_experimental_ynn_fusion_type=
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time

NO_YNN = "--xla_cpu_experimental_ynn_fusion_type="
# YNNPACK's dot fusion, jaxlib's default, takes precedence over the oneDNN and XNNPACK ones: each
# runs as asked and with YNNPACK off, which is what lets it claim the dot.
VARIANTS = {
    "default": "",
    "onednn dot": "--xla_cpu_experimental_onednn_fusion_type=dot",
    "xnnpack dot": "--xla_cpu_experimental_xnn_fusion_type=dot",
    "ynn off": NO_YNN,
    "onednn dot, ynn off": f"{NO_YNN} --xla_cpu_experimental_onednn_fusion_type=dot",
    "xnnpack dot, ynn off": f"{NO_YNN} --xla_cpu_experimental_xnn_fusion_type=dot",
}
DTYPES = ["float32", "bfloat16", "int8"]
CPU_FLAGS = ["avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"]
# Tokens in one scoring call of each vs_peers.py geometry: query + items x item tokens.
GEOMETRY_TOKENS = [300 + 10 * 10, 1000 + 64 * 20, 2000 + 100 * 20, 100 + 200 * 5, 50 + 20 * 100]
HIDDEN, KV, INTERMEDIATE = 576, 192, 1536  # SmolLM2-135M: 9 heads and 3 K/V heads of 64
# (name, in, out) of one layer's matmuls
LAYER = [("q/o proj", HIDDEN, HIDDEN), ("k/v proj", HIDDEN, KV),
         ("gate/up", HIDDEN, INTERMEDIATE), ("down", INTERMEDIATE, HIDDEN)]  # fmt: skip
# How the compiled HLO names a library's dot: a fusion kind or a custom call's target.
DOT_KIND = re.compile(r'"kind":"(__\w+)"|custom_call_target="([^"]+)"')


def cpu_flags() -> str:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return "no /proc/cpuinfo"
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                  if ln.startswith("model name")), "unknown")  # fmt: skip
    flags = next((set(ln.split(":", 1)[1].split()) for ln in text.splitlines()
                  if ln.startswith("flags")), set())  # fmt: skip
    return f"{model}; " + ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in CPU_FLAGS)


def shapes(tokens: list[int], square: bool) -> list[tuple[str, int, int, int]]:
    out = [("square", 2048, 2048, 2048)] if square else []
    out += [(name, m, k, n) for m in tokens for name, k, n in LAYER]
    return out


def measure(m: int, k: int, n: int, dtype: str, budget: float) -> tuple[float, str]:
    """Median GFLOP/s of jnp.dot over 5 runs, and the library XLA compiled it to."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    if dtype == "int8":
        a, b = (jnp.asarray(rng.integers(-127, 128, s, dtype=np.int8)) for s in ((m, k), (k, n)))
        acc = jnp.int32
    else:
        a, b = (jnp.asarray(rng.random(s, np.float32), dtype) for s in ((m, k), (k, n)))
        acc = jnp.float32
    fn = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=acc))
    hlo = fn.lower(a, b).compile().as_text()
    kinds = sorted({a or b for a, b in DOT_KIND.findall(hlo)})
    kind = ",".join(k.strip("_") for k in kinds) or "xla"
    fn(a, b).block_until_ready()
    flops = 2 * m * k * n
    reps = max(2, int(budget / flops))
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            out = fn(a, b)
        out.block_until_ready()
        runs.append((time.perf_counter() - start) / reps)
    return flops / statistics.median(runs) / 1e9, kind


def child(args) -> None:
    """Run in a variant's subprocess: one JSON line per (shape, dtype)."""
    import jax

    print(json.dumps({"jax": jax.__version__}), flush=True)
    for name, m, k, n in shapes(args.tokens, not args.no_square):
        for dtype in args.dtype:
            gflops, kind = measure(m, k, n, dtype, args.budget)
            row = {"shape": name, "m": m, "k": k, "n": n, "dtype": dtype}
            print(json.dumps({**row, "gflops": gflops, "kind": kind}), flush=True)


def run_variant(flags: str, argv: list[str]) -> tuple[list[dict], str]:
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()}
    proc = subprocess.run([sys.executable, __file__, "--child", *argv], env=env,
                          capture_output=True, text=True)  # fmt: skip
    rows = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode:
        tail = " ".join(proc.stderr.strip().splitlines()[-3:])[-300:]
        problem = "not accepted by this jaxlib" if "Unknown flag" in proc.stderr else "failed"
        return rows, f"{problem} (exit {proc.returncode}): {tail}"
    return rows, ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tokens", type=int, action="append",
        help=f"token counts of the model's shapes (default {GEOMETRY_TOKENS})",
    )  # fmt: skip
    parser.add_argument("--dtype", action="append", choices=DTYPES)
    parser.add_argument("--no-square", action="store_true", help="leave out 2048^3")
    parser.add_argument("--budget", type=float, default=2e10, help="FLOPs per timed run")
    parser.add_argument("--variant", action="append", metavar="NAME=XLA_FLAGS",
                        help=f"variants to run (default: {', '.join(VARIANTS)})")  # fmt: skip
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.tokens = args.tokens or GEOMETRY_TOKENS
    args.dtype = args.dtype or DTYPES
    if args.child:
        child(args)
        return
    variants = dict(v.split("=", 1) for v in args.variant) if args.variant else VARIANTS
    argv = [f"--budget={args.budget}", *(f"--tokens={t}" for t in args.tokens)]
    argv += [f"--dtype={d}" for d in args.dtype] + (["--no-square"] if args.no_square else [])
    print(f"- command: `python {' '.join(sys.argv)}`")
    print(f"- CPU: {cpu_flags()}; {os.cpu_count()} cores; load {os.getloadavg()[0]:.2f}")
    results, notes = {}, []
    for name, flags in variants.items():
        rows, problem = run_variant(flags, argv)
        if problem:
            notes.append(f"{name} (XLA_FLAGS={flags!r}): {problem}")
        results[name] = {(r["shape"], r["m"], r["dtype"]): r for r in rows if "dtype" in r}
        jax_version = next((r["jax"] for r in rows if "jax" in r), "?")
    print(f"- jax {jax_version}; GFLOP/s (GOP/s for int8), median of 5 runs; the library XLA "
          "compiled each dot to in brackets")  # fmt: skip
    for name, flags in variants.items():
        print(f"- {name}: XLA_FLAGS={flags or '(unset)'}")
    for note in notes:
        print(f"- {note}")
    names = list(variants)
    print("\n| shape (m x k x n) | dtype | " + " | ".join(names) + " |")
    print("| --- | --- |" + " ---: |" * len(names))
    for shape, m, k, n in shapes(args.tokens, not args.no_square):
        for dtype in args.dtype:
            cells = []
            for name in names:
                r = results[name].get((shape, m, dtype))
                cells.append(f"{r['gflops']:.0f} [{r['kind']}]" if r else "n/a")
            print(f"| {shape} {m} x {k} x {n} | {dtype} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
