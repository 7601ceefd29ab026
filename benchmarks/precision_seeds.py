"""Mixed precision's gap from float32 per backend over many run seeds, on exactly the checkpoints
and requests of tests/test_precision.py: the measurements behind its `MIXED_BOUND`.

For each seed (as `TPUSCORE_TEST_SEED`), each of the test's cases builds the same random
checkpoint and request the test would, and every backend scores the request in mixed; the gap is
its largest |logprob - float32 logprob| (float32 by the `reference` backend).

    python benchmarks/precision_seeds.py --seeds 20                 # seeds 0..19
    python benchmarks/precision_seeds.py --seeds 0 --also 2052208019  # one known seed only

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
from helpers import SEED_ENV  # noqa: E402
from test_precision import CASES, mixed_gap, mixed_pair  # noqa: E402
from tpuscore.backends import registry  # noqa: E402

MARGIN = 1.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20, help="run seeds FIRST..FIRST+N-1")
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--also", type=int, nargs="*", default=[2052208019])
    args = parser.parse_args()
    backends = registry.available()
    worst = {b: (0.0, None) for b in backends}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in [*range(args.first, args.first + args.seeds), *args.also]:
            os.environ[SEED_ENV] = str(seed)
            for case in CASES:
                f32, mixed = mixed_pair(case, pathlib.Path(tmp) / f"{case}-{seed}")
                gaps = {b: mixed_gap(f32, mixed, case, b) for b in backends}
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
