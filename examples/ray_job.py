"""Score a Parquet table of (user, item) pairs with Ray Data: one model replica per actor.

    pip install -e '.[ray]'
    python examples/ray_job.py                       # a demo table, a local Ray cluster
    python examples/ray_job.py --input pairs.parquet --output scores/ \\
        --query-column user_text --item-column item_text --id-columns user_id,item_id

Without --input it writes a small demo table of pairs first. It reads the Parquet, scores every
row with `tpuscore.integrations.ray.score_dataset` (the plain yes/no template on the embedded
SmolLM2 unless --model says otherwise), and writes Parquet: the id columns, `logprob_yes`,
`logprob_no`, `score_yes`, `score_no`, and `error_code` / `error` for a row that could not be
scored.

On a real cluster (Ray on TPU VMs, or GKE with KubeRay), what changes is where it runs and what
each actor holds, not the code or the columns:

- Where: submit it to the cluster instead of starting one, e.g. `ray job submit --address
  http://HEAD:8265 --working-dir . -- python examples/ray_job.py --address auto ...`
  (`--address auto` joins the cluster the job runs in; KubeRay's RayJob runs the same command).
- Input and output: URLs every node can read and write (`gs://bucket/pairs/` with gcsfs,
  `s3://` with s3fs), and a --model every node can load (a hub id, or a path on shared storage).
- Resources: one actor per TPU host, holding all its chips: `--tpus-per-actor 4` on a v5e-4 or
  v6e-4 host (Ray names a TPU VM's chips as the "TPU" resource; on GKE the worker group requests
  `google.com/tpu`); `--gpus-per-actor 1` on GPU nodes. `--replicas` is the number of hosts.
- Every node needs `pip install -e '.[ray,tpu]'` (or the cluster image with it).

A model too large for one host's chips is a different shape of job: one model spread over
several hosts with `jax.distributed` (docs/sharding.md), not replicas.
"""

import argparse
import os
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray

from tpuscore.integrations.ray import score_dataset

USERS = [
    "A viewer whose favourite movies are The Matrix, Alien and Dune: all science fiction.",
    "A viewer who loves romantic comedies such as Notting Hill and Pretty Woman.",
]
TITLES = ["Arrival", "The Notebook", "Ex Machina", "Love Actually", "Interstellar", "The Holiday"]


def demo_table(path: str) -> None:
    """Pair rows: every user with every title, one row per pair."""
    users, items = np.meshgrid(np.arange(len(USERS)), np.arange(len(TITLES)), indexing="ij")
    users, items = users.ravel(), items.ravel()
    table = pa.table(
        {
            "user_id": users,
            "item_id": items,
            "query": [USERS[u] for u in users],
            "item": [f"Next movie: {TITLES[i]}. Will this viewer enjoy it?" for i in items],
        }
    )
    pq.write_table(table, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--input", help="a Parquet file or directory of pairs; default: a demo table")
    add("--output", help="a directory for the scores; default: a temporary one")
    add("--model", help="default: the embedded SmolLM2-135M-Instruct")
    add("--query-column", default="query")
    add("--item-column", default="item")
    add("--id-columns", default="user_id,item_id")
    add("--template", default="plain", help="the prompt template (labels come with it)")
    add("--address", help='a Ray cluster to join ("auto" inside one); default: start a local one')
    add("--replicas", type=int, default=1, help="model replicas (actors)")
    add("--batch-size", type=int, default=1024, help="rows per score_batch call")
    add("--cpus-per-actor", type=float, default=1)
    add("--gpus-per-actor", type=float)
    add("--tpus-per-actor", type=float, help='the "TPU" resource per actor (chips)')
    args = parser.parse_args()

    workdir = tempfile.mkdtemp(prefix="tpuscore-ray-")
    if args.input is None:
        args.input = os.path.join(workdir, "pairs.parquet")
        demo_table(args.input)
    output = args.output or os.path.join(workdir, "scores")

    ray.init(address=args.address)
    scored = score_dataset(
        ray.data.read_parquet(args.input),
        model=args.model,
        template=args.template,
        query_column=args.query_column,
        item_column=args.item_column,
        id_columns=[c for c in args.id_columns.split(",") if c],
        concurrency=args.replicas,
        batch_size=args.batch_size,
        num_cpus=args.cpus_per_actor,
        num_gpus=args.gpus_per_actor,
        resources={"TPU": args.tpus_per_actor} if args.tpus_per_actor else None,
    )
    scored.write_parquet(output)

    table = pq.read_table(output).sort_by([("score_yes", "descending")])
    print(f"scored {table.num_rows} rows into {output}")
    print(table.select(["user_id", "item_id", "score_yes", "error_code"]).to_pandas().head(12))


if __name__ == "__main__":
    main()
