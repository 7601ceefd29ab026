"""Items/s of the default model at a few geometries, backend `auto`, in one process: the unit of an
A/B between two checkouts, run alternately (PYTHONPATH picks the checkout):

    for i in 1 2 3; do
      for tree in old new; do TAG=$tree PYTHONPATH=../$tree/src \\
        python benchmarks/items_per_second.py mixed 300,10,10 50,20,100; done; done

Pinned to cores 0-1 where it may be; two warm-up calls per geometry, then the median of `--calls`
calls, each a fresh random query and items (labels 5 and 7). Prints one line: TAG, the dtype,
items/s per geometry, the backend auto picked last, and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from tpuscore import Scorer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dtype")
    parser.add_argument("geometry", nargs="+", help="query,items,item tokens")
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 2:
        os.sched_setaffinity(0, {0, 1})
    scorer = Scorer.from_pretrained(None, dtype=args.dtype)
    rng = np.random.default_rng(0)
    vocab = scorer.config.vocab_size
    rates, backend = {}, None
    for geometry in args.geometry:
        q, n, length = map(int, geometry.split(","))

        def draw(q=q, n=n, length=length):
            return rng.integers(100, vocab, q).tolist(), rng.integers(
                100, vocab, (n, length)
            ).tolist()

        for _ in range(2):
            scorer.score(*draw(), [5, 7])
        times = []
        for _ in range(args.calls):
            request = draw()
            start = time.perf_counter()
            backend = scorer.score(*request, [5, 7]).backend
            times.append(time.perf_counter() - start)
        rates[geometry] = round(n / statistics.median(times), 2)
    tag = os.environ.get("TAG", "")
    print(tag, args.dtype, rates, backend, "load", round(os.getloadavg()[0], 2), flush=True)


if __name__ == "__main__":
    main()
