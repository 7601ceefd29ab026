"""Peak resident memory of a `tpuscore job` as its row count grows: does it level off?

    python benchmarks/job_memory.py                              # default model, 1e5 and 1e6 rows
    python benchmarks/job_memory.py --rows 3000 60000 100000 1000000
    python benchmarks/job_memory.py --tiny --rows 2000 8000      # a smoke run (needs torch)

Each row count runs in a fresh process: the job scores a Parquet table of pair rows (200 rows
per user, texts of varied length, so the requests meet many step shapes, as a real table's do)
and reports its peak RSS (VmHWM), the RSS before the job (model loaded), the executables JAX
built (compiled or loaded from the compilation cache) and rows/s. A level line says the job
holds O(shard), not O(rows); what grows with rows and levels off is the executables of shapes
met for the first time. Run it on a quiet machine: other processes change rows/s, not memory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
import numpy as np, pyarrow as pa, pyarrow.parquet as pq
from jax import monitoring
from tpuscore import jobs
from tpuscore.engine import executables

model, directory, rows, shard_rows = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
labels = sys.argv[5:]
WORDS = "the river ran past old mill under a stone bridge by the sea in spring light".split()
rng = np.random.default_rng(0)
user = np.arange(rows) // 200
queries = [" ".join(rng.choice(WORDS, int(rng.integers(8, 60)))) for _ in range(user[-1] + 1)]
items = [" ".join(rng.choice(WORDS, int(rng.integers(2, 40)))) for _ in range(4999)]
pq.write_table(pa.table({
    "user_id": user, "item_id": np.arange(rows),
    "query": pa.array(queries).take(user), "item": pa.array(items).take(np.arange(rows) % 4999),
}), f"{directory}/pairs.parquet", row_group_size=65536)
del queries, items, user

built = [0]
def count(event, seconds, **kw):
    built[0] += event == executables.COMPILE_EVENT
monitoring.register_event_duration_secs_listener(count)

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

scorer = jobs.load_scorer(None if model == "default" else model)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS:")
summary = jobs.score_table(f"{directory}/pairs.parquet", f"{directory}/out", scorer=scorer,
                           labels=labels, id_columns=["user_id", "item_id"], shard_rows=shard_rows)
print(json.dumps({"rows": rows, "before_mib": before / 2**20, "peak_mib": status("VmHWM:") / 2**20,
                  "executables": built[0], "rows_per_s": summary.rows_per_second,
                  "errors": summary.errors}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="default: the embedded SmolLM2-135M")
    parser.add_argument("--tiny", action="store_true", help="a tiny random checkpoint instead")
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--shard-rows", type=int, default=4096)
    args = parser.parse_args()

    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
    model, labels = args.model, [" yes", " no"]
    with tempfile.TemporaryDirectory(prefix="tpuscore-job-memory-") as workdir:
        if args.tiny:
            sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
            from hf_reference import make_checkpoint

            model = str(make_checkpoint(os.path.join(workdir, "tiny"), "llama_gqa_untied"))
            labels = ["a", "b"]
        print(
            f"model {'tiny random checkpoint' if args.tiny else model}, shard_rows "
            f"{args.shard_rows}; {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores"
        )
        print("| rows | RSS before job (MiB) | peak RSS (MiB) | executables | rows/s |")
        print("| --- | --- | --- | --- | --- |")
        for rows in args.rows:
            directory = tempfile.mkdtemp(dir=workdir)
            done = subprocess.run(
                [sys.executable, "-c", CHILD, model, directory, str(rows), str(args.shard_rows),
                 *labels],
                env=env, capture_output=True, text=True, check=False,
            )  # fmt: skip
            if done.returncode != 0:
                sys.exit(f"{rows} rows failed:\n{done.stderr[-3000:]}")
            m = json.loads(done.stdout.strip().splitlines()[-1])
            print(
                f"| {rows} | {m['before_mib']:.0f} | {m['peak_mib']:.0f} | {m['executables']} "
                f"| {m['rows_per_s']:.0f} |"
            )


if __name__ == "__main__":
    main()
