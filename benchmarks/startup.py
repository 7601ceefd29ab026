"""Start-up time of the default model: `Scorer.from_pretrained()` in a fresh process with the GGUF
weight cache off, on its first use (which writes the entry) and on its second (which reads it).

    python benchmarks/startup.py [--repeats 3]

Prints the machine, the command and the median seconds of each case.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

CHILD = """
import json, time
t0 = time.perf_counter()
from tpuscore import Scorer
t1 = time.perf_counter()
scorer = Scorer.from_pretrained()
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1}))
"""


def run(cache: str) -> dict:
    env = dict(os.environ, TPUSCORE_WEIGHTS_CACHE=cache)
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}")
    print(f"command: python benchmarks/startup.py --repeats {args.repeats}")
    cases: dict[str, list[float]] = {"cache off": [], "first (writes)": [], "cached": []}
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache:
            cases["cache off"].append(run("off")["load_s"])
            cases["first (writes)"].append(run(cache)["load_s"])
            cases["cached"].append(run(cache)["load_s"])
    for name, seconds in cases.items():
        print(
            f"{name:>15}: from_pretrained() median {statistics.median(seconds):.2f} s "
            f"({', '.join(f'{s:.2f}' for s in seconds)})"
        )


if __name__ == "__main__":
    main()
