"""A long query's prefill on the embedded default model, with and without key blocks, in one run:

- key blocks (the default): each prefill chunk meets the query's K/V buffer in blocks about a
  chunk wide and skips those no earlier chunk filled;
- whole buffer: each chunk reads the whole buffer, masked past the query's length (the limit
  `MAX_PREFILL_KEY_BLOCKS` set to 1, as before the key blocks).

    python benchmarks/prefill_key_blocks.py --query-tokens 2000 --repeats 9

Each call scores one 3-token item after a fresh random query (no prefix cache hit), so its time
is the prefill's; the first call of each variant compiles and is not timed. The variants run one
after the other, each after `jax.clear_caches()`.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import jax
import numpy as np

from tpuscore import Scorer
from tpuscore.backends.prefill_extend import backend as prefill_extend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--query-tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    print(f"command: python {' '.join(sys.argv)}")
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    print(f"machine: {machine}, jax {jax.__version__} on {jax.devices()}, "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    scorer = Scorer.from_pretrained(dtype=args.dtype)
    rng = np.random.default_rng(0)

    def call() -> float:
        query = rng.integers(100, scorer.config.vocab_size, args.query_tokens).tolist()
        start = time.perf_counter()
        scorer.score(query, [[5, 6, 7]], [1, 2], backend="prefill_extend")
        return time.perf_counter() - start

    default = prefill_extend.MAX_PREFILL_KEY_BLOCKS
    medians = {}
    for name, limit in (("key blocks", default), ("whole buffer", 1)):
        prefill_extend.MAX_PREFILL_KEY_BLOCKS = limit
        jax.clear_caches()
        call()  # compiles
        times = [call() for _ in range(args.repeats)]
        medians[name] = statistics.median(times)
        spread = (max(times) - min(times)) / medians[name]
        print(f"{name:>12}: median {medians[name]:.3f} s over {args.repeats} fresh queries of "
              f"{args.query_tokens} tokens (spread {spread:.0%})")  # fmt: skip
    prefill_extend.MAX_PREFILL_KEY_BLOCKS = default
    print(f"key blocks: {medians['whole buffer'] / medians['key blocks']:.2f}x the whole buffer")


if __name__ == "__main__":
    main()
