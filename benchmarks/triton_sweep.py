"""Sweep the Triton segment kernel's tiles on a GPU: block_q, block_kv, num_warps, num_stages per
head dim and dtype, each configuration checked against the jnp reference, then timed.

    python benchmarks/triton_sweep.py                       # head dims 64 and 128, both dtypes
    python benchmarks/triton_sweep.py --write               # and keep the best as this GPU's
    python benchmarks/triton_sweep.py --interpret --smoke   # CPU: checks the script, times nothing

Two passes per (head dim, dtype), over the packed layouts of `gpu_segment_kernel.py`: every
(block_q, block_kv) at 4 warps and 2 stages, then the three fastest tile shapes at every
(num_warps, num_stages). A configuration's score is the geometric mean of its median
milliseconds over the layouts; one that fails the reference check is dropped. --write records
the best per (head dim, dtype) for this GPU's device kind in
src/tpuscore/kernels/segment/gpu_tiles.json, which packed_segment reads for its default tiles.
Check the kept tiles in the model before committing them (`gpu_part4.sh tiles tuned`): on an
H200 the kernel-only best, 32 x 128, scored the seeds' workload 22% slower than the default 64 x 64
(docs/benchmarks.md), so a sweep of the kernel alone does not settle the model's tiles.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from gpu_segment_kernel import LAYOUTS, TOLERANCE, median_ms, packed

from tpuscore.kernels.segment import gpu, segment_attention
from tpuscore.kernels.segment.gpu import GpuBlockSizes
from tpuscore.kernels.segment.mask import segment_attention_reference

HEADS = {64: (9, 3), 128: (16, 8)}  # query, kv heads: SmolLM2-135M's and Qwen3-0.6B's
# (block sizes, warps, stages) swept; --smoke: a tiny layout and two tile sizes.
FULL = ((16, 32, 64, 128), (2, 4, 8), (1, 2, 3))
SMOKE = ((16, 32), (4,), (2,))
SMOKE_LAYOUTS = {"smoke": (20, 4, 5)}


def inputs(layout, head_dim, dtype, tile, rng):
    tokens, prefix_len, seg_start = packed(*layout, tile)
    q_heads, kv_heads = HEADS[head_dim]
    q, k, v = (
        jnp.asarray(rng.normal(size=(1, h, tokens, head_dim)), dtype)
        for h in (q_heads, kv_heads, kv_heads)
    )
    return q, k, v, prefix_len, seg_start


@functools.cache
def case(layout, head_dim, dtype, tile):
    """The inputs of one packed layout and the reference's output on them."""
    x = inputs(layout, head_dim, dtype, tile, np.random.default_rng(0))
    return x, segment_attention_reference(*x)


def score(blocks, layouts, head_dim, dtype, args):
    """Geometric mean ms over the layouts, or None if the kernel fails or is wrong."""
    times = []
    for layout in layouts.values():
        x, want = case(layout, head_dim, dtype, blocks.tile)
        run = lambda x=x: segment_attention(  # noqa: E731
            *x, block_sizes=blocks, interpret=args.interpret or None
        )
        try:
            got = run()
        except Exception as e:  # a tile Triton rejects (shared memory, registers)
            print(f"  {blocks}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
            return None
        diff = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        if diff > TOLERANCE[dtype]:
            print(f"  {blocks}: off the reference by {diff:.1e}", file=sys.stderr)
            return None
        times.append(median_ms(run, args.repeats))
    return math.exp(sum(map(math.log, times)) / len(times))


def sweep(head_dim, dtype, layouts, grid, args, deadline):
    """[(ms, GpuBlockSizes)] fastest first, over grid = (tiles, warps, stages)."""
    tiles, warps_swept, stages_swept = grid
    first = [GpuBlockSizes(q, kv, 4, 2) for q, kv in itertools.product(tiles, tiles)]
    results = []
    for blocks in first:
        if time.monotonic() > deadline:
            break
        ms = score(blocks, layouts, head_dim, dtype, args)
        if ms is not None:
            results.append((ms, blocks))
    results.sort(key=lambda r: r[0])
    shapes = [(b.block_q, b.block_kv) for _, b in results[:3]]
    for (bq, bkv), warps, stages in itertools.product(shapes, warps_swept, stages_swept):
        if (warps, stages) == (4, 2) or time.monotonic() > deadline:
            continue
        blocks = GpuBlockSizes(bq, bkv, warps, stages)
        ms = score(blocks, layouts, head_dim, dtype, args)
        if ms is not None:
            results.append((ms, blocks))
    return sorted(results, key=lambda r: r[0])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="of gpu_segment_kernel.LAYOUTS")
    p.add_argument("--tiles", default="16,32,64,128", help="block_q and block_kv swept")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument(
        "--budget-s",
        type=float,
        default=480,
        help="stop sweeping after this, split evenly over the (head dim, dtype) pairs",
    )
    p.add_argument("--write", action="store_true", help="record the best in gpu_tiles.json")
    p.add_argument("--json", help="write every result here")
    p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
    p.add_argument("--smoke", action="store_true", help="one tiny layout, two tile sizes")
    args = p.parse_args(argv)
    tiles = tuple(map(int, args.tiles.split(",")))
    chosen = {name: LAYOUTS[name] for name in args.layouts.split(",")}
    grid, layouts = (SMOKE, SMOKE_LAYOUTS) if args.smoke else ((tiles, *FULL[1:]), chosen)
    kind = jax.devices()[0].device_kind
    print(f"command: python {' '.join(sys.argv)}; jax {jax.__version__}; device {kind}\n")
    pairs = list(itertools.product(map(int, args.head_dims.split(",")), args.dtypes.split(",")))
    best, everything, partial = {}, {}, False
    for head_dim, dtype in pairs:
        deadline = time.monotonic() + args.budget_s / len(pairs)
        results = sweep(head_dim, dtype, layouts, grid, args, deadline)
        partial |= time.monotonic() > deadline
        key = gpu.tiles_key(head_dim, dtype)
        everything[key] = [dict(ms=ms, **vars(b)) for ms, b in results]
        print(f"## head dim {head_dim}, {dtype}: {len(results)} configurations ran\n")
        print("| block_q | block_kv | num_warps | num_stages | geomean ms |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for ms, b in results[:5]:
            print(f"| {b.block_q} | {b.block_kv} | {b.num_warps} | {b.num_stages} | {ms:.3f} |")
        default = next((ms for ms, b in results if b == GpuBlockSizes()), None)
        if results and default:
            print(f"\nbest {results[0][0]:.3f} ms vs the default tiles' {default:.3f} ms\n")
        if results:
            best[key] = vars(results[0][1])
    if partial:
        print(f"NOTE: stopped at --budget-s {args.budget_s}: the sweep is partial")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({kind: everything}, indent=1))
    if args.write and not args.interpret:
        table = json.loads(gpu.TILES_FILE.read_text())
        table.setdefault(kind, {}).update(best)
        gpu.TILES_FILE.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(best)} entries for {kind!r} to {gpu.TILES_FILE}")


if __name__ == "__main__":
    main()
