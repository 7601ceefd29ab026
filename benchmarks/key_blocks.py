"""prefill_extend's key blocks on the embedded default model, with and without them, in one run.

A step meets its query's K/V buffer in key blocks and skips those past the query's length
(`key_blocks`): a long query's prefill chunk reads only the keys before it, and an extend step
skips the positions the buffer's power-of-two bucket pads the query to. Without: every step
reads the whole buffer (the limit `MAX_KEY_BLOCKS` set to 1).

    python benchmarks/key_blocks.py --query-tokens 1100,2000 --repeats 5

Per query length, two timings per variant, medians over the repeats:
- prefill: a fresh random query (no prefix cache hit) and one 3-token item;
- extend: 128 items of 20 tokens after a query already cached (one extend step).
The first call of each variant compiles and is not timed; the variants alternate each repeat,
each after `jax.clear_caches()` (its executables then load from a compilation cache in a
temporary directory rather than compiling again).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

from tpuscore import Scorer
from tpuscore.backends.prefill_extend import steps as prefill_extend
from tpuscore.engine import compilation_cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--query-tokens", default="1100,2000")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    print(f"command: python {' '.join(sys.argv)}")
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    print(f"machine: {machine}, jax {jax.__version__} on {jax.devices()}, "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    compilation_cache.enable(tempfile.mkdtemp(prefix="key-blocks-"))
    scorer = Scorer.from_pretrained(dtype=args.dtype, backend="prefill_extend")
    vocab = scorer.config.vocab_size
    rng = np.random.default_rng(0)
    items = [rng.integers(100, vocab, 20).tolist() for _ in range(128)]
    default = prefill_extend.MAX_KEY_BLOCKS
    variants = {"key blocks": default, "whole buffer": 1}

    def fresh(n: int) -> list[int]:
        return rng.integers(100, vocab, n).tolist()

    def timed(query, its) -> float:
        start = time.perf_counter()
        scorer.score(query, its, [1, 2])
        return time.perf_counter() - start

    for n in map(int, args.query_tokens.split(",")):
        cached = fresh(n)
        times = {(v, s): [] for v in variants for s in ("prefill", "extend")}
        for repeat in range(args.repeats + 1):
            for name, limit in variants.items():
                prefill_extend.MAX_KEY_BLOCKS = limit
                jax.clear_caches()
                if repeat == 0:  # compiles both steps, and caches the query
                    timed(fresh(n), [[5, 6, 7]])
                    timed(cached, items)
                    continue
                times[name, "prefill"].append(timed(fresh(n), [[5, 6, 7]]))
                times[name, "extend"].append(timed(cached, items))
        prefill_extend.MAX_KEY_BLOCKS = default
        for step in ("prefill", "extend"):
            runs = {v: times[v, step] for v in variants}
            medians = {v: statistics.median(t) for v, t in runs.items()}
            spreads = {v: (max(t) - min(t)) / medians[v] for v, t in runs.items()}
            print(f"{n} tokens, {step}: key blocks {medians['key blocks']:.3f} s (spread "
                  f"{spreads['key blocks']:.0%}), whole buffer {medians['whole buffer']:.3f} s "
                  f"(spread {spreads['whole buffer']:.0%}): "
                  f"{medians['whole buffer'] / medians['key blocks']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
