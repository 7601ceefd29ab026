"""The Triton segment kernel's tiles swept inside the whole packed_segment call: the kernel alone
on the packed layouts did not predict the model (issue 26's H200 run: its best tiles were 22%
slower in the model), so each tile shape here scores the seeds' geometries end to end.

    python benchmarks/gpu_model_tiles.py --checkpoint /tmp/qwen3-0.6b --budget-s 150 --write
    python benchmarks/gpu_model_tiles.py --smoke       # CPU: the default model, the TPU kernel's
                                                       # tiles in interpret mode, one tiny geometry

One model is loaded; each tile shape gets its own scorer over it (so its own compiled steps),
a first call that compiles, then the median of --repeats calls with a fresh query each. The
score is the geometric mean of items/s over the geometries; every tile's scores must match the
default tiles' within --tolerance. --write records the best in gpu_tiles.json for this GPU kind
only when it beats the default tiles by more than --margin.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from tpuscore import Scorer  # noqa: E402
from tpuscore.kernels.segment import gpu  # noqa: E402
from tpuscore.models import decoder  # noqa: E402

GEOMETRIES = {"long": (2000, 500, 20), "sglang": (300, 10, 10), "short": (100, 100, 10)}
SMOKE_GEOMETRIES = {"tiny": (40, 6, 5)}
# (block_q, block_kv, num_warps, num_stages[, mask_every_tile]), the default first
TILES = [
    (64, 64, 4, 2),
    (64, 64, 4, 2, True),  # every tile masked: the kernel before its unmasked interior tiles
    (32, 128, 4, 2),
    (64, 128, 4, 2),
    (128, 64, 8, 2),
    (64, 64, 4, 3),
    (128, 128, 8, 2),
    (32, 64, 4, 2),
    (64, 32, 4, 2),
    (64, 128, 8, 3),
]
SMOKE_TILES = [(128, 128), (256, 128)]  # the TPU kernel's BlockSizes (CPU interpret mode)


def items_per_s(scorer: Scorer, geometry, repeats: int, rng, labels):
    query_len, count, item_len = geometry
    vocab = scorer.config.vocab_size

    def request():
        query = rng.integers(0, vocab, query_len).tolist()
        return query, rng.integers(0, vocab, (count, item_len)).tolist()

    fixed = request()
    start = time.perf_counter()
    first = np.asarray(scorer.score(*fixed, labels).logprobs)
    compile_s = time.perf_counter() - start
    seconds = []
    for _ in range(repeats):
        query, items = request()
        start = time.perf_counter()
        scorer.score(query, items, labels)
        seconds.append(time.perf_counter() - start)
    return count / statistics.median(seconds), compile_s, fixed, first


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(), "qwen3-0.6b"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=150, help="no new tile shape after this")
    p.add_argument("--tolerance", type=float, default=2e-2, help="vs the default tiles' scores")
    p.add_argument("--margin", type=float, default=0.03, help="--write only past this gain")
    p.add_argument("--write", action="store_true", help="record the best in gpu_tiles.json")
    p.add_argument("--json", help="write every result here")
    p.add_argument("--geometries", default="long,sglang", help=f"of {sorted(GEOMETRIES)}")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--unroll-layers", default="", help="as gpu_backends.py's")
    args = p.parse_args(argv)
    decoder.UNROLLED_LAYERS_ON = frozenset(filter(None, args.unroll_layers.split(",")))
    deadline = time.monotonic() + args.budget_s
    kind = jax.devices()[0].device_kind
    print(f"command: python {' '.join(sys.argv)}; jax {jax.__version__}; device {kind}\n")
    if args.smoke:
        base = Scorer.from_pretrained(None, dtype="float32")
        geometries, tiles = SMOKE_GEOMETRIES, SMOKE_TILES
    else:
        from random_checkpoint import qwen3_0_6b

        base = Scorer.from_pretrained(qwen3_0_6b(args.checkpoint), dtype=args.dtype)
        geometries = {name: GEOMETRIES[name] for name in args.geometries.split(",")}
        tiles = TILES
    config, params = base.config, base.engine.model.weights
    rng = np.random.default_rng(0)
    labels = rng.choice(config.vocab_size, size=2, replace=False).tolist()
    print(
        "| block_q | block_kv | warps | stages | masked | "
        + " | ".join(geometries)
        + " | geomean |"
    )
    print(
        "| ---: | ---: | ---: | ---: | --- | "
        + " | ".join("---:" for _ in geometries)
        + " | ---: |"
    )
    results, reference = [], {}
    for tile in tiles:
        if time.monotonic() > deadline:
            print(f"\nNOTE: --budget-s {args.budget_s} spent: {len(results)} of {len(tiles)} ran")
            break
        names = ("block_q", "block_kv", "num_warps", "num_stages", "mask_every_tile")
        block_sizes = dict(zip(names, tile, strict=False))
        scorer = Scorer(
            config, params, None, dtype=args.dtype if not args.smoke else "float32",
            backend="packed_segment",
            backend_options={"packed_segment": {"block_sizes": block_sizes}},
        )  # fmt: skip
        rates, worst = {}, 0.0
        for name, geometry in geometries.items():
            rate, _, fixed, got = items_per_s(scorer, geometry, args.repeats, rng, labels)
            rates[name] = rate
            if name not in reference:
                reference[name] = (fixed, got)
            else:  # the same request the default tiles scored
                again = np.asarray(scorer.score(*reference[name][0], labels).logprobs)
                worst = max(worst, float(np.abs(again - reference[name][1]).max()))
        geomean = math.exp(statistics.fmean(math.log(r) for r in rates.values()))
        ok = worst <= args.tolerance
        results.append(
            dict(tiles=block_sizes, items_per_s=rates, geomean=geomean, diff=worst, ok=ok)
        )
        cells = " | ".join(f"{rates[n]:.0f}" for n in geometries)
        flag = "" if ok else f" (differs by {worst:.2e}: rejected)"
        shown = " | ".join(str(block_sizes.get(n, "-")) for n in names)
        print(f"| {shown} | {cells} | {geomean:.0f}{flag} |")
        del scorer
    good = [r for r in results if r["ok"]]
    if not good:
        return
    best, default = max(good, key=lambda r: r["geomean"]), results[0]
    gain = best["geomean"] / default["geomean"] - 1
    print(f"\nbest {best['tiles']}: geomean {best['geomean']:.0f} items/s, {gain:+.1%} vs default")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({kind: results}, indent=1))
    if args.write and not args.smoke and gain > args.margin:
        table = json.loads(gpu.TILES_FILE.read_text())
        key = gpu.tiles_key(config.head_dim, args.dtype)
        table.setdefault(kind, {})[key] = best["tiles"]
        gpu.TILES_FILE.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        print(f"wrote {key} for {kind!r} to {gpu.TILES_FILE}")


if __name__ == "__main__":
    main()
