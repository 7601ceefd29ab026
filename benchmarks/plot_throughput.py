"""Items/s of each backend against item count and against query length: the figure in
docs/benchmarks.md (docs/throughput.png), and the measurements behind it (docs/throughput.json).

Two sweeps on random token ids (seeded), 2 labels, a new query for every timed call (so the
prefix cache never hits), each point the median of --repeats calls after one that compiles:

- item count: a 256-token query with 1 to 256 items of 16 tokens;
- query length: 32 items of 16 tokens after a 32- to 2048-token query.

    python benchmarks/plot_throughput.py                 # measure on the default model, then plot
    python benchmarks/plot_throughput.py --plot-only     # redraw docs/throughput.png from the JSON
    python benchmarks/plot_throughput.py --gpu --json $OUT/throughput.json --no-plot
                                                         # a random Qwen3-0.6B in bfloat16 on CUDA

Needs matplotlib to plot (the `docs` extra); measuring does not.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
BACKENDS = ("prefill_extend", "packed_dense", "serial")
ITEM_COUNTS = (1, 4, 16, 64, 256)
QUERY_LENGTHS = (32, 128, 512, 2048)
QUERY_FOR_ITEMS, ITEMS_FOR_QUERY, ITEM_TOKENS = 256, 32, 16


def items_per_s(scorer, backend: str, query_len: int, num_items: int, repeats: int, rng) -> float:
    vocab = scorer.config.vocab_size

    def call() -> float:
        query = rng.integers(0, vocab, query_len).tolist()
        items = rng.integers(0, vocab, (num_items, ITEM_TOKENS)).tolist()
        start = time.perf_counter()
        scorer.score(query, items, label_token_ids=[0, 1], backend=backend)
        return time.perf_counter() - start

    call()  # compile
    return num_items / statistics.median(call() for _ in range(repeats))


def measure(args: argparse.Namespace) -> dict:
    import jax

    from tpuscore import Scorer

    checkpoint, model = None, "embedded default (SmolLM2-135M)"
    if args.gpu:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from random_checkpoint import qwen3_0_6b

        checkpoint, model = qwen3_0_6b(args.checkpoint, dtype=args.dtype), "random Qwen3-0.6B"
    scorer = Scorer.from_pretrained(checkpoint, dtype=args.dtype)
    rng = np.random.default_rng(args.seed)
    backends = args.backends.split(",")
    data = {
        "command": "python " + " ".join(sys.argv),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}",
        "model": model,
        "dtype": args.dtype,
        "item_tokens": ITEM_TOKENS,
        "by_items": {"query_tokens": QUERY_FOR_ITEMS, "x": list(ITEM_COUNTS), "items_per_s": {}},
        "by_query": {"num_items": ITEMS_FOR_QUERY, "x": list(QUERY_LENGTHS), "items_per_s": {}},
    }
    for backend in backends:
        for sweep, points in (
            ("by_items", [(QUERY_FOR_ITEMS, n) for n in ITEM_COUNTS]),
            ("by_query", [(q, ITEMS_FOR_QUERY) for q in QUERY_LENGTHS]),
        ):
            rates = []
            for query_len, num_items in points:
                rates.append(items_per_s(scorer, backend, query_len, num_items, args.repeats, rng))
                print(f"{backend} query {query_len} items {num_items}: {rates[-1]:.1f} items/s")
            data[sweep]["items_per_s"][backend] = rates
    return data


def plot(data: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    panels = (
        ("by_items", f"items ({data['by_items']['query_tokens']}-token query)"),
        ("by_query", f"query tokens ({data['by_query']['num_items']} items)"),
    )
    for ax, (sweep, label) in zip(axes, panels, strict=True):
        for backend, rates in data[sweep]["items_per_s"].items():
            ax.plot(data[sweep]["x"], rates, marker="o", label=backend)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("items/s")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle(
        f"{data['model']}, {data['dtype']}, items of {data['item_tokens']} tokens\n"
        f"{data['machine']}",
        fontsize=9,
    )
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=pathlib.Path, default=ROOT / "docs" / "throughput.json")
    parser.add_argument("--png", type=pathlib.Path, default=ROOT / "docs" / "throughput.png")
    parser.add_argument("--plot-only", action="store_true", help="redraw from --json")
    parser.add_argument("--no-plot", action="store_true", help="measure and write --json only")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpu", action="store_true", help="a random Qwen3-0.6B-shaped model")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"])
    parser.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(), "qwen3-0.6b"))
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.gpu else "float32")
    if args.plot_only:
        data = json.loads(args.json.read_text())
    else:
        data = measure(args)
        args.json.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {args.json}")
    if not args.no_plot:
        plot(data, args.png)


if __name__ == "__main__":
    main()
