"""First-request latency on the embedded default model, three ways, each in a new process:

- cold: load, then the first request (compiles its steps);
- warmup: load, `scorer.warmup()` (the default geometries), then the first request;
- cache: a process with a populated persistent compilation cache (filled by a previous process).

    python benchmarks/first_request.py           # warmup() of the default geometries
    python benchmarks/first_request.py --quick   # warmup() of the request's geometry only

The request is a 64-token query with 10 items of 16 tokens (one of warmup's default geometries),
random token ids; each figure is also compared with the same request once warm.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

CHILD = """
import json, sys, time
import numpy as np
from tpuscore import Scorer
mode = sys.argv[1]
scorer = Scorer.from_pretrained()
warmup_s = None
if mode != "cold":
    start = time.perf_counter()
    scorer.warmup([(64, 10, 16)] if mode == "warmup-request" else None)
    warmup_s = time.perf_counter() - start
rng = np.random.default_rng(0)
def request():
    query = rng.integers(0, scorer.config.vocab_size, 64).tolist()
    items = rng.integers(0, scorer.config.vocab_size, (10, 16)).tolist()
    start = time.perf_counter()
    scorer.score(query, items, [1, 2])
    return time.perf_counter() - start
first, again = request(), request()
print(json.dumps({"first": first, "again": again, "warmup": warmup_s}))
"""


def child(mode: str, env: dict) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="warm only the request's geometry, not the defaults"
    )
    args = parser.parse_args()
    import jax

    print(f"command: python {' '.join(sys.argv)}")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print(f"jax {jax.__version__}, devices {jax.devices()}")
    warmed = "warmup-request" if args.quick else "warmup"
    env = {k: v for k, v in os.environ.items() if k != "TPUSCORE_COMPILATION_CACHE"}
    with tempfile.TemporaryDirectory() as cache:
        cached_env = {**env, "TPUSCORE_COMPILATION_CACHE": cache}
        start = time.perf_counter()
        child("cold", cached_env)  # fills the cache
        fill_s = time.perf_counter() - start
        runs = {
            "cold process": child("cold", env),
            f"after warmup({'the request geometry' if args.quick else ''})": child(warmed, env),
            "new process, populated compilation cache": child("cold", cached_env),
        }
    print(f"(filling the cache took a {fill_s:.1f} s process)")
    print("| start | first request s | same request warm s | warmup() s |")
    print("| --- | ---: | ---: | ---: |")
    for name, r in runs.items():
        warm = f"{r['warmup']:.1f}" if r["warmup"] is not None else ""
        print(f"| {name} | {r['first']:.3f} | {r['again']:.3f} | {warm} |")


if __name__ == "__main__":
    main()
