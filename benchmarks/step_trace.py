"""Where a warm call's time goes: a JAX profiler trace of one `Scorer.score` at a geometry, its
device events summed by name, then the wall time covered by the matmuls, by tpuscore's attention
kernel and by every other fusion (norms, RoPE, conversions, softmax, residual adds), with each
one's summed time (above its wall time where two ran at once).

On the CPU (default model, backend auto, on cores 0-1) the matmuls are YNNPACK's dots
(`ynn_fusion*`) and the kernel the fused FFI call (`ffi_call*`); with --gpu (the random
Qwen3-0.6B of `random_checkpoint.py`, packed_segment unless --backend) the GPU's kernels: GEMMs
by their library names, the Triton segment kernel by its own.

    python benchmarks/step_trace.py mixed 50,20,100
    python benchmarks/step_trace.py bfloat16 2000,500,20 --gpu
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import pathlib
import re
import sys
import tempfile
import time

import numpy as np

GPU = "--gpu" in sys.argv
if not GPU:
    os.sched_setaffinity(0, {0, 1})  # before JAX sizes its thread pool, as vs_peers.py runs it

import jax  # noqa: E402

from tpuscore import Scorer  # noqa: E402

NOT_OPS = ("ThunkExecutor", "$", "SlinkyThreadPool", "while")  # executors, Python frames, waits
KINDS = {  # (CPU, GPU) name patterns; everything else is "other fusions"
    "matmuls": (r"^ynn_fusion", r"gemm|xmma|nvjet|cutlass|cublas|dot"),
    "the attention kernel": (r"^ffi_call", r"segment_attention"),
}


def covered(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, stop) intervals."""
    total, current = 0.0, None
    for start, stop in sorted(intervals):
        if current is None or start > current[1]:
            total += 0 if current is None else current[1] - current[0]
            current = [start, stop]
        else:
            current[1] = max(current[1], stop)
    return total + (0 if current is None else current[1] - current[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dtype", help="float32, mixed, ...")
    parser.add_argument("geometry", help="query tokens,items,item tokens")
    parser.add_argument("--top", type=int, default=25, help="events to list by total time")
    parser.add_argument("--gpu", action="store_true", help="the random Qwen3-0.6B on the GPU")
    parser.add_argument("--backend", default=None, help="default: auto (CPU), packed_segment")
    parser.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(), "qwen3-0.6b"))
    args = parser.parse_args()
    query_len, n_items, item_len = (int(x) for x in args.geometry.split(","))
    if args.gpu:
        sys.path.insert(0, str(pathlib.Path(__file__).parent))
        from random_checkpoint import qwen3_0_6b

        model, backend = qwen3_0_6b(args.checkpoint), args.backend or "packed_segment"
    else:
        model, backend = None, args.backend or "auto"
    scorer = Scorer.from_pretrained(model, dtype=args.dtype, backend=backend)
    rng = np.random.default_rng(0)

    def draw():
        vocab = scorer.config.vocab_size
        query = rng.integers(100, vocab, query_len).tolist()
        return query, [rng.integers(100, vocab, item_len).tolist() for _ in range(n_items)]

    for _ in range(2):  # compiles, then warms
        scorer.score(*draw(), [5, 7])
    folder = tempfile.mkdtemp(prefix="step_trace_")
    with jax.profiler.trace(folder, create_perfetto_trace=True):
        start = time.perf_counter()
        scorer.score(*draw(), [5, 7])
        wall = time.perf_counter() - start
    path = next(pathlib.Path(folder).rglob("*.trace.json.gz"))
    with gzip.open(path) as f:
        trace = json.load(f)["traceEvents"]
    events = [e for e in trace if e.get("ph") == "X" and "ts" in e]
    if args.gpu:  # the GPU's own lanes: kernels and copies, not the host threads that launch them
        lanes = {
            e["pid"]
            for e in trace
            if e.get("ph") == "M" and "GPU" in str(e.get("args", {}).get("name", ""))
        }
        if lanes:
            events = [e for e in events if e["pid"] in lanes]
        else:
            print("NOTE: no GPU lane in the trace: every event counted")
    ops = [e for e in events if not e["name"].startswith(NOT_OPS)]
    totals, counts = collections.Counter(), collections.Counter()
    for e in ops:
        totals[e["name"]] += e["dur"]
        counts[e["name"]] += 1
    print(f"{args.dtype} {args.geometry} {backend}: the call took {wall * 1e3:.1f} ms")
    for name, us in totals.most_common(args.top):
        print(f"{us / 1e3:9.1f} ms {counts[name]:5d}x  {name}")
    patterns = {kind: re.compile(pair[args.gpu], re.I) for kind, pair in KINDS.items()}
    kinds = {kind: [e for e in ops if p.search(e["name"])] for kind, p in patterns.items()}
    kinds["other fusions"] = [
        e for e in ops if not any(p.search(e["name"]) for p in patterns.values())
    ]
    every = [(e["ts"], e["ts"] + e["dur"]) for e in ops]
    print(f"wall covered by any op: {covered(every) / 1e3:.1f} ms")
    for kind, chosen in kinds.items():
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in chosen]
        summed = sum(e["dur"] for e in chosen)
        print(f"  {kind}: {covered(spans) / 1e3:.1f} ms of wall, {summed / 1e3:.1f} ms summed")


if __name__ == "__main__":
    main()
