"""Where a warm call's time goes on the CPU: a JAX profiler trace of one `Scorer.score` at a
geometry (default model, backend auto, on cores 0-1), its XLA:CPU events summed by name, then the
wall time covered by YNNPACK's dots (`ynn_fusion*`: projections, MLP and attention's dots), by
tpuscore's attention kernel (`ffi_call*`) and by every other fusion (norms, RoPE, conversions,
softmax, residual adds), with each one's thread time (above its wall time where two ran at once).

    python benchmarks/step_trace.py mixed 50,20,100
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import pathlib
import tempfile
import time

import numpy as np

os.sched_setaffinity(0, {0, 1})  # before JAX sizes its thread pool, as vs_peers.py runs it

import jax  # noqa: E402

from tpuscore import Scorer  # noqa: E402

NOT_OPS = ("ThunkExecutor", "$", "SlinkyThreadPool", "while")  # executors, Python frames, waits


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
    args = parser.parse_args()
    query_len, n_items, item_len = (int(x) for x in args.geometry.split(","))
    scorer = Scorer.from_pretrained(None, dtype=args.dtype)
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
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "ts" in e]
    ops = [e for e in events if not e["name"].startswith(NOT_OPS)]
    totals, counts = collections.Counter(), collections.Counter()
    for e in ops:
        totals[e["name"]] += e["dur"]
        counts[e["name"]] += 1
    print(f"{args.dtype} {args.geometry}: the call took {wall * 1e3:.0f} ms")
    for name, us in totals.most_common(args.top):
        print(f"{us / 1e3:9.1f} ms {counts[name]:5d}x  {name}")
    kinds = {
        "YNNPACK dots": [e for e in ops if e["name"].startswith("ynn_fusion")],
        "the attention kernel": [e for e in ops if e["name"].startswith("ffi_call")],
        "other fusions": [e for e in ops if not e["name"].startswith(("ynn_fusion", "ffi_call"))],
    }
    every = [(e["ts"], e["ts"] + e["dur"]) for e in ops]
    print(f"wall covered by any op: {covered(every) / 1e3:.0f} ms")
    for kind, chosen in kinds.items():
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in chosen]
        thread = sum(e["dur"] for e in chosen)
        print(f"  {kind}: {covered(spans) / 1e3:.0f} ms of wall, {thread / 1e3:.0f} ms of threads")


if __name__ == "__main__":
    main()
