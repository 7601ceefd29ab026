"""Throughput of `tpuscore.jobs.score_table` against `Scorer.score_batch` on the same rows.

    python benchmarks/jobs.py                          # the embedded default model
    python benchmarks/jobs.py --model PATH --rows 40000 --shard-rows 4096
    python benchmarks/jobs.py --tiny                   # a tiny random checkpoint (needs torch)

A table of pair rows (`--per-query` consecutive rows per query, short texts) is written to
Parquet. `score_batch` gets the same rows as one request per query, in one call, from memory;
the job reads the Parquet, groups the rows shard by shard, scores each shard in one
`score_batch` call and writes Parquet shards, the manifest and the errors file. Both run on the
same scorer (`jobs.load_scorer`: no prefix cache, so a repeat is not served from it), warmed by
one untimed run each; the figure is the best of `--repeats` runs. items/s counts pair rows.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

WORDS = ["the", "river", "ran", "past", "old", "mill", "under", "a", "stone", "bridge", "sea"]


def pairs(rows: int, per_query: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    user = np.arange(rows) // per_query
    queries = [
        f"User {u} reads about " + " ".join(rng.choice(WORDS, 12)) for u in range(user[-1] + 1)
    ]
    return pa.table(
        {
            "user_id": user,
            "item_id": np.arange(rows),
            "query": [queries[u] for u in user],
            "item": [f"Item {i}: " + " ".join(rng.choice(WORDS, 6)) for i in range(rows)],
        }
    )


def requests_of(table: pa.Table, labels: list[str]) -> list[dict]:
    queries = table.column("query").to_pylist()
    items = table.column("item").to_pylist()
    grouped: dict[str, list[str]] = {}
    for q, it in zip(queries, items, strict=True):
        grouped.setdefault(q, []).append(it)
    return [{"query": q, "items": its, "labels": labels} for q, its in grouped.items()]


def best(run, repeats: int) -> float:
    run()  # compiles
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--tiny", action="store_true", help="a tiny random checkpoint instead")
    parser.add_argument("--rows", type=int, help="default 4096 (default model), 40000 (tiny)")
    parser.add_argument("--per-query", type=int, default=100, help="pair rows per query")
    parser.add_argument("--shard-rows", type=int, help="default: the job's default, 4096")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    from tpuscore import jobs

    workdir = tempfile.mkdtemp(prefix="tpuscore-jobs-bench-")
    model, labels = args.model, [" yes", " no"]
    if args.tiny:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
        from hf_reference import make_checkpoint

        model, labels = (
            str(make_checkpoint(os.path.join(workdir, "tiny"), "llama_gqa_untied")),
            [
                "a",
                "b",
            ],
        )
    rows = args.rows or (40_000 if args.tiny else 4096)
    shard_rows = args.shard_rows or 4096
    table = pairs(rows, args.per_query)
    pq.write_table(table, os.path.join(workdir, "pairs.parquet"))
    scorer = jobs.load_scorer(model, dtype=args.dtype)
    requests = requests_of(table, labels)

    def batch():
        scorer.score_batch(requests)

    def job():
        jobs.score_table(
            os.path.join(workdir, "pairs.parquet"),
            os.path.join(workdir, "scores.parquet"),
            scorer=scorer,
            labels=labels,
            id_columns=["user_id", "item_id"],
            shard_rows=shard_rows,
            overwrite=True,
        )

    batch_s, job_s = best(batch, args.repeats), best(job, args.repeats)
    name = "tiny random checkpoint" if args.tiny else (model or "default model (SmolLM2-135M)")
    print(
        f"{name}, {args.dtype}, {rows} pair rows, {args.per_query} per query, shard_rows "
        f"{shard_rows}; {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    )
    print("| path | seconds | items/s |")
    print("| --- | --- | --- |")
    print(f"| score_batch (one call, rows in memory) | {batch_s:.2f} | {rows / batch_s:.0f} |")
    print(f"| score_table (Parquet in and out, shards) | {job_s:.2f} | {rows / job_s:.0f} |")
    print(f"job / score_batch: {batch_s / job_s:.0%}")


if __name__ == "__main__":
    main()
