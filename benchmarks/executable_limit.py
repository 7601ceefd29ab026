"""A service meeting many step shapes on CPU, with and without the executable guard.

XLA:CPU maps about a hundred memory regions per step executable, and Linux caps a process at
vm.max_map_count maps (65,530 by default): a process that keeps compiling new shapes crashes once
it holds some 550 of them (`src/tpuscore/engine/executables.py`). Each run here scores random
geometries (new query, item-count and item-length buckets: new shapes) on prefill_extend in a
child process until `--executables` have been built or the child dies, once with the guard as
shipped and once with it switched off, and prints how each ended, the maps at the end and, for
the guarded one, whether the first request scores the same bits after every drop.

    python benchmarks/executable_limit.py                          # the OS's limit (minutes)
    sudo python benchmarks/executable_limit.py --max-map-count 16384  # a lower limit, faster

`--max-map-count` sets /proc/sys/vm/max_map_count for the runs (root only) and restores it.
A tiny random decoder (2 layers, width 64) keeps each compile under a second.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time

MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"


def child(guarded: bool, executables_wanted: int, seed: int) -> None:
    import jax
    import numpy as np

    from tpuscore import Scorer
    from tpuscore.engine import executables
    from tpuscore.models.config import ModelConfig
    from tpuscore.models.weights import param_shapes

    config = ModelConfig(
        family="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, qkv_bias=False, qk_norm=True,
    )  # fmt: skip
    rng = np.random.default_rng(seed)
    params = jax.tree.map(
        lambda shape: rng.normal(0, 0.3, shape).astype(np.float32),
        param_shapes(config),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    scorer = Scorer(config, params, None, dtype="float32")
    guard = scorer.engine.executables
    if not guarded:
        guard.check = lambda: False  # as before the guard
    first = None
    start = time.perf_counter()
    requests = 0
    while executables.compiles() < executables_wanted:
        query = rng.integers(1, 256, int(rng.integers(1, 4000))).tolist()
        items = [
            rng.integers(1, 256, int(rng.integers(1, 300))).tolist()
            for _ in range(int(rng.integers(1, 300)))
        ]
        result = scorer.score(query, items, [1, 2], backend="prefill_extend")
        if first is None:
            first = (query, items, result.logprobs)
        requests += 1
        if requests % 10 == 0:
            print(
                f"  {requests} requests, {executables.compiles()} executables built, "
                f"{executables.map_count()} maps, dropped {guard.dropped}x, "
                f"{time.perf_counter() - start:.0f} s",
                flush=True,
            )
    query, items, logprobs = first
    scorer.get_backend("prefill_extend").cache.clear()
    again = scorer.score(query, items, [1, 2], backend="prefill_extend").logprobs
    print(
        f"  survived: {requests} requests, {executables.compiles()} executables built, "
        f"{executables.map_count()} maps at the end, dropped {guard.dropped}x; first request "
        f"bit-identical after: {bool((again == logprobs).all())}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--executables", type=int, default=0, help="default: twice what fits")
    parser.add_argument("--max-map-count", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", choices=["guarded", "unguarded"])
    args = parser.parse_args()
    if args.child:
        child(args.child == "guarded", args.executables, args.seed)
        return

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print("command:", " ".join([os.path.basename(sys.executable), *sys.argv]))
    with open(MAX_MAP_COUNT) as f:
        original = int(f.read())
    limit = args.max_map_count or original
    wanted = args.executables or 2 * limit // 100
    if args.max_map_count:
        with open(MAX_MAP_COUNT, "w") as f:
            f.write(str(limit))
    try:
        print(f"vm.max_map_count {limit}; building up to {wanted} executables per run")
        for mode in ("unguarded", "guarded"):
            print(f"{mode}:", flush=True)
            start = time.perf_counter()
            command = [sys.executable, __file__, "--child", mode, "--executables", str(wanted)]
            done = subprocess.run([*command, "--seed", str(args.seed)], check=False)
            took = time.perf_counter() - start
            print(f"  {mode}: exit code {done.returncode} after {took:.0f} s")
    finally:
        if args.max_map_count:
            with open(MAX_MAP_COUNT, "w") as f:
                f.write(str(original))


if __name__ == "__main__":
    main()
