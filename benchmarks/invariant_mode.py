"""Batch-invariant mode: what it costs, and how far the default mode moves a request's scores.

    python benchmarks/invariant_mode.py cost     # items/s with and without, the default model
    python benchmarks/invariant_mode.py bound    # default mode: alone vs in a batch, worst case

cost: per geometry (query tokens, items, item tokens), one request per call with a fresh random
query (so every call prefills), timed in interleaved rounds of both modes (the machine is shared
and noisy: the median of the rounds), and a batch of 8 requests with distinct queries per call.

bound: on fresh random tiny checkpoints (families and seeds the tests never use), 24 requests with
distinct queries scored in one `score_batch` and each alone (cache cleared), in the default mode;
the largest absolute and relative difference per backend and through auto. Prints markdown.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np

from tpuscore import Scorer

# The bench's SGLang geometry, auto's old miss (long items), many short items, small requests.
GEOMETRIES = ((300, 10, 10), (60, 12, 90), (20, 50, 5), (20, 3, 8))
LABELS = [0, 1, 2, 3]


def _request(rng, vocab, query_len, num_items, item_len, vary=False) -> dict:
    lens = rng.integers(0, item_len + 1, num_items) if vary else [item_len] * num_items
    return {
        "query": rng.integers(0, vocab, query_len).tolist(),
        "items": [rng.integers(0, vocab, int(n)).tolist() for n in lens],
        "label_token_ids": LABELS,
    }


def cost(args) -> None:
    scorers = {
        mode: Scorer.from_pretrained(args.model, dtype="float32", batch_invariant=mode)
        for mode in (False, True)
    }
    rng = np.random.default_rng(0)
    vocab = scorers[False].config.vocab_size
    print("| geometry | call | backend | default items/s | invariant items/s | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    geometries = [tuple(map(int, g.split(","))) for g in args.geometry] or GEOMETRIES
    for geometry in geometries:
        for batch in map(int, args.batches.split(",")):
            for backend in args.backends.split(","):
                times = {False: [], True: []}
                for round_ in range(args.rounds + 1):  # round 0 compiles
                    for mode, scorer in scorers.items():
                        reqs = [_request(rng, vocab, *geometry) for _ in range(batch)]
                        start = time.perf_counter()
                        scorer.score_batch(reqs, backend=backend)
                        if round_:
                            times[mode].append(time.perf_counter() - start)
                items = batch * geometry[1]
                rate = {m: items / statistics.median(t) for m, t in times.items()}
                print(
                    f"| {geometry} | {batch} request(s) | {backend} | {rate[False]:.1f} | "
                    f"{rate[True]:.1f} | {rate[True] / rate[False]:.2f} |",
                    flush=True,
                )


def bound(args) -> None:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
    from hf_reference import make_checkpoint

    print("| checkpoint | seed | backend | largest abs. difference | largest rel. difference |")
    print("| --- | --- | --- | --- | --- |")
    worst = {}
    for case in args.cases.split(","):
        for seed in map(int, args.seeds.split(",")):
            with tempfile.TemporaryDirectory() as tmp:
                path = make_checkpoint(tmp, case, seed=seed)
                scorer = Scorer.from_pretrained(path, dtype="float32")
            rng = np.random.default_rng(seed)
            vocab = scorer.config.vocab_size
            requests = []
            for _ in range(args.requests):
                geometry = (int(rng.integers(1, 120)), int(rng.integers(1, 9)), 24)
                requests.append(_request(rng, vocab, *geometry, vary=True))
            for backend in args.backends.split(",") + ["auto"]:
                runner = scorer.get_backend("prefill_extend")
                runner.cache.clear()
                together = scorer.score_batch(requests, backend=backend)
                abs_diff = rel_diff = 0.0
                for request, batched in zip(requests, together, strict=True):
                    runner.cache.clear()
                    alone = scorer.score(**request, backend=backend).logprobs
                    delta = np.abs(batched.logprobs - alone)
                    abs_diff = max(abs_diff, float(delta.max()))
                    rel_diff = max(rel_diff, float((delta / np.abs(alone)).max()))
                a, r = worst.get(backend, (0.0, 0.0))
                worst[backend] = (max(a, abs_diff), max(r, rel_diff))
                print(f"| {case} | {seed} | {backend} | {abs_diff:.2e} | {rel_diff:.2e} |")
    for backend, (a, r) in worst.items():
        print(f"| all | all | {backend} | {a:.2e} | {r:.2e} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(required=True)
    c = sub.add_parser("cost")
    c.add_argument("--model", help="default: the embedded SmolLM2-135M-Instruct")
    c.add_argument("--backends", default="auto,prefill_extend")
    c.add_argument("--rounds", type=int, default=3)
    c.add_argument("--geometry", action="append", default=[], help="Q,N,L (repeatable)")
    c.add_argument("--batches", default="1,8", help="requests per call")
    c.set_defaults(run=cost)
    b = sub.add_parser("bound")
    b.add_argument("--cases", default="qwen3_qknorm,llama_gqa_untied")
    b.add_argument("--seeds", default="101,202,303")
    b.add_argument("--requests", type=int, default=24)
    b.add_argument("--backends", default="prefill_extend,packed_dense,serial")
    b.set_defaults(run=bound)
    args = p.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
