"""Mixed (or int8) precision's gap from float32 per backend over many run seeds, on exactly the
checkpoints and requests of tests/test_precision.py (tests/test_int8.py with --dtype int8): the
measurements behind their `MIXED_BOUND` and `INT8_BOUND`.

For each seed (as `TPUSCORE_TEST_SEED`), each of the test's cases builds the same random
checkpoint and request the test would, and every backend scores the request in mixed; the gap is
its largest |logprob - float32 logprob| (float32 by the `reference` backend).

    python benchmarks/precision_seeds.py --seeds 20                 # seeds 0..19
    python benchmarks/precision_seeds.py --seeds 0 --also 2052208019  # one known seed only
    python benchmarks/precision_seeds.py --dtype int8 --backend serial --backend prefill_extend

Prints one line per seed and case, then each backend's worst gap, the seed that gave it, and the
bound the test would take (1.5 x the worst, rounded up to 0.01).
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import test_int8  # noqa: E402
import test_precision  # noqa: E402
from helpers import SEED_ENV  # noqa: E402
from tpuscore.backends import registry  # noqa: E402

MARGIN = 1.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20, help="run seeds FIRST..FIRST+N-1")
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--also", type=int, nargs="*", default=[2052208019])
    parser.add_argument("--dtype", choices=["mixed", "int8"], default="mixed")
    parser.add_argument("--backend", action="append", help="backends (default: all)")
    args = parser.parse_args()
    backends = args.backend or registry.available()
    if args.dtype == "int8":
        cases, pair, gap = test_int8.CASES, test_int8.int8_pair, test_int8.int8_gap
    else:
        cases = test_precision.CASES
        pair, gap = test_precision.mixed_pair, test_precision.mixed_gap
    worst = {b: (0.0, None) for b in backends}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in [*range(args.first, args.first + args.seeds), *args.also]:
            os.environ[SEED_ENV] = str(seed)
            for case in cases:
                f32, other = pair(case, pathlib.Path(tmp) / f"{case}-{seed}")
                gaps = {b: gap(f32, other, case, b) for b in backends}
                print(f"seed {seed} {case}: " + ", ".join(f"{b} {g:.4f}" for b, g in gaps.items()))
                for b, g in gaps.items():
                    if g > worst[b][0]:
                        worst[b] = (g, f"{seed} {case}")
                sys.stdout.flush()
    print("\n| backend | worst gap | at seed | bound (x1.5) |\n| --- | ---: | --- | ---: |")
    for b, (g, at) in worst.items():
        print(f"| {b} | {g:.4f} | {at} | {math.ceil(100 * MARGIN * g) / 100:.2f} |")


if __name__ == "__main__":
    main()
