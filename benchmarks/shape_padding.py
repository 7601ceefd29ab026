"""Padding waste of the step lattice: padded over real token positions on a varied request stream.

The stream is `benchmarks/soak.py`'s (seeded: /v1/score requests of 16-128 query tokens and 1-16
items of 4-32 tokens, every fourth a rerank of short documents, here token ids of the same
lengths), merged into calls of --per-call requests as the Batcher merges concurrent ones.
Each call is planned (`schedule`, no device step runs, nothing compiles) on each backend, and
every step's padded input counted: prefill_extend's prefill rows x chunk length and extend rows x
item length (its queries' K/V positions apart), packed's rows x packed length, serial's rows x
sequence length. Queries are cold (nothing cached). Also prints the shape-set sizes.

    python benchmarks/shape_padding.py                  # the default model's budgets
    python benchmarks/shape_padding.py --tiny
    python benchmarks/shape_padding.py --time-sample 5   # and time 5 compiles per backend
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from soak import make_requests  # noqa: E402


def padded_tokens(backend: str, runner, batches) -> int:
    if backend == "prefill_extend":
        total = 0
        for wave in runner.schedule(batches):
            total += sum(step.rows * step.length for step in wave.prefill)
            total += sum(step.size * step.item_len for step in wave.extend)
        return total
    return sum(step.rows * step.length for step in runner.schedule(batches))  # packed, serial


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny random Qwen3 checkpoint")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--per-call", type=int, default=8, help="requests merged into one call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--time-sample",
        type=int,
        default=0,
        metavar="N",
        help="also compile N random shapes per backend of the 512/32/2 set and time each",
    )
    args = p.parse_args(argv)

    from tpuscore import Scorer
    from tpuscore.backends.contract import make_batch

    if args.tiny:
        sys.path.insert(0, str(HERE.parent / "tests"))
        from hf_reference import make_checkpoint

        scorer = Scorer.from_pretrained(
            make_checkpoint(tempfile.mkdtemp(), "qwen3_qknorm"), dtype="float32"
        )
    else:
        scorer = Scorer.from_pretrained()
    vocab = scorer.config.vocab_size
    rng = np.random.default_rng(args.seed)
    stream = []
    for path, body in make_requests(rng, args.requests, vocab):
        if path == "/v1/rerank":  # as token ids: a ~40-token query, ~12-token documents
            query = rng.integers(0, vocab, 40).tolist()
            items = [rng.integers(0, vocab, 12).tolist() for _ in body["documents"]]
            body = {"query": query, "items": items, "label_token_ids": [1, 2]}
        stream.append(body)
    calls = [stream[i : i + args.per_call] for i in range(0, len(stream), args.per_call)]
    print(f"{len(stream)} requests in {len(calls)} calls of {args.per_call}")
    for backend in ("prefill_extend", "packed_dense", "serial"):
        runner = scorer.get_backend(backend)
        real = padded = 0
        for call in calls:
            batches = [
                make_batch(r["query"], r["items"], r["label_token_ids"], False) for r in call
            ]
            if backend == "serial":
                real += sum(int(b.sequence_lens.sum()) for b in batches)
            else:
                real += sum(b.query_len + int(b.item_lens[: b.num_items].sum()) for b in batches)
            padded += padded_tokens(backend, runner, batches)
        print(f"{backend}: padded/real token positions {padded / real:.3f} ({padded}/{real})")
    if hasattr(scorer, "shapes"):
        for backend in ("prefill_extend", "packed_dense", "serial", "auto"):
            print(f"shape set, default limits, {backend}: {len(scorer.shapes(backends=[backend]))}")
    if args.time_sample:
        time_sample(scorer, args.time_sample, args.seed)


def time_sample(scorer, n: int, seed: int) -> None:
    """Compile n random shapes per backend of the 512/32/2 set, timing each (a sample of what
    `warmup(all=True)` takes), and extrapolate to the backend's whole set."""
    import random
    import statistics
    import time

    import jax

    from tpuscore.backends import contract

    limits = {"query_tokens": 512, "item_tokens": 32, "labels": 2}
    rng = random.Random(seed)
    for backend in ("packed_dense", "prefill_extend", "serial"):
        own = scorer.shapes(limits, backends=[backend])
        seconds = []
        for shape in rng.sample(own, min(n, len(own))):
            start = time.perf_counter()
            contract.warm(scorer.get_backend(backend).steps, shape)
            jax.effects_barrier()
            seconds.append(time.perf_counter() - start)
            print(f"  {backend} {shape.step} {shape.shape}: {seconds[-1]:.1f} s")
        median = statistics.median(seconds)
        total = median * len(own) / 60
        print(f"{backend}: {len(own)} shapes, median {median:.1f} s each, about {total:.0f} min")


if __name__ == "__main__":
    main()
