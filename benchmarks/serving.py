"""A serving benchmark in the style of SGLang's bench_score: Poisson arrivals at a fixed rate for a
fixed time, each request its own 300-token query and 10 items of 10 tokens (SGLang PR #10979's
geometry), 2 labels shared by all. One run times three peers on the same arrivals:

- `tpuscore Batcher`: every request submitted to one `tpuscore.Batcher` as it arrives;
- `tpuscore threads`: every request a plain `scorer.score` call on a pool of --workers threads;
- `HF transformers`: the same pool, each request prefilling its query once and scoring its items
  as one batch on the query's past_key_values (what a careful transformers user writes).

The rate is scaled to the machine: --load times the requests/s of `scorer.score` run one after
another (measured first, warm). A request's latency runs from its scheduled arrival to its
result, so time spent queued counts. items/s is the items finished over the time from the first
arrival to the last result. Every peer is warmed up before its run (compilation excluded).

    python benchmarks/serving.py                       # CPU: the embedded default model
    python benchmarks/serving.py --duration 10 --load 0.5
    python benchmarks/serving.py --gpu                 # a random Qwen3-0.6B in bfloat16, on CUDA
    nox -s bench -- --serving
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import os
import pathlib
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

# With --gpu, JAX and torch share the GPU: JAX must not take 75% of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from tpuscore import Batcher, Overloaded, Scorer  # noqa: E402
from tpuscore.models import decoder  # noqa: E402
from tpuscore.serving.batcher import DEFAULT_MAX_BATCH_TOKENS  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Request:
    query: list[int]
    items: list[list[int]]
    labels: list[int]


@dataclasses.dataclass(frozen=True)
class Outcome:
    name: str
    latencies: np.ndarray  # seconds, of the finished requests
    submitted: int
    items_per_s: float
    note: str = ""


def requests_for(rng: np.random.Generator, n: int, args: argparse.Namespace, vocab: int):
    labels = rng.choice(vocab, size=args.labels, replace=False).tolist()
    return [
        Request(
            rng.integers(0, vocab, args.query_len).tolist(),
            rng.integers(0, vocab, (args.items, args.item_len)).tolist(),
            labels,
        )
        for _ in range(n)
    ]


def poisson_arrivals(rng: np.random.Generator, rate: float, duration: float) -> np.ndarray:
    """Arrival offsets in seconds: exponential gaps at `rate` per second, up to `duration`."""
    gaps = rng.exponential(1.0 / rate, size=int(rate * duration * 3) + 16)
    offsets = np.cumsum(gaps)
    return offsets[offsets < duration]


def drive(
    name: str,
    submit: Callable[[Request], Future],
    requests: list[Request],
    arrivals: np.ndarray,
    timeout_s: float,
) -> Outcome:
    """Submit requests[i] at arrivals[i] (from this thread, sleeping in between), then wait up to
    timeout_s for the results."""
    done_at: dict[int, float] = {}
    lock = threading.Lock()
    futures, refused = [], 0
    start = time.perf_counter()
    for i, offset in enumerate(arrivals):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        try:
            future = submit(requests[i])
        except Overloaded:  # a server answers 503: the request is refused, not queued
            refused += 1
            continue

        def record(f: Future, i: int = i) -> None:
            if not f.cancelled() and f.exception() is None:
                with lock:
                    done_at[i] = time.perf_counter()

        future.add_done_callback(record)
        futures.append(future)
    deadline = time.perf_counter() + timeout_s
    for future in futures:
        with contextlib.suppress(Exception):  # a timeout or a failure: counted as unfinished
            future.result(max(0.0, deadline - time.perf_counter()))
    with lock:
        finished = dict(done_at)
    latencies = np.array([finished[i] - (start + arrivals[i]) for i in sorted(finished)])
    span = (max(finished.values()) - start) if finished else float("nan")
    items = len(finished) * len(requests[0].items)
    unfinished = len(arrivals) - len(finished) - refused
    note = ", ".join(
        f"{n} {what}"
        for n, what in ((refused, "refused (Overloaded)"), (unfinished, "unfinished"))
        if n
    )
    return Outcome(name, latencies, len(arrivals), items / span, note)


# ---------------------------------------------------------------------------------------------
# Peers


def tpuscore_score(scorer: Scorer) -> Callable[[Request], np.ndarray]:
    return lambda r: scorer.score(r.query, r.items, r.labels).logprobs


def hf_model(args: argparse.Namespace, checkpoint: pathlib.Path | None):
    import torch
    from transformers import AutoModelForCausalLM

    if checkpoint is None:  # the embedded GGUF, as benchmarks/bench.py loads it
        from bench import load_hf_model

        return load_hf_model(args.dtype)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, args.dtype))
    return model.cuda().eval()


def hf_score(model, on_gpu: bool) -> Callable[[Request], np.ndarray]:
    """Prefill the query, then every item as one batch on its past_key_values."""
    import torch
    from transformers import DynamicCache

    device = "cuda" if on_gpu else "cpu"

    @torch.inference_mode()
    def score(r: Request) -> np.ndarray:
        query = torch.tensor([r.query], device=device)
        cache = model(input_ids=query, use_cache=True, logits_to_keep=1).past_key_values
        b = len(r.items)
        kv = DynamicCache(
            [
                (layer.keys.expand(b, -1, -1, -1), layer.values.expand(b, -1, -1, -1))
                for layer in cache.layers
            ]
        )
        items = torch.tensor(r.items, device=device)
        logits = model(input_ids=items, past_key_values=kv, logits_to_keep=1).logits
        out = torch.log_softmax(logits[:, -1].float(), dim=-1)[:, r.labels].cpu().numpy()
        return out

    return score


# ---------------------------------------------------------------------------------------------
# Machine and report


def machine() -> str:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, jax devices {jax.devices()}"


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "(from source)"


def print_header(args: argparse.Namespace, model_name: str) -> None:
    packages = ("jax", "torch", "transformers", "tpuscore")
    versions = ", ".join(f"{p} {version(p)}" for p in packages)
    print("# tpuscore serving benchmark\n")
    print(f"- command: `python {' '.join(sys.argv)}`")
    print(f"- machine: {machine()}")
    print(f"- versions: {versions}")
    print(f"- model: {model_name}, dtype {args.dtype}, backend {args.backend}; seed {args.seed}")
    print(
        f"- requests: query {args.query_len} tokens, {args.items} items x {args.item_len} "
        f"tokens, {args.labels} labels; Poisson arrivals for {args.duration:.0f} s"
    )
    print(f"- load average at start: {os.getloadavg()[0]:.2f} (other work skews timings)")
    sys.stdout.flush()


def print_table(outcomes: list[Outcome]) -> None:
    print("\n| peer | requests | items/s | P50 latency s | P99 latency s | note |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for o in outcomes:
        if len(o.latencies):
            p50, p99 = np.percentile(o.latencies, [50, 99])
            figures = f"{o.items_per_s:.1f} | {p50:.3f} | {p99:.3f}"
        else:
            figures = "- | - | -"
        print(f"| {o.name} | {o.submitted} | {figures} | {o.note} |")


# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--duration", type=float, default=30.0, help="seconds of arrivals per peer")
    add("--load", type=float, default=0.7, help="rate as a fraction of sequential requests/s")
    add(
        "--rate",
        type=lambda text: [float(r) for r in text.split(",")],
        help="requests/s (overrides --load); several, comma-separated, run the Batcher at each",
    )
    add("--query-len", type=int, default=300)
    add("--items", type=int, default=10)
    add("--item-len", type=int, default=10)
    add("--labels", type=int, default=2)
    add("--workers", type=int, default=16, help="threads of the thread-pool peers")
    add("--max-wait-ms", type=float, default=2.0, help="the Batcher's max_wait_ms")
    add("--max-batch-tokens", type=int, help="the Batcher's max_batch_tokens (default its own)")
    add("--dtype", choices=["float32", "bfloat16"], help="default float32, bfloat16 with --gpu")
    add("--seed", type=int, default=0)
    add("--backend", default="auto", help="tpuscore's backend for both tpuscore peers")
    add("--batch-invariant", action="store_true", help="the scorer's bitwise batch-invariant mode")
    add("--skip-hf", action="store_true", help="time tpuscore only")
    add("--skip-threads", action="store_true", help="no thread-pool peer of scorer.score")
    add("--gpu", action="store_true", help="a random Qwen3-0.6B-shaped checkpoint, HF on CUDA")
    add("--checkpoint", default=os.path.join(tempfile.gettempdir(), "qwen3-0.6b"))
    add("--unroll-layers", default="", help="platforms that unroll the layer loop, e.g. cuda")
    args = p.parse_args(argv)
    decoder.UNROLLED_LAYERS_ON = frozenset(filter(None, args.unroll_layers.split(",")))
    args.dtype = args.dtype or ("bfloat16" if args.gpu else "float32")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    checkpoint = None
    if args.gpu:
        from random_checkpoint import qwen3_0_6b

        checkpoint = qwen3_0_6b(args.checkpoint, dtype=args.dtype)
    scorer = Scorer.from_pretrained(
        checkpoint, dtype=args.dtype, backend=args.backend, batch_invariant=args.batch_invariant
    )
    model_name = "random Qwen3-0.6B shape" if args.gpu else "embedded default (SmolLM2-135M)"
    print_header(args, model_name)
    rng = np.random.default_rng(args.seed)
    vocab = scorer.config.vocab_size

    score = tpuscore_score(scorer)
    for r in requests_for(rng, 3, args, vocab):  # compile, then time one request at a time
        score(r)
    timing = requests_for(rng, 5, args, vocab)
    start = time.perf_counter()
    for r in timing:
        score(r)
    sequential = len(timing) / (time.perf_counter() - start)
    rates = args.rate or [args.load * sequential]
    print(
        f"- sequential scorer.score: {sequential:.2f} requests/s "
        f"({sequential * args.items:.1f} items/s); rates {', '.join(f'{r:.2f}' for r in rates)} "
        "requests/s"
    )
    per_request = args.query_len + args.items * args.item_len
    full = max(1, (args.max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS) // per_request)
    batch = [
        dict(query=r.query, items=r.items, label_token_ids=r.labels)
        for r in requests_for(rng, full, args, vocab)
    ]
    scorer.score_batch(batch)  # compile
    start = time.perf_counter()
    for _ in range(3):
        scorer.score_batch(batch)
    batched = 3 * full / (time.perf_counter() - start)
    print(f"- score_batch of {full} requests (one full batch): {batched:.2f} requests/s")
    arrivals = {rate: poisson_arrivals(rng, rate, args.duration) for rate in rates}
    print(f"- arrivals per peer: {', '.join(str(len(a)) for a in arrivals.values())}", flush=True)
    timeout_s = max(60.0, 3 * args.duration)
    outcomes = []

    batcher = Batcher(scorer, max_wait_ms=args.max_wait_ms, max_batch_tokens=args.max_batch_tokens)
    with batcher:
        # Warm up the batch shapes bursts of arrivals make: up to a full batch of requests, in
        # powers of two (the row and item counts the backends pad to).
        for burst in [2**k for k in range(full.bit_length() + 1)]:
            futures = [
                batcher.submit(query=r.query, items=r.items, label_token_ids=r.labels)
                for r in requests_for(rng, burst, args, vocab)
            ]
            for future in futures:
                future.result()
        for rate, times in arrivals.items():
            outcomes.append(
                drive(
                    f"tpuscore Batcher at {rate:g} requests/s",
                    lambda r: batcher.submit(
                        query=r.query, items=r.items, label_token_ids=r.labels
                    ),
                    requests_for(rng, len(times), args, vocab),
                    times,
                    timeout_s,
                )
            )
    arrivals = arrivals[rates[0]]  # the other peers run at the first rate

    def on_threads(peer: str, how: str, score_one: Callable[[Request], object]) -> Outcome:
        """The arrivals, each request a call of score_one on a pool of --workers threads."""
        with ThreadPoolExecutor(args.workers) as pool:
            outcome = drive(
                f"{peer} threads ({args.workers}), {how}",
                lambda r: pool.submit(score_one, r),
                requests_for(rng, len(arrivals), args, vocab),
                arrivals,
                timeout_s,
            )
            pool.shutdown(wait=False, cancel_futures=True)  # past the timeout: leave the rest
        return outcome

    if not args.skip_threads:
        outcomes.append(on_threads("tpuscore", "scorer.score", score))
    if not args.skip_hf:
        hf = hf_score(hf_model(args, checkpoint), on_gpu=args.gpu)
        for r in requests_for(rng, 2, args, vocab):
            hf(r)
        outcomes.append(on_threads("HF transformers", "prefill + items on its K/V", hf))

    print_table(outcomes)
    print(f"\n- load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
