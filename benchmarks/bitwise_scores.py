"""Record every backend's scores on fixed random requests, to compare two versions bit for bit.

A refactor that must not change behaviour records the scores before and after and compares them
with `np.array_equal` (no tolerance):

    PYTHONPATH=<old checkout>/src python benchmarks/bitwise_scores.py record /tmp/old.npz
    python benchmarks/bitwise_scores.py record /tmp/new.npz
    python benchmarks/bitwise_scores.py compare /tmp/old.npz /tmp/new.npz

The requests cover every backend (prefill_extend, packed_dense, packed_segment in interpret mode
on CPU, serial, reference, auto), budgets tight enough to force waves, mixed-query steps and
split chunks, prefix-cache hits (exact and partial), batch-invariant mode and loglikelihood.
The checkpoint is a tiny random one (tests/hf_reference.py), the same for a given seed.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]

# name -> (backend, backend_options): tight budgets force waves, mixed steps and splits.
SETUPS = {
    "prefill_extend": ("prefill_extend", {}),
    "prefill_extend_tight": (
        "prefill_extend",
        {"activation_bytes": 1 << 17, "prefix_cache_bytes": 1 << 15, "prefill_chunk": 16},
    ),
    "prefill_extend_rows": ("prefill_extend", {"batch_items": 3, "split_padding_tokens": 8}),
    "packed_dense": ("packed_dense", {}),
    "packed_dense_tight": ("packed_dense", {"activation_bytes": 1 << 18}),
    "packed_segment": ("packed_segment", {}),
    "serial": ("serial", {}),
    "serial_tight": ("serial", {"max_batch_tokens": 64}),
    "reference": ("reference", {}),
    "auto": ("auto", {}),
}


def requests(rng: np.random.Generator, vocab: int) -> list[dict]:
    """Calls of several requests: shared and distinct queries, varied lengths, a repeated query
    (an exact cache hit) and a query extending an earlier one (a partial hit)."""

    def tokens(n: int) -> list[int]:
        return rng.integers(3, vocab, size=n).tolist()

    base = tokens(40)
    calls = []
    for _ in range(2):
        calls.append(
            [
                {"query": q, "items": [tokens(int(rng.integers(1, 30))) for _ in range(n)]}
                for q, n in ((base, 7), (tokens(int(rng.integers(5, 70))), 11), (base, 3))
            ]
        )
    calls.append([{"query": base + tokens(9), "items": [tokens(5) for _ in range(5)]}])
    calls.append([{"query": base, "items": [tokens(12) for _ in range(20)]}])
    labels = tokens(3)
    for call in calls:
        for request in call:
            request["label_token_ids"] = labels
    return calls


def record(path: str, case: str, seed: int) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from hf_reference import MODEL_VOCAB_SIZE, make_checkpoint
    from tpuscore import Scorer

    checkpoint = make_checkpoint(tempfile.mkdtemp(), case, seed=0)
    calls = requests(np.random.default_rng(seed), MODEL_VOCAB_SIZE)
    out: dict[str, np.ndarray] = {}
    for invariant in (False, True):
        for name, (backend, options) in SETUPS.items():
            if invariant and backend in ("packed_dense", "packed_segment", "reference"):
                continue
            scorer = Scorer.from_pretrained(
                checkpoint,
                dtype="float32",
                backend=backend,
                backend_options={backend: options} if options else None,
                batch_invariant=invariant,
            )
            for c, call in enumerate(calls):
                for r, result in enumerate(scorer.score_batch(call)):
                    key = f"{name}/invariant={invariant}/call{c}/request{r}"
                    out[key] = np.asarray(result.logprobs)
                    out[key + "/tokens"] = np.asarray(result.num_tokens)
                    out[key + "/backend"] = np.asarray(result.backend)
            if backend == "prefill_extend":
                for c, call in enumerate(calls[:2]):
                    request = call[1]
                    results = scorer.loglikelihood(request["query"], request["items"])
                    key = f"{name}/invariant={invariant}/loglikelihood{c}"
                    out[key] = np.stack([np.float64(x.logprob) for x in results])
                    out[key + "/tokens"] = np.concatenate([x.token_logprobs for x in results])
                    out[key + "/greedy"] = np.array([x.is_greedy for x in results])
            print(f"{name} invariant={invariant}: done", flush=True)
    np.savez(path, **out)
    print(f"{len(out)} arrays -> {path}")


def compare(old: str, new: str) -> int:
    a, b = np.load(old), np.load(new)
    missing = sorted(set(a.files) ^ set(b.files))
    differ = [k for k in sorted(set(a.files) & set(b.files)) if not np.array_equal(a[k], b[k])]
    for k in missing:
        print(f"only in one: {k}")
    for k in differ:
        print(f"differs: {k}")
    print(f"{len(a.files)} arrays compared: {len(differ)} differ, {len(missing)} missing")
    return 1 if differ or missing else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("path")
    rec.add_argument("--case", default="llama_gqa_untied")
    rec.add_argument("--seed", type=int, default=1234)
    cmp = sub.add_parser("compare")
    cmp.add_argument("old")
    cmp.add_argument("new")
    args = parser.parse_args()
    if args.command == "record":
        record(args.path, args.case, args.seed)
        return 0
    return compare(args.old, args.new)


if __name__ == "__main__":
    sys.exit(main())
