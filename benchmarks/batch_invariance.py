"""How much a request's scores depend on what else runs with it: bits that differ, and by how much.

For each backend that mixes queries in a device step, on random token ids (seeded):

- alone vs among others: N requests, each its own query, scored in one `score_batch` and each
  scored alone (the prefix cache cleared before every run, so every query is prefilled);
- same shapes, other neighbours: one request among N - 1 others, then among N - 1 others of the
  same geometry but other tokens, in the same row;
- change one item (one request): item j replaced by another of the same length, or of another
  length; the other items' scores before and after.

    python benchmarks/batch_invariance.py                      # the default model, float32
    python benchmarks/batch_invariance.py --quick              # a smoke run
    python benchmarks/batch_invariance.py --model DIR --backends packed_dense,prefill_extend

Prints a markdown table for docs/batch-invariance.md.
"""

from __future__ import annotations

import argparse
import platform

import jax
import numpy as np

from tpuscore import Scorer

BACKENDS = "prefill_extend,packed_dense,packed_segment"


def differences(a: np.ndarray, b: np.ndarray) -> tuple[int, int, float]:
    """(entries whose bits differ, entries, largest absolute difference)."""
    return int((a != b).sum()), a.size, float(np.abs(a - b).max(initial=0.0))


def request(rng, vocab: int, query_len: int, item_lens, labels) -> dict:
    return {
        "query": rng.integers(0, vocab, query_len).tolist(),
        "items": [rng.integers(0, vocab, int(n)).tolist() for n in item_lens],
        "label_token_ids": labels,
    }


def measure(scorer: Scorer, backend: str, rng, args) -> dict[str, tuple[int, int, float]]:
    vocab = scorer.config.vocab_size
    labels = rng.choice(vocab, size=4, replace=False).tolist()
    runner = scorer.get_backend(backend)

    def clear():
        if backend == "prefill_extend":
            runner.cache.clear()

    def geometry():
        count = int(rng.integers(1, args.max_items + 1))
        return int(rng.integers(1, args.max_query + 1)), rng.integers(0, args.max_item + 1, count)

    # Alone vs among others.
    requests = [request(rng, vocab, *geometry(), labels) for _ in range(args.requests)]
    clear()
    together = scorer.score_batch(requests, backend=backend)
    alone = []
    for r in requests:
        clear()
        alone.append(scorer.score(**r, backend=backend).logprobs)
    rows = {
        "alone vs among others": differences(
            np.concatenate(alone), np.concatenate([t.logprobs for t in together])
        )
    }

    # Same shapes, other neighbours: the target in row 1 of both batches.
    shapes = [geometry() for _ in range(args.requests - 1)]
    target = request(rng, vocab, *geometry(), labels)
    among = []
    for _ in range(2):
        others = [request(rng, vocab, q, lens, labels) for q, lens in shapes]
        clear()
        among.append(scorer.score_batch([others[0], target, *others[1:]], backend=backend)[1])
    rows["same shapes, other neighbours"] = differences(among[0].logprobs, among[1].logprobs)

    # Change one item of one request.
    query_len, _ = geometry()
    item_lens = rng.integers(1, args.max_item + 1, args.max_items)
    base = request(rng, vocab, query_len, item_lens, labels)
    j = len(item_lens) // 2
    clear()
    before = scorer.score(**base, backend=backend).logprobs
    others = np.arange(len(item_lens)) != j
    for name, length in (("same", item_lens[j]), ("another", item_lens[j] + 3)):
        changed = dict(base, items=list(base["items"]))
        changed["items"][j] = rng.integers(0, vocab, int(length)).tolist()
        clear()
        after = scorer.score(**changed, backend=backend).logprobs
        rows[f"one item changed, {name} length: the others"] = differences(
            before[others], after[others]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    parser.add_argument("--backends", default=BACKENDS)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-query", type=int, default=300)
    parser.add_argument("--max-items", type=int, default=10)
    parser.add_argument("--max-item", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="4 short requests")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.max_query, args.max_items, args.max_item = 4, 40, 4, 8
    scorer = Scorer.from_pretrained(args.model, dtype="float32")
    print(
        f"float32, {args.requests} requests, queries 1-{args.max_query} tokens, 1-{args.max_items}"
        f" items of 0-{args.max_item} tokens, seed {args.seed}; jax {jax.__version__} on "
        f"{jax.default_backend()} ({platform.processor() or platform.machine()})\n"
    )
    print("| backend | comparison | entries whose bits differ | largest difference |")
    print("| --- | --- | --- | --- |")
    for backend in args.backends.split(","):
        rng = np.random.default_rng(args.seed)
        for name, (differ, entries, largest) in measure(scorer, backend, rng, args).items():
            print(f"| {backend} | {name} | {differ} of {entries} | {largest:.1e} |")


if __name__ == "__main__":
    main()
