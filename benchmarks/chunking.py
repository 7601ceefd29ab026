"""Chunked documents: every chunk of every document as an item of one request (the query once)
against each chunk scored in its own call (what a client that chunks for itself does).

Defaults: 20 documents of 4,000 random tokens each, 512-token chunks without overlap (8 per
document: 160 items), a 32-token query, 2 labels, the embedded default model. Each way is run
once to compile, then timed over --repeats runs (the median); the two ways' chunk scores are
compared (they must agree to float rounding). Prints the machine, the command and a markdown
table of wall time and chunks (items) per second.

    python benchmarks/chunking.py
    python benchmarks/chunking.py --docs 2 --doc-tokens 300 --window 64 --repeats 1   # smoke
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import numpy as np

from tpuscore import Scorer


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--dtype", help="default: float32 on CPU, bfloat16 on accelerators")
    p.add_argument("--docs", type=int, default=20)
    p.add_argument("--doc-tokens", type=int, default=4000)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--stride", type=int, help="default: the window (no overlap)")
    p.add_argument("--query-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    scorer = Scorer.from_pretrained(args.model, dtype=args.dtype)
    rng = np.random.default_rng(args.seed)
    vocab = scorer.config.vocab_size
    query = rng.integers(0, vocab, args.query_tokens).tolist()
    docs = [rng.integers(0, vocab, args.doc_tokens).tolist() for _ in range(args.docs)]
    labels = rng.choice(vocab, 2, replace=False).tolist()
    chunking = {"window": args.window, "stride": args.stride, "aggregate": "max"}

    def one_request():
        return scorer.score(query, docs, label_token_ids=labels, chunking=chunking)

    first = one_request()  # compiles; also gives the chunks the per-call way scores
    chunk_ids = [
        docs[d][start:end] for d, (start, end) in zip(first.document, first.spans, strict=True)
    ]

    def per_chunk():
        return np.concatenate(
            [scorer.score(query, [c], label_token_ids=labels).logprobs for c in chunk_ids]
        )

    per_chunk()  # compiles its shapes

    def timed(run) -> tuple[float, object]:
        times, out = [], None
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = run()
            times.append(time.perf_counter() - start)
        return statistics.median(times), out

    chunked_s, chunked = timed(one_request)
    alone_s, alone = timed(per_chunk)
    diff = float(np.abs(chunked.chunks.logprobs - alone).max())
    n = len(chunk_ids)
    print(f"machine: {cpu_name()}, {platform.machine()}; backend of the chunked call: "
          f"{chunked.chunks.backend}")  # fmt: skip
    print(f"command: python {' '.join(sys.argv)}")
    print(f"{args.docs} documents x {args.doc_tokens} tokens, window {args.window}, stride "
          f"{args.stride or args.window}: {n} chunks; query {args.query_tokens} tokens; "
          f"median of {args.repeats}; max |logprob difference| {diff:.2e}\n")  # fmt: skip
    print("| way | wall s | chunks/s |\n| --- | --- | --- |")
    print(f"| one request, every chunk an item | {chunked_s:.2f} | {n / chunked_s:.1f} |")
    print(f"| each chunk its own call | {alone_s:.2f} | {n / alone_s:.1f} |")
    print(f"\nspeed-up: {alone_s / chunked_s:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
