"""Items/s of tpuscore's backends against Hugging Face transformers, on the embedded default model.

Three geometries (random token ids from the model's vocabulary, seeded, 2 labels): "long", one
query of 2000 tokens and 500 items of 20 tokens; "sglang", SGLang PR #10979's query of 300 tokens
and 10 items of 10 tokens; "short", a 100-token query and 100 items of 10 tokens. Every peer
uses the same dtype. Peers too slow for every item time a subset and extrapolate, and their row
says so. Every peer is warmed up once before timing, so compilation is excluded.

    python benchmarks/bench.py                     # every geometry, float32
    python benchmarks/bench.py --geometry short --dtype bfloat16
    python benchmarks/bench.py --quick             # a smoke run in about a minute
    nox -s bench -- --dtype bfloat16
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.metadata
import io
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.utils import logging as hf_logging

from tpuscore import Scorer
from tpuscore.models.config import ModelConfig
from tpuscore.models.loaders.default import default_model_path

# Backends timed on every item, one row each.
FAST_BACKENDS = ["prefill_extend", "packed_dense", "packed_segment"]
PACKED = {"packed_dense", "packed_segment"}
# Backends with a cross-request prefix cache also get a row where the query repeats.
PREFIX_CACHED = {"prefill_extend"}
# Label logprobs further than this from tpuscore serial print a WARNING.
PARITY_TOL = {"float32": 1e-3, "bfloat16": 0.05, "mixed": 0.05}
# The mixed precision's matmuls run in bfloat16 (its roofline); its HF peers run in float32.
MATMUL_DTYPE = {"float32": "float32", "bfloat16": "bfloat16", "mixed": "bfloat16"}
HF_DTYPE = {"float32": "float32", "bfloat16": "bfloat16", "mixed": "float32"}
# The slow peers time a subset of items where all would take minutes. A 2000-token query leaves
# packed_dense no room for items in its CPU memory budget (it degrades to one item per pass) and
# packed_segment runs in Pallas interpret mode off TPU: the long geometry skips both.
GEOMETRIES = {
    "long": dict(query_len=2000, items=500, item_len=20, serial_subset=4, hf_naive_subset=4),
    "sglang": dict(query_len=300, items=10, item_len=10, serial_subset=10, hf_naive_subset=10),
    "short": dict(query_len=100, items=100, item_len=10, serial_subset=100, hf_naive_subset=100),
}
PACKED_GEOMETRIES = {"sglang", "short"}
QUICK = {
    "geometry": "short",
    "query_len": 64,
    "items": 16,
    "item_len": 8,
    "serial_subset": 2,
    "hf_naive_subset": 2,
    "hf_naive_batch": 2,
    "hf_batch_sizes": "4,8",
    "matmul_size": 512,
}


@dataclasses.dataclass(frozen=True)
class Request:
    query: list[int]
    items: list[list[int]]
    labels: list[int]

    def head(self, n: int) -> Request:
        return dataclasses.replace(self, items=self.items[:n])


@dataclasses.dataclass(frozen=True)
class Peer:
    """One row of the table: a way to score a request, returning logprobs [items, labels]."""

    name: str
    score: Callable[[Request], np.ndarray]
    subset: int | None = None  # time only this many items and extrapolate; None: all
    fresh_query: bool = True  # a never-seen query each timed run, so no prefix cache can hit
    fixed_s: float = 0.0  # one-off cost inside each run (a prefill), not scaled by extrapolation
    warmup: bool = True  # False where nothing compiles (torch eager)


@dataclasses.dataclass(frozen=True)
class Row:
    peer: Peer
    timed_items: int
    total_s: float  # for all items, measured or extrapolated
    spread: float  # (slowest - fastest) / median of the timed runs: noise, or a busy machine
    max_diff: float | None  # max |logprob - serial's| on the first few items


# ---------------------------------------------------------------------------------------------
# Work and machine


def prefill_extend_flops(
    config: ModelConfig, query_len: int, item_lens: list[int], num_labels: int
) -> int:
    """Matmul FLOPs (2 per multiply-add) of the useful work: the query's tokens once, then each
    item's tokens against the query's K/V and its own, and the LM head at each item's last token.

    num_labels does not enter: the log-softmax needs all V logits whatever the label count.
    """
    del num_labels
    D, F, V = config.hidden_size, config.intermediate_size, config.vocab_size
    N, K, H = config.num_heads, config.num_kv_heads, config.head_dim
    per_token = 2 * D * (N * H + 2 * K * H) + 2 * N * H * D + 3 * 2 * D * F  # qkv, o, MLP
    per_key = 2 * 2 * N * H  # q.k and p.v for one query token against one key

    def keys(start: int, n: int) -> int:  # tokens at positions start..start+n-1, causal
        return n * start + n * (n + 1) // 2

    tokens = query_len + sum(item_lens)
    attended = keys(0, query_len) + sum(keys(query_len, n) for n in item_lens)
    return config.num_layers * (tokens * per_token + attended * per_key) + 2 * D * V * len(
        item_lens
    )


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def jax_matmul_gflops(n: int, dtype: str, repeats: int) -> float:
    a = jnp.ones((n, n), dtype)
    if dtype == "bfloat16":
        fn = jax.jit(lambda x: jnp.matmul(x, x, preferred_element_type=jnp.float32))
    else:  # what the decoder asks for float32 weights
        fn = jax.jit(lambda x: jnp.matmul(x, x, precision=jax.lax.Precision.HIGHEST))
    return 2 * n**3 / median_seconds(lambda: fn(a).block_until_ready(), repeats) / 1e9


def torch_matmul_gflops(n: int, dtype: str, repeats: int) -> float:
    a = torch.ones((n, n), dtype=getattr(torch, dtype))
    return 2 * n**3 / median_seconds(lambda: a @ a, repeats) / 1e9


def matmul_rates(n: int, dtype: str, repeats: int) -> dict[str, float]:
    """GFLOP/s of an n x n x n matmul in JAX and torch; measured before and after the peers, so
    that a busy machine shows as a difference."""
    jax_rate = jax_matmul_gflops(n, dtype, repeats)
    return {"JAX": jax_rate, "torch": torch_matmul_gflops(n, dtype, repeats)}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def print_header(args: argparse.Namespace) -> None:
    versions = {
        p: importlib.metadata.version(p) for p in ("jax", "torch", "transformers", "tpuscore")
    }
    print("# tpuscore benchmark\n")
    print(f"- command: `python {' '.join(sys.argv)}`")
    print(f"- machine: {cpu_model()}, {os.cpu_count()} cores, jax devices {jax.devices()}")
    print(f"- versions: {', '.join(f'{k} {v}' for k, v in versions.items())}")
    print(
        f"- model: {default_model_path().name}, dtype {args.dtype}; seed {args.seed}; "
        f"medians of {args.repeats} runs"
    )
    print(f"- load average at start: {os.getloadavg()[0]:.2f} (other work skews timings)")
    print("- every peer is warmed up before timing (compilation excluded)", flush=True)


def print_geometry(args: argparse.Namespace) -> None:
    print(
        f"\n## geometry {args.geometry}: query {args.query_len} tokens, {args.items} items x "
        f"{args.item_len} tokens, {args.labels} labels\n",
        flush=True,
    )


# ---------------------------------------------------------------------------------------------
# Peers


def tpuscore_peers(scorer: Scorer, args: argparse.Namespace) -> list[Peer]:
    def score_with(backend: str) -> Callable[[Request], np.ndarray]:
        return lambda r: scorer.score(r.query, r.items, r.labels, backend=backend).logprobs

    k = args.serial_subset
    peers = [Peer(f"tpuscore serial{extrapolated(k, args)}", score_with("serial"), k)]
    for backend in FAST_BACKENDS:
        if backend in PACKED and not args.packed:
            continue
        # The cold row runs first: its warm-up must be the first time the backend sees a query.
        note = " (cold: a new query each run)" if backend in PREFIX_CACHED else ""
        if backend == "packed_segment" and jax.default_backend() != "tpu":
            note = " (Pallas interpret mode: not a speed figure)"
        peers.append(Peer(f"tpuscore {backend}{note}", score_with(backend)))
        if backend in PREFIX_CACHED:
            name = f"tpuscore {backend} (warm prefix cache: the same query)"
            peers.append(Peer(name, score_with(backend), fresh_query=False))
    return peers


def extrapolated(subset: int, args: argparse.Namespace) -> str:
    return f" (extrapolated from {subset} items)" if subset < args.items else ""


def load_hf_model(dtype: str) -> torch.nn.Module:
    """The same GGUF, dequantized by transformers into plain Linear layers of `dtype`. (Its
    warning that packed GGUF weights are fastest in float32 does not apply: none stay packed.)"""
    hf_logging.disable_progress_bar()
    path = default_model_path()
    with contextlib.redirect_stderr(io.StringIO()):  # its GGUF reader's tqdm bar ignores the above
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=getattr(torch, dtype)
        )
    proj = model.model.layers[0].self_attn.q_proj
    print(
        f"HF model: {type(proj).__name__} {proj.weight.dtype} weights, "
        f"{model.config._attn_implementation} attention"
    )
    return model.eval()


def label_logprobs(logits: torch.Tensor, labels: list[int]) -> np.ndarray:
    """logits [B, 1, V] -> log P(label) [B, C] in float32."""
    return torch.log_softmax(logits[:, -1].float(), dim=-1)[:, labels].numpy()


def check_item_lens(request: Request) -> None:
    # Batched HF runs below assume no padding: right padding would move the scored position
    # (logits_to_keep=1), left padding the positions (a plain forward ignores the mask for them).
    if len({len(item) for item in request.items}) > 1:
        raise ValueError("the HF peers need items of equal length")


@torch.inference_mode()
def hf_naive(model: torch.nn.Module, request: Request, batch: int) -> np.ndarray:
    """What most users write: every query + item sequence through the model, in batches."""
    check_item_lens(request)
    out = []
    for start in range(0, len(request.items), batch):
        rows = [request.query + item for item in request.items[start : start + batch]]
        logits = model(input_ids=torch.tensor(rows), use_cache=False, logits_to_keep=1).logits
        out.append(label_logprobs(logits, request.labels))
    return np.concatenate(out)


@torch.inference_mode()
def hf_prefill(model: torch.nn.Module, query: list[int]) -> list[tuple[torch.Tensor, ...]]:
    """The query's K/V per layer, each [1, K, Tq, H]."""
    cache = model(input_ids=torch.tensor([query]), use_cache=True, logits_to_keep=1).past_key_values
    return [(layer.keys, layer.values) for layer in cache.layers]


@torch.inference_mode()
def hf_extend(
    model: torch.nn.Module,
    prefix: list[tuple[torch.Tensor, ...]],
    items: list[list[int]],
    labels: list[int],
) -> np.ndarray:
    """One batch of items against the query's K/V, replicated to the batch size."""
    b = len(items)
    cache = DynamicCache([(k.expand(b, -1, -1, -1), v.expand(b, -1, -1, -1)) for k, v in prefix])
    logits = model(input_ids=torch.tensor(items), past_key_values=cache, logits_to_keep=1).logits
    return label_logprobs(logits, labels)


def hf_cached(model: torch.nn.Module, request: Request, batch: int) -> np.ndarray:
    """What a careful user writes: prefill the query once, then batches of items on its cache."""
    check_item_lens(request)
    prefix = hf_prefill(model, request.query)
    batches = [request.items[i : i + batch] for i in range(0, len(request.items), batch)]
    return np.concatenate([hf_extend(model, prefix, b, request.labels) for b in batches])


def hf_cached_peer(model: torch.nn.Module, request: Request, args: argparse.Namespace) -> Peer:
    """Pick the fastest item batch size on one batch of each; run every item if that is
    estimated to fit in --hf-budget-s, else one batch, extrapolated with the prefill counted
    once. Also warms the model up."""
    prefix = hf_prefill(model, request.query)  # also the warm-up
    start = time.perf_counter()
    hf_prefill(model, request.query)
    prefill_s = time.perf_counter() - start
    per_item = {}
    for b in args.hf_batch_sizes:
        items = request.items[:b]
        t = median_seconds(lambda items=items: hf_extend(model, prefix, items, request.labels), 1)
        per_item[b] = t / len(items)
    batch = min(per_item, key=per_item.get)
    sizes = ", ".join(f"{b}: {1 / s:.1f} items/s" for b, s in per_item.items())
    print(f"HF cached: prefill {prefill_s:.2f} s; item batch sizes {sizes}; chosen {batch}")
    n = len(request.items)
    estimate = prefill_s + n * per_item[batch]
    subset = None if estimate <= args.hf_budget_s else min(n, batch)
    label = f"HF past_key_values, batch {batch}"
    if subset:
        label += f" (extrapolated from {subset} items + 1 prefill)"
    score = functools.partial(hf_cached, model, batch=batch)
    return Peer(label, score, subset, fixed_s=prefill_s, warmup=False)


# ---------------------------------------------------------------------------------------------
# Timing and report


def time_peer(
    peer: Peer, request: Request, new_query: Callable[[], list[int]], repeats: int, check: int
) -> tuple[list[float], int, np.ndarray]:
    """Seconds of each timed run over the peer's items, and logprobs of its first items on the
    base query (the parity sample)."""
    sub = request.head(peer.subset or len(request.items))
    # A warm-up compiles, and its first items are the parity sample; else score those alone.
    logprobs = peer.score(sub if peer.warmup else request.head(check))
    times = []
    for _ in range(repeats):
        run = dataclasses.replace(sub, query=new_query()) if peer.fresh_query else sub
        start = time.perf_counter()
        peer.score(run)
        times.append(time.perf_counter() - start)
    return times, len(sub.items), logprobs


def run_peers(peers: list[Peer], request: Request, args: argparse.Namespace) -> list[Row]:
    rng = np.random.default_rng(args.seed + 1)
    vocab = args.vocab_size
    rows, reference = [], None
    for peer in peers:
        print(f"{time.strftime('%H:%M:%S')} timing {peer.name} ...", flush=True)
        times, k, logprobs = time_peer(
            peer,
            request,
            lambda: random_ids(rng, args.query_len, vocab),
            args.repeats,
            args.check_items,
        )
        t = statistics.median(times)
        n = len(request.items)
        total = t if k == n else peer.fixed_s + (t - peer.fixed_s) * n / k
        if reference is None:  # the first peer, tpuscore serial, is the parity reference
            reference, diff = logprobs, None
        else:
            m = min(args.check_items, len(reference), len(logprobs))
            diff = float(np.abs(logprobs[:m] - reference[:m]).max())
        rows.append(Row(peer, k, total, (max(times) - min(times)) / t, diff))
    return rows


def print_table(rows: list[Row], n_items: int, tol: float) -> None:
    naive = next((r for r in rows if r.peer.name.startswith("HF naive")), None)
    serial = rows[0]  # tpuscore serial runs first
    print(
        f"\n| peer | items timed | s for {n_items} items | spread | items/s | x serial "
        "| x HF naive | max abs diff |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        ratio = f"{naive.total_s / r.total_s:.2f}" if naive else "-"
        diff = "reference" if r.max_diff is None else f"{r.max_diff:.2e}"
        print(
            f"| {r.peer.name} | {r.timed_items} | {r.total_s:.2f} | {100 * r.spread:.0f}% | "
            f"{n_items / r.total_s:.2f} | {serial.total_s / r.total_s:.2f} | {ratio} | {diff} |"
        )
    print(
        "\nspread: (slowest - fastest) / median of the timed runs. max abs diff: label logprobs"
        " against tpuscore serial on the first items."
    )
    for r in rows:
        if r.max_diff is not None and not r.max_diff <= tol:
            print(f"WARNING: {r.peer.name} differs from serial by {r.max_diff:.2e} > {tol}")


def print_work(
    config: ModelConfig,
    args: argparse.Namespace,
    rows: list[Row],
    start_rates: dict[str, float],
    end_rates: dict[str, float],
) -> None:
    """The matmul rates, prefill_extend's useful FLOPs and its share of the JAX matmul rate."""
    n = args.matmul_size
    rates = ", ".join(f"{k} {start_rates[k]:.0f} / {end_rates[k]:.0f}" for k in start_rates)
    dtype = MATMUL_DTYPE[args.dtype]
    print(f"\nmatmul {n}x{n}x{n} {dtype} GFLOP/s (before / after the peers): {rates}")
    if abs(end_rates["JAX"] - start_rates["JAX"]) > 0.2 * start_rates["JAX"]:
        print("NOTE: the matmul rate moved by over 20%: other work on the machine skews timings")
    roofline = max(start_rates["JAX"], end_rates["JAX"])
    flops = prefill_extend_flops(config, args.query_len, [args.item_len] * args.items, args.labels)
    print(
        f"prefill_extend useful work: {flops / 1e9:.1f} GFLOP; at the JAX matmul rate "
        f"({roofline:.0f} GFLOP/s) at least {flops / roofline / 1e9:.2f} s for {args.items} items"
    )
    cold = next((r for r in rows if r.peer.name.startswith("tpuscore prefill_extend (cold")), None)
    if cold:
        rate = flops / cold.total_s / 1e9
        share = 100 * rate / roofline
        print(f"prefill_extend (cold) achieves {rate:.1f} GFLOP/s: {share:.0f}% of that rate")
    else:
        print("prefill_extend is not registered: no achieved FLOP/s")


def random_ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(0, vocab, size=n).tolist()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--geometry", choices=[*GEOMETRIES, "all"], default="all")
    add("--query-len", type=int, help="query tokens (overrides the geometry's)")
    add("--items", type=int, help="items per request (overrides the geometry's)")
    add("--item-len", type=int, help="tokens per item (overrides the geometry's)")
    add("--labels", type=int, default=2, help="label tokens")
    add("--dtype", choices=["float32", "bfloat16", "mixed"], default="float32")
    add("--repeats", type=int, default=3, help="timed runs per peer; the median is reported")
    add("--seed", type=int, default=0)
    add("--serial-subset", type=int, help="items timed for tpuscore serial")
    add("--hf-naive-subset", type=int, help="items timed for HF naive")
    add("--hf-naive-batch", type=int, default=4, help="sequences per HF naive forward")
    add("--hf-batch-sizes", default="16,32,64", help="item batch sizes tried for HF cached")
    add("--hf-budget-s", type=float, default=120.0, help="HF cached runs every item below this")
    add("--check-items", type=int, default=4, help="items compared against serial")
    add("--matmul-size", type=int, default=2048, help="n of the n x n x n matmul roofline")
    add("--skip-hf", action="store_true", help="time tpuscore only")
    add("--quick", action="store_true", help="a small geometry for a smoke run")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    args.hf_batch_sizes = [int(b) for b in str(args.hf_batch_sizes).split(",")]
    return args


def geometry_args(name: str, args: argparse.Namespace) -> argparse.Namespace:
    """args with the geometry's sizes, where the command line did not give them."""
    given = {k: v for k, v in vars(args).items() if v is not None}
    packed = name in PACKED_GEOMETRIES
    return argparse.Namespace(**(GEOMETRIES[name] | given | {"geometry": name, "packed": packed}))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print_header(args)
    scorer = Scorer.from_pretrained(None, dtype=args.dtype)
    model = None if args.skip_hf else load_hf_model(HF_DTYPE[args.dtype])
    names = list(GEOMETRIES) if args.geometry == "all" else [args.geometry]
    for name in names:
        run_geometry(scorer, model, geometry_args(name, args))


def run_geometry(scorer: Scorer, model: torch.nn.Module | None, args: argparse.Namespace) -> None:
    print_geometry(args)
    config = scorer.config
    args.vocab_size = config.vocab_size
    rng = np.random.default_rng(args.seed)
    request = Request(
        query=random_ids(rng, args.query_len, config.vocab_size),
        items=[random_ids(rng, args.item_len, config.vocab_size) for _ in range(args.items)],
        labels=random_ids(rng, args.labels, config.vocab_size),
    )

    peers = tpuscore_peers(scorer, args)
    if model is not None:
        k, b = args.hf_naive_subset, args.hf_naive_batch
        name = f"HF naive, batch {b}{extrapolated(k, args)}"
        cached = hf_cached_peer(model, request, args)  # first: it warms the model up
        peers.append(Peer(name, functools.partial(hf_naive, model, batch=b), k, warmup=False))
        peers.append(cached)
    start_rates = matmul_rates(args.matmul_size, MATMUL_DTYPE[args.dtype], args.repeats)
    rows = run_peers(peers, request, args)
    print_table(rows, args.items, PARITY_TOL[args.dtype])
    end_rates = matmul_rates(args.matmul_size, MATMUL_DTYPE[args.dtype], args.repeats)
    print_work(config, args, rows, start_rates, end_rates)


if __name__ == "__main__":
    main()
