"""The default mode's alone-against-batched gap on fresh random checkpoints, for the docs' bound.

A request scored alone and the same request scored among others (one `score_batch`, or the
Batcher under concurrent threads) run different device steps in the default mode, so their
logprobs differ by float rounding. This probe measures by how much, on tiny random checkpoints
drawn fresh for each seed (the tests' families, `tests/hf_reference.py`), none of them the tests'
own:

- per backend that mixes requests in a step (and serial): R random requests, each scored alone
  (the prefix cache cleared before each) and all in one `score_batch`;
- the Batcher: the same requests from T threads at once, against each alone (under `auto`).

For each, the largest absolute difference, the largest relative one (|batched - alone| over
|alone|), and the largest share of the documented bound an entry uses (`ALONE_VS_BATCHED` in
tests/helpers.py: |batched - alone| <= atol + rtol * |alone|, numpy's allclose; over 100%: outside).

    python benchmarks/alone_vs_batched.py                    # 6 seeds x 4 families
    python benchmarks/alone_vs_batched.py --seeds 1 --families qwen3_qknorm --requests 4  # smoke

Prints one line per (seed, family, path) and a markdown summary for docs/batch-invariance.md.
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import hf_reference  # noqa: E402
from helpers import ALONE_VS_BATCHED  # noqa: E402
from tpuscore import Batcher, Scorer  # noqa: E402

FAMILIES = "llama_gqa_untied,llama3_rope_tied,qwen2_bias,qwen3_qknorm"
BACKENDS = "prefill_extend,packed_dense,packed_segment,serial"


def random_requests(rng, vocab: int, n: int, args) -> list[dict]:
    labels = rng.choice(vocab, size=4, replace=False).tolist()
    out = []
    for _ in range(n):
        items = rng.integers(0, args.max_item + 1, int(rng.integers(1, args.max_items + 1)))
        out.append(
            {
                "query": rng.integers(0, vocab, int(rng.integers(1, args.max_query + 1))).tolist(),
                "items": [rng.integers(0, vocab, int(k)).tolist() for k in items],
                "label_token_ids": labels,
            }
        )
    return out


def gap(batched: list[np.ndarray], alone: list[np.ndarray]) -> tuple[float, float, float]:
    """(largest |batched - alone|, largest |batched - alone| / |alone|, largest share of the
    bound an entry uses: |batched - alone| / (atol + rtol |alone|), within it when <= 1)."""
    b, a = np.concatenate([x.ravel() for x in batched]), np.concatenate([x.ravel() for x in alone])
    diff = np.abs(b - a)
    share = diff / (ALONE_VS_BATCHED["atol"] + ALONE_VS_BATCHED["rtol"] * np.abs(a))
    relative = diff / np.maximum(np.abs(a), 1e-30)
    return float(diff.max(initial=0)), float(relative.max(initial=0)), float(share.max(initial=0))


def alone(scorer: Scorer, requests: list[dict], backend: str | None) -> list[np.ndarray]:
    out = []
    for request in requests:
        if backend in (None, "prefill_extend"):
            scorer.get_backend("prefill_extend").cache.clear()
        out.append(scorer.score(**request, backend=backend).logprobs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=6, help="fresh checkpoints per family")
    parser.add_argument("--first-seed", type=int, default=1000)
    parser.add_argument("--families", default=FAMILIES)
    parser.add_argument("--backends", default=BACKENDS)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--threads", type=int, default=64)
    parser.add_argument("--max-query", type=int, default=60)
    parser.add_argument("--max-items", type=int, default=6)
    parser.add_argument("--max-item", type=int, default=16)
    parser.add_argument("--layers", type=int, default=None, help="default: the families' 2")
    parser.add_argument(
        "--weight-std",
        type=float,
        default=None,
        help="default: the tests' 0.1 (larger: larger logits)",
    )
    args = parser.parse_args()
    # Checkpoints the tests never saw: other seeds, and optionally deeper or with larger weights.
    if args.weight_std is not None:
        hf_reference._WEIGHT_STD = args.weight_std
    if args.layers is not None:
        for family in args.families.split(","):
            hf_reference.FAMILY_CASES[family]["config"]["num_hidden_layers"] = args.layers

    print(f"# {platform.processor() or platform.machine()}, jax {jax.__version__}, {args}")
    print(f"# bound: {ALONE_VS_BATCHED}")
    worst: dict[str, list[float]] = {}
    misses = 0
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for family in args.families.split(","):
                directory = pathlib.Path(tmp) / f"{family}-{seed}"
                path = hf_reference.make_checkpoint(directory, family, seed=seed)
                scorer = Scorer.from_pretrained(path, dtype="float32")
                rng = np.random.default_rng(seed)
                requests = random_requests(rng, scorer.config.vocab_size, args.requests, args)
                results = {}
                for backend in args.backends.split(","):
                    if backend == "prefill_extend":
                        scorer.get_backend(backend).cache.clear()
                    together = scorer.score_batch(requests, backend=backend)
                    results[backend] = gap(
                        [r.logprobs for r in together], alone(scorer, requests, backend)
                    )
                many = requests * max(1, args.threads // len(requests))
                with Batcher(scorer) as batcher, ThreadPoolExecutor(args.threads) as pool:
                    futures = [pool.submit(batcher.score, **r) for r in many]
                    batched = [f.result(timeout=600).logprobs for f in futures]
                singles = alone(scorer, requests, None)
                results[f"Batcher, {args.threads} threads"] = gap(
                    batched, singles * (len(many) // len(requests))
                )
                for name, (absolute, relative, share) in results.items():
                    print(
                        f"seed {seed} {family:18s} {name:22s} abs {absolute:.2e} "
                        f"rel {relative:.2e} bound used {share:.0%}",
                        flush=True,
                    )
                    was = worst.setdefault(name, [0.0, 0.0, 0.0])
                    now = (absolute, relative, share)
                    worst[name] = [max(w, x) for w, x in zip(was, now, strict=True)]
                    misses += share > 1
    print("\n| path | largest absolute | largest relative | bound used |")
    print("| --- | ---: | ---: | ---: |")
    for name, (absolute, relative, share) in worst.items():
        print(f"| {name} | {absolute:.1e} | {relative:.1e} | {share:.0%} |")
    print(f"\n{misses} of {len(worst) * args.seeds * len(args.families.split(','))} outside")


if __name__ == "__main__":
    main()
