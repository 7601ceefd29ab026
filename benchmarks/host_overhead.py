"""Host time per device step: what the Python around the jitted steps costs, per step, for one
request end to end (issue 26 §4: under 0.5 ms per step on a GPU is the target).

    python benchmarks/host_overhead.py                          # the default model on this CPU
    python benchmarks/host_overhead.py --gpu --trace /tmp/trace # random Qwen3-0.6B, + a profile

Every jitted step of the backend (`prefill`, `prefill_rows`, `score_items`, `score_mixed_items`,
`score_packed`: the instance seams) is wrapped so that each call waits for its result and is
timed. A call's wall time minus the time inside its steps is the host's share: planning, packing,
host-to-device copies issued from Python, result assembly. Waiting removes the overlap of host and
device work an unwrapped call gets, so this is the host time each step would have to hide; the
unwrapped call's wall time is printed beside it. Every call gets a fresh random query (so the
prefix cache never hits), after one call per geometry that compiles. --trace writes one
unwrapped call's `jax.profiler` trace (TensorBoard / Perfetto) for the timeline.

--host-only runs no step: it times the host work of a call that is the same on any device
(validation, planning, and a packed backend's scheduling and packing), so the seeds' long
geometry can be timed on a CPU, whose steps would take seconds.
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

from tpuscore import Scorer
from tpuscore.models import decoder

GEOMETRIES = {  # query tokens, items, item tokens
    "sglang": (300, 10, 10),
    "short": (100, 100, 10),
    "long": (2000, 500, 20),
}
STEPS = ("prefill", "prefill_rows", "score_items", "score_mixed_items", "score_packed")


class StepTimer:
    """Wraps a backend's jitted steps on its instance; `seconds` sums the time inside them."""

    def __init__(self, backend):
        self.seconds, self.calls = 0.0, 0
        self.backend, self.originals = backend, {}
        for name in STEPS:
            if hasattr(backend, name):
                self.originals[name] = getattr(backend, name)

    def __enter__(self):
        for name, step in self.originals.items():
            setattr(self.backend, name, functools.partial(self._timed, step))
        return self

    def __exit__(self, *exc):
        for name in self.originals:
            delattr(self.backend, name)  # the class's staticmethod shows through again

    def _timed(self, step, *args, **kwargs):
        start = time.perf_counter()
        out = jax.block_until_ready(step(*args, **kwargs))
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out


def request(rng, geometry, vocab):
    query_len, count, item_len = geometry
    query = rng.integers(0, vocab, query_len).tolist()
    items = rng.integers(0, vocab, (count, item_len)).tolist()
    return query, items


def measure(scorer, backend, geometry, repeats, rng):
    """(steps per call, median unwrapped ms, median wrapped ms, median host ms per step)."""
    vocab, labels = scorer.config.vocab_size, [1, 2]
    instance = scorer.get_backend(backend)
    scorer.score(*request(rng, geometry, vocab), labels, backend=backend)  # compiles
    plain, wrapped, host_per_step, steps = [], [], [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        scorer.score(*request(rng, geometry, vocab), labels, backend=backend)
        plain.append(time.perf_counter() - start)
        with StepTimer(instance) as timer:
            start = time.perf_counter()
            scorer.score(*request(rng, geometry, vocab), labels, backend=backend)
            total = time.perf_counter() - start
        steps = timer.calls
        wrapped.append(total)
        host_per_step.append((total - timer.seconds) / max(timer.calls, 1))
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    return steps, ms(plain), ms(wrapped), ms(host_per_step)


def host_only(scorer, backend, geometry, repeats, rng):
    """Median ms of (prepare, plan, a packed backend's schedule and packing) for fresh requests."""
    from tpuscore.backends.packed import packing
    from tpuscore.engine import planning

    instance, times = scorer.get_backend(backend), []
    for _ in range(repeats):
        query, items = request(rng, geometry, scorer.config.vocab_size)
        start = time.perf_counter()
        prepared = scorer.prepare(query, items, [1, 2])
        prepared_at = time.perf_counter()
        planning.plan([prepared], backend, scorer.engine.selector, scorer.backends)
        planned_at = time.perf_counter()
        batches = [g.batch for g in planning.group([prepared])]
        packed = hasattr(instance, "slots")  # a packed backend (prefill_extend: not timed)
        for step in instance.schedule(batches) if packed else []:
            chunks = [packing.pack(batches[g], rows, step.length) for g, rows in step.chunks]
            packing.stack(chunks, step.rows, instance.slots(step.length))
        done = time.perf_counter()
        times.append((prepared_at - start, planned_at - prepared_at, done - planned_at))
    return [1e3 * statistics.median(column) for column in zip(*times, strict=True)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", action="store_true", help="a random Qwen3-0.6B-shaped checkpoint")
    p.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(), "qwen3-0.6b"))
    p.add_argument("--model", help="a model path (default: the embedded model, or --gpu's)")
    p.add_argument("--dtype", help="default float32 on CPU, bfloat16 with --gpu")
    p.add_argument("--geometry", action="append", choices=sorted(GEOMETRIES))
    p.add_argument("--backends", default="prefill_extend,packed_dense,packed_segment")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--trace", help="write a jax.profiler trace of one call per backend here")
    p.add_argument("--host-only", action="store_true", help="time the host work, run no step")
    p.add_argument(
        "--unroll-layers",
        default="",
        help="platforms whose steps unroll the layer loop (decoder.UNROLLED_LAYERS_ON), e.g. cuda",
    )
    args = p.parse_args(argv)
    decoder.UNROLLED_LAYERS_ON = frozenset(filter(None, args.unroll_layers.split(",")))

    model, dtype = args.model, args.dtype
    if args.gpu:
        sys.path.insert(0, str(pathlib.Path(__file__).parent))
        from random_checkpoint import qwen3_0_6b

        dtype = dtype or "bfloat16"
        model = model or qwen3_0_6b(args.checkpoint, dtype=dtype)
    scorer = Scorer.from_pretrained(model, dtype=dtype or "float32")
    geometries = args.geometry or (["sglang", "short", "long"] if args.gpu else ["sglang"])
    backends = args.backends.split(",")
    interpreted = jax.default_backend() == "cpu" and "packed_segment" in backends
    if interpreted and not args.host_only:
        backends.remove("packed_segment")  # Pallas interpret mode on CPU: not a host figure
    print(f"# Host time per step: {platform.node()}, {jax.devices()[0].device_kind}")
    flags = os.environ.get("XLA_FLAGS", "")
    print(f"command: python {' '.join(sys.argv)}; jax {jax.__version__}; dtype {scorer.dtype}; "
          f"XLA_FLAGS {flags or '(none)'}\n")  # fmt: skip
    rng = np.random.default_rng(0)
    if args.host_only:
        print("| geometry | backend | prepare ms | plan ms | schedule + pack ms |")
        print("| --- | --- | ---: | ---: | ---: |")
        for name in geometries:
            for backend in backends:
                cells = host_only(scorer, backend, GEOMETRIES[name], args.repeats, rng)
                print(f"| {name} {GEOMETRIES[name]} | {backend} | "
                      + " | ".join(f"{ms:.2f}" for ms in cells) + " |", flush=True)  # fmt: skip
        return
    print("| geometry | backend | steps | call ms | call ms, steps waited | host ms / step |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name in geometries:
        for backend in backends:
            steps, plain, wrapped, host = measure(
                scorer, backend, GEOMETRIES[name], args.repeats, rng
            )
            print(
                f"| {name} {GEOMETRIES[name]} | {backend} | {steps} | {plain:.2f} | "
                f"{wrapped:.2f} | {host:.3f} |",
                flush=True,
            )
            if args.trace:
                with jax.profiler.trace(os.path.join(args.trace, f"{name}-{backend}")):
                    scorer.score(
                        *request(rng, GEOMETRIES[name], scorer.config.vocab_size),
                        [1, 2],
                        backend=backend,
                    )
    print(
        "\nhost ms / step: (wall time of a call whose steps each wait for their result - the "
        "time inside the steps) / steps; medians of --repeats calls with a fresh query each."
    )


if __name__ == "__main__":
    main()
