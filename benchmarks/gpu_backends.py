"""tpuscore's backends on a GPU, against transformers on the same GPU: a random Qwen3-0.6B-shaped
checkpoint (`random_checkpoint.py`), the seeds' geometries, every jitted step compiled and run.

    python benchmarks/gpu_backends.py                   # bfloat16, every geometry
    python benchmarks/gpu_backends.py --dtype float32 --geometry sglang

For each geometry it prints items/s (median of --repeats timed runs after a first call, which
compiles and is timed on its own) for each backend and for transformers (padded batches, and
prefilling the query once and reusing past_key_values), and each peer's largest label-logprob
difference from packed_dense.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from random_checkpoint import qwen3_0_6b  # noqa: E402

from tpuscore import Scorer
from tpuscore.backends import registry  # noqa: E402
from tpuscore.models import decoder  # noqa: E402

GEOMETRIES = {  # query tokens, items, item tokens
    "long": (2000, 500, 20),
    "sglang": (300, 10, 10),
    "short": (100, 100, 10),
}
BACKENDS = ["packed_dense", "packed_segment", "prefill_extend", "serial"]


def timed(fn) -> tuple[object, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def median_seconds(fn, repeats: int) -> float:
    return statistics.median(timed(fn)[1] for _ in range(repeats))


def hf_peers(path: pathlib.Path, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).cuda().eval()

    def logprobs(logits, labels):
        return torch.log_softmax(logits[:, -1].float(), dim=-1)[:, labels].cpu().numpy()

    @torch.inference_mode()
    def naive(query, items, labels, batch=32):
        out = []
        for start in range(0, len(items), batch):
            rows = torch.tensor([query + it for it in items[start : start + batch]]).cuda()
            out.append(logprobs(model(input_ids=rows, logits_to_keep=1).logits, labels))
        return np.concatenate(out)

    @torch.inference_mode()
    def cached(query, items, labels, batch=128):
        cache = model(input_ids=torch.tensor([query]).cuda(), use_cache=True).past_key_values
        prefix = [(layer.keys, layer.values) for layer in cache.layers]
        out = []
        for start in range(0, len(items), batch):
            rows = items[start : start + batch]
            b = len(rows)
            kv = DynamicCache(
                [(k.expand(b, -1, -1, -1), v.expand(b, -1, -1, -1)) for k, v in prefix]
            )
            logits = model(
                input_ids=torch.tensor(rows).cuda(), past_key_values=kv, logits_to_keep=1
            ).logits
            out.append(logprobs(logits, labels))
        return np.concatenate(out)

    def synced(fn):
        def run(*args):
            out = fn(*args)
            torch.cuda.synchronize()
            return out

        return run

    return {"HF padded batches": synced(naive), "HF past_key_values": synced(cached)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--geometry", default="all", choices=["all", *GEOMETRIES])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="packed_dense first")
    parser.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(), "qwen3-0.6b"))
    parser.add_argument(
        "--unroll-layers",
        default="",
        help="platforms whose steps unroll the layer loop (decoder.UNROLLED_LAYERS_ON), e.g. cuda",
    )
    args = parser.parse_args()
    decoder.UNROLLED_LAYERS_ON = frozenset(filter(None, args.unroll_layers.split(",")))
    print(f"command: python {' '.join(sys.argv)}")
    print(f"machine: {platform.node()}, jax {jax.__version__}, devices {jax.devices()}")
    path = qwen3_0_6b(args.checkpoint)
    scorer = Scorer.from_pretrained(path, dtype=args.dtype)
    peers = {} if args.no_hf else hf_peers(path, args.dtype)
    rng = np.random.default_rng(0)
    names = list(GEOMETRIES) if args.geometry == "all" else [args.geometry]
    for name in names:
        run_geometry(scorer, peers, name, args, rng)


def run_geometry(scorer: Scorer, peers: dict, name: str, args, rng: np.random.Generator) -> None:
    query_len, count, item_len = GEOMETRIES[name]
    vocab = scorer.config.vocab_size
    print(f"\n## {name}: query {query_len} tokens, {count} items x {item_len}, {args.dtype}")
    print("| peer | first call s | median s | items/s | max abs diff vs packed_dense |")
    print("| --- | ---: | ---: | ---: | ---: |")
    labels = rng.choice(vocab, size=2, replace=False).tolist()

    def request():  # a new query each run: prefill_extend's cache never hits
        query = rng.integers(0, vocab, query_len).tolist()
        return query, rng.integers(0, vocab, (count, item_len)).tolist(), labels

    query, items, _ = request()
    expected = None
    here = jax.default_backend()
    wanted = args.backends.split(",")
    compiled = [b for b in wanted if registry.registration(b).capabilities.compiled(here)]
    if len(compiled) < len(wanted):
        skipped = ", ".join(sorted(set(wanted) - set(compiled)))
        print(f"(skipped, Pallas interpret mode on {here}: {skipped})")
    runs = {b: lambda b=b: scorer.score(*request(), backend=b) for b in compiled}
    runs |= {p: lambda fn=fn: fn(*request()) for p, fn in peers.items()}
    for peer, run in runs.items():  # packed_dense first: the others are compared with it
        if peer in compiled:
            got, first = timed(lambda p=peer: scorer.score(query, items, labels, backend=p))
            got = got.logprobs
        else:
            got, first = timed(lambda p=peer: peers[p](query, items, labels))
        expected = got if expected is None else expected
        diff = float(np.max(np.abs(got - expected)))
        seconds = median_seconds(run, args.repeats)
        print(f"| {peer} | {first:.2f} | {seconds:.4f} | {count / seconds:.0f} | {diff:.2e} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
