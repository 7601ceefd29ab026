"""Items/s of one backend in each precision on the default model, timed in interleaved rounds
(float32, mixed, int8, float32, ...) so that a busy machine slows every precision alike.

Geometries as bench.py's (random token ids, seeded, 2 labels): "sglang" a 300-token query and
10 items of 10 tokens, "short" 100 + 100 x 10, "long" 2000 + 500 x 20. Every call scores a fresh
random query of the geometry's length (a prefix-cache hit would time less work), warmed once per
precision first, so compilation is excluded. The median of the rounds is reported.

    python benchmarks/precision_speed.py
    python benchmarks/precision_speed.py --geometry short --backend packed_dense --rounds 5
    python benchmarks/precision_speed.py --random   # random weights of the default model's shape
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

import numpy as np

from tpuscore import Scorer

GEOMETRIES = {"sglang": (300, 10, 10), "short": (100, 100, 10), "long": (2000, 500, 20)}


def cpu() -> str:
    with open("/proc/cpuinfo") as f:
        text = f.read()
    model = next(ln.split(":", 1)[1].strip() for ln in text.splitlines() if "model name" in ln)
    flags = set(next(ln for ln in text.splitlines() if ln.startswith("flags")).split())
    units = [f for f in ("avx512_bf16", "avx512_vnni", "amx_tile", "amx_int8") if f in flags]
    return f"{model}; {', '.join(units) or 'no bf16/int8 units'}; {os.cpu_count()} cores"


def random_smollm2():
    """(config, params): SmolLM2-135M's config (tests/helpers.py) and seeded noise weights."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
    from helpers import SMOLLM2_135M
    from tpuscore.models.weights import param_shapes

    rng = np.random.default_rng(0)

    def leaf(path, shape):
        norm = "norm" in path[-1].key
        noise = rng.standard_normal(shape, np.float32)
        return 1.0 + 0.1 * noise if norm else 0.02 * noise

    shapes = param_shapes(SMOLLM2_135M)
    import jax

    params = jax.tree_util.tree_map_with_path(leaf, shapes, is_leaf=lambda x: isinstance(x, tuple))
    return SMOLLM2_135M, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", action="append", choices=list(GEOMETRIES))
    parser.add_argument("--backend", default="prefill_extend")
    parser.add_argument("--dtypes", default="float32,mixed,int8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--random", action="store_true",
        help="seeded random weights of SmolLM2-135M's shape (machines without the default model)",
    )  # fmt: skip
    args = parser.parse_args()
    dtypes = args.dtypes.split(",")
    print(f"- CPU: {cpu()}; backend {args.backend}; load {os.getloadavg()[0]:.2f}")
    if args.random:
        scorers = {d: Scorer(*random_smollm2(), None, dtype=d) for d in dtypes}
    else:
        scorers = {d: Scorer.from_pretrained(None, dtype=d) for d in dtypes}
    vocab = scorers[dtypes[0]].config.vocab_size
    rng = np.random.default_rng(0)
    print("\n| geometry | " + " | ".join(f"{d} items/s" for d in dtypes) + " | vs float32 |")
    print("| --- |" + " ---: |" * (len(dtypes) + 1))
    for name in args.geometry or list(GEOMETRIES):
        query_len, count, item_len = GEOMETRIES[name]
        items = [rng.integers(0, vocab, item_len).tolist() for _ in range(count)]
        labels = rng.integers(0, vocab, 2).tolist()

        def call(d: str, query_len=query_len, items=items, labels=labels) -> float:
            query = rng.integers(0, vocab, query_len).tolist()
            start = time.perf_counter()
            scorers[d].score(query, items, label_token_ids=labels, backend=args.backend)
            return time.perf_counter() - start

        for d in dtypes:
            call(d)  # compile
        times: dict[str, list[float]] = {d: [] for d in dtypes}
        for _ in range(args.rounds):
            for d in dtypes:
                times[d].append(call(d))
        rate = {d: count / statistics.median(times[d]) for d in dtypes}
        base = rate.get("float32")
        ratios = ", ".join(f"{d} {rate[d] / base:.2f}x" for d in dtypes if base and d != "float32")
        cells = " | ".join(f"{rate[d]:.1f}" for d in dtypes)
        print(f"| {name}: {query_len} + {count} x {item_len} | {cells} | {ratios} |", flush=True)
    print(f"\nload at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
