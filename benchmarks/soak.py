"""A soak benchmark of the service: the same varied requests through the in-process Batcher and
through `tpuscore serve`'s HTTP app, from many closed-loop clients, for minutes (issue 25).

Each phase runs --clients clients for --duration seconds; a client sends its next request when
it has its answer. The requests are one seeded list of varied geometries (query, item count and
item lengths) as /v1/score token ids, every fourth a /v1/rerank of text documents; client k
sends request k, k + clients, ... in both phases, after --warmup seconds of it unmeasured.
Measured per phase: requests/s, P50 and P99 latency, XLA compilations (JAX's compile events)
and resident memory over time (sampled every 0.5 s); the table counts the answers by status.
The HTTP clients run in a subprocess, so they do not share the server's interpreter, but they
do share its cores: by default they are raw asyncio HTTP/1.1 connections (`raw_clients`) that
cost a few percent of the server's CPU; `--client httpx` drives it with httpx instead.

    python benchmarks/soak.py                         # the embedded default model, CPU
    python benchmarks/soak.py --tiny --duration 30    # a tiny random checkpoint
    python benchmarks/soak.py --json soak.json --plot docs/soak.png
    python benchmarks/soak.py --tiny --backend packed_dense \
        --warmup-all query_tokens=160,item_tokens=64,labels=2   # the shape set first
    python benchmarks/soak.py --tiny --rounds 3 ...   # in-process, HTTP, in-process, ... x3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
RSS_PERIOD_S = 0.5
DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "In the morning the market opens early and closes late.",
    "Rotary position embeddings rotate queries and keys by position.",
    "Children played in the park until the evening came.",
    "The river ran past the old mill and under the bridge.",
    "A fox hid in the hedge while the hounds went by.",
    "Interest rates rose for the third time this year.",
    "The recipe needs two eggs, flour and a pinch of salt.",
]
QUERIES = ["Which passage is about a fox?", "What happened to rates?", "Where is the mill?"]


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def make_requests(rng: np.random.Generator, n: int, vocab: int) -> list[tuple[str, dict]]:
    """n (path, body) pairs: /v1/score with varied geometry, every fourth a /v1/rerank."""
    requests = []
    for i in range(n):
        if i % 4 == 3:
            k = int(rng.integers(2, len(DOCS) + 1))
            docs = [DOCS[j] for j in rng.permutation(len(DOCS))[:k]]
            query = QUERIES[int(rng.integers(len(QUERIES)))]
            requests.append(("/v1/rerank", {"query": query, "documents": docs}))
            continue
        query = rng.integers(0, vocab, int(rng.integers(16, 129))).tolist()
        items = [
            rng.integers(0, vocab, int(rng.integers(4, 33))).tolist()
            for _ in range(int(rng.integers(1, 17)))
        ]
        labels = rng.integers(0, vocab, 2).tolist()
        requests.append(("/v1/score", {"query": query, "items": items, "label_token_ids": labels}))
    return requests


def cpu_seconds(who: int) -> float:
    """User plus system CPU seconds of this process (RUSAGE_SELF, every thread) or of its
    finished children (RUSAGE_CHILDREN: the HTTP clients' subprocess)."""
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


class Sampler:
    """Resident memory every RSS_PERIOD_S, the compile events and the CPU time spent, from
    start() to stop()."""

    def __init__(self, compiles: list[float]):
        self.compiles, self.samples, self.stopping = compiles, [], threading.Event()

    def start(self):
        self.t0, self.compiles0 = time.monotonic(), len(self.compiles)
        self.cpu0 = [cpu_seconds(resource.RUSAGE_SELF), cpu_seconds(resource.RUSAGE_CHILDREN)]
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    def sample(self):
        while not self.stopping.wait(RSS_PERIOD_S):
            self.samples.append((time.monotonic() - self.t0, rss_mib()))

    def stop(self) -> dict:
        self.stopping.set()
        self.thread.join()
        return {
            "rss": self.samples,
            "compiles": len(self.compiles) - self.compiles0,
            "cpu_s": cpu_seconds(resource.RUSAGE_SELF) - self.cpu0[0],
            "client_cpu_s": cpu_seconds(resource.RUSAGE_CHILDREN) - self.cpu0[1],
        }


def in_process(service, requests, clients: int, duration: float) -> list[tuple]:
    """Closed-loop client threads calling the Batcher as the HTTP handlers do: (start s,
    latency s, status) per request."""
    from tpuscore import Overloaded

    t0, out, lock = time.monotonic(), [], threading.Lock()

    def client(k: int):
        i = k
        while time.monotonic() - t0 < duration:
            path, body = requests[i % len(requests)]
            start = time.monotonic()
            try:
                if path == "/v1/score":
                    service.batcher.score(**body)
                else:
                    t = service.template
                    service.batcher.score(
                        query=t.render_query(body["query"]),
                        items=[t.render_item(d) for d in body["documents"]],
                        labels=list(t.labels),
                        item_suffix=t.item_suffix,
                    )
                status = 200
            except Overloaded:
                status = 503
            with lock:
                out.append((start - t0, time.monotonic() - start, status))
            i += clients

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


async def raw_clients(url: str, requests, clients: int, duration: float) -> list[tuple]:
    """The HTTP phase's default clients: one keep-alive HTTP/1.1 connection each, written and
    read with asyncio streams, every request's bytes built once up front. They share the two
    cores with the server, so they should cost as little as the in-process phase's threads do:
    httpx spends about 3 ms of CPU a request here (its pool, anyio, a module lookup per call),
    a sixth of what the server spends scoring one."""
    address = urllib.parse.urlsplit(url)
    host, port = address.hostname, address.port
    encoded = []
    for path, body in requests:
        data = json.dumps(body, separators=(",", ":")).encode()
        head = f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        encoded.append(head.encode() + data)
    t0, out = time.monotonic(), []

    async def client(k: int):
        reader, writer = await asyncio.open_connection(host, port)
        i = k
        while time.monotonic() - t0 < duration:
            start = time.monotonic()
            writer.write(encoded[i % len(encoded)])
            status, keep_alive = await read_response(reader)
            out.append((start - t0, time.monotonic() - start, status))
            if not keep_alive:
                writer.close()
                reader, writer = await asyncio.open_connection(host, port)
            i += clients
        writer.close()

    await asyncio.gather(*(client(k) for k in range(clients)))
    return out


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """One HTTP/1.1 response's status, and whether its connection stays open; its body is
    read (by Content-Length, which the server always sends) and dropped."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
    lines = head.split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    if "content-length" not in headers:
        raise RuntimeError(f"a response without Content-Length: {lines[0]!r}")
    await reader.readexactly(int(headers["content-length"]))
    return int(lines[0].split()[1]), headers.get("connection") != "close"


async def http_clients(url: str, requests, clients: int, duration: float) -> list[tuple]:
    """The HTTP phase's clients with httpx (`--client httpx`), as a Python service calls."""
    import httpx

    t0, out = time.monotonic(), []
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:

        async def client(k: int):
            i = k
            while time.monotonic() - t0 < duration:
                path, body = requests[i % len(requests)]
                start = time.monotonic()
                response = await c.post(path, json=body)
                out.append((start - t0, time.monotonic() - start, response.status_code))
                i += clients

        await asyncio.gather(*(client(k) for k in range(clients)))
    return out


def summary(name: str, answers: list[tuple], sampled: dict, duration: float) -> dict:
    latencies = np.array([a[1] for a in answers if a[2] == 200])
    statuses: dict[str, int] = {}
    for a in answers:
        statuses[str(a[2])] = statuses.get(str(a[2]), 0) + 1
    rss = np.array(sampled["rss"]).reshape(-1, 2)  # (seconds, MiB) every RSS_PERIOD_S
    return {
        "name": name,
        "requests": len(answers),
        "requests_per_s": len(latencies) / duration,
        "p50_s": float(np.percentile(latencies, 50)) if len(latencies) else None,
        "p99_s": float(np.percentile(latencies, 99)) if len(latencies) else None,
        "statuses": statuses,
        "compiles": sampled["compiles"],
        # CPU per answer: the serving process (its in-process clients' threads included) and
        # the HTTP clients' subprocess (0 for the in-process phase).
        "cpu_ms_per_request": 1e3 * sampled["cpu_s"] / max(len(answers), 1),
        "client_cpu_ms_per_request": 1e3 * sampled["client_cpu_s"] / max(len(answers), 1),
        "rss_start_mib": float(rss[0, 1]) if len(rss) else None,
        "rss_end_mib": float(rss[-1, 1]) if len(rss) else None,
        "rss_min_mib": float(rss[:, 1].min()) if len(rss) else None,
        "rss_peak_mib": float(rss[:, 1].max()) if len(rss) else None,
        "rss_slope_mib_per_min": rss_slope(rss),
        "answers": answers,
        "rss": sampled["rss"],
    }


def rss_slope(rss: np.ndarray) -> float | None:
    """MiB a minute that resident memory gains over the second half of a phase (a least-squares
    line through its samples): near 0 once it plateaus. Memory swings by hundreds of MiB from
    one sample to the next as batches allocate and free, so start and end alone say little."""
    late = rss[rss[:, 0] >= rss[-1, 0] / 2] if len(rss) else rss
    if len(late) < 2:
        return None
    return float(60 * np.polyfit(late[:, 0], late[:, 1], 1)[0])


def serve(app) -> tuple[str, object, threading.Thread]:
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return url, server, thread


def plot(results: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    labelled = set()
    for r in results:
        kind = r["name"].split(",")[0].split(" (")[0]  # "in-process Batcher" or "HTTP"
        color = "tab:orange" if kind == "HTTP" else "tab:blue"
        label = None if kind in labelled else r["name"].split(", round")[0]
        labelled.add(kind)
        answers = np.array([(a[0], a[1]) for a in r["answers"] if a[2] == 200])
        if len(answers):
            top.scatter(answers[:, 0], answers[:, 1] * 1e3, s=3, color=color, label=label)
        rss = np.array(r["rss"])
        if len(rss):
            bottom.plot(rss[:, 0], rss[:, 1], color=color, label=label)
    top.set(ylabel="latency (ms)", yscale="log", title=title)
    bottom.set(xlabel="seconds into the phase", ylabel="resident memory (MiB)")
    top.legend(markerscale=4)
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny random Qwen3 checkpoint")
    p.add_argument("--duration", type=float, default=60.0, help="seconds per phase")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="alternate the two phases this many times (in-process, HTTP, in-process, ...): on "
        "a shared machine the load drifts, and alternating exposes both phases to it alike",
    )
    p.add_argument("--requests", type=int, default=400, help="distinct requests in the list")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every figure and answer here")
    p.add_argument("--plot", help="write a PNG of latency and RSS over time here")
    p.add_argument("--warmup", type=float, help="seconds of unmeasured traffic first (--duration)")
    p.add_argument(
        "--warmup-all",
        metavar="LIMITS",
        help="first compile the scorer's shape set within LIMITS (query_tokens=N,item_tokens=N,"
        "labels=N; `warmup(all=True)`), so the phases should compile nothing",
    )
    p.add_argument("--backend", default="auto", help="the scorer's backend (default auto)")
    p.add_argument(
        "--client",
        choices=("raw", "httpx"),
        default="raw",
        help="the HTTP phase's clients: raw asyncio HTTP/1.1 (default, lightest) or httpx",
    )
    hidden = {"nargs": 3, "metavar": ("URL", "REQUESTS", "OUT"), "help": argparse.SUPPRESS}
    p.add_argument("--http-client", **hidden)
    args = p.parse_args(argv)

    if args.http_client:  # the subprocess that drives the HTTP phase
        url, requests_file, out = args.http_client
        requests = json.loads(pathlib.Path(requests_file).read_text())
        clients = raw_clients if args.client == "raw" else http_clients
        answers = asyncio.run(clients(url, requests, args.clients, args.duration))
        pathlib.Path(out).write_text(json.dumps(answers))
        return

    from jax import monitoring  # here: the clients' subprocess (above) does without JAX

    from tpuscore import Scorer, templates
    from tpuscore.serving import app as server

    compiles: list[float] = []
    monitoring.register_event_duration_secs_listener(
        lambda event, secs, **_: compiles.append(secs) if event == COMPILE_EVENT else None
    )
    if args.tiny:
        sys.path.insert(0, str(HERE.parent / "tests"))
        from hf_reference import make_checkpoint

        scorer = Scorer.from_pretrained(
            make_checkpoint(tempfile.mkdtemp(), "qwen3_qknorm"), dtype="float32",
            backend=args.backend,
        )  # fmt: skip
        template = templates.Template(
            name="soak", query="{instruction}\n\nQuery: {query}\n", item="Document: {item}",
            item_suffix="\nRelevant:", labels=("y", "n"), default_instruction="Relevant?",
        )  # fmt: skip
        model = "tiny random qwen3 (float32)"
    else:
        scorer = Scorer.from_pretrained(backend=args.backend)
        template, model = "plain", "SmolLM2-135M-Instruct"
    rng = np.random.default_rng(args.seed)
    requests = make_requests(rng, args.requests, scorer.config.vocab_size)
    print("# tpuscore soak benchmark\n")
    print(f"- command: `python benchmarks/soak.py {' '.join(argv or sys.argv[1:])}`")
    print(f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print(f"- load average at start: {os.getloadavg()[0]:.2f} (other work skews timings)")
    print(f"- model: {model}; {args.clients} clients, {args.duration:.0f} s a phase")
    sys.stdout.flush()

    if args.warmup_all is not None:
        pairs = (part.split("=") for part in args.warmup_all.split(",") if part)
        limits = {name: int(value) for name, value in pairs}
        start, count = time.monotonic(), len(scorer.shapes(limits))
        scorer.warmup(all=True, limits=limits)
        took = time.monotonic() - start
        print(
            f"- warmup(all=True) {limits}: {count} shapes, {len(compiles)} compiles, {took:.0f} s"
        )
    batcher_options = {"max_pending": 4 * args.clients}
    start = time.monotonic()
    app = server.create_app(scorer, rerank_template=template, batcher_options=batcher_options)
    service = app.state.service
    warmup = args.duration if args.warmup is None else args.warmup
    in_process(service, requests, args.clients, warmup)  # the same traffic, unmeasured
    warm_rss, warm_compiles = rss_mib(), len(compiles)
    took = time.monotonic() - start
    print(f"- warmup: {took:.0f} s of the traffic, {warm_compiles} compiles, {warm_rss:.0f} MiB")

    results, ratios = [], []
    url, uv, thread = serve(app)
    with tempfile.TemporaryDirectory() as tmp:
        requests_file, out = pathlib.Path(tmp, "requests.json"), pathlib.Path(tmp, "out.json")
        requests_file.write_text(json.dumps(requests))
        for round_ in range(1, args.rounds + 1):
            suffix = f", round {round_}" if args.rounds > 1 else ""
            sampler = Sampler(compiles).start()
            answers = in_process(service, requests, args.clients, args.duration)
            sampled = sampler.stop()
            results.append(summary("in-process Batcher" + suffix, answers, sampled, args.duration))

            sampler = Sampler(compiles).start()
            command = [sys.executable, __file__, "--client", args.client]
            command += ["--clients", str(args.clients)]
            command += ["--duration", str(args.duration), "--http-client", url, str(requests_file)]
            # Bounded: the clients stop after --duration; a hung server cannot hold the run.
            subprocess.run([*command, str(out)], check=True, timeout=args.duration + 300)
            answers = [tuple(a) for a in json.loads(out.read_text())]
            name = f"HTTP (uvicorn, {args.client} clients){suffix}"
            results.append(summary(name, answers, sampler.stop(), args.duration))
            ratios.append(results[-1]["requests_per_s"] / max(results[-2]["requests_per_s"], 1e-9))
    uv.should_exit = True
    thread.join(60)

    print(
        "\n| phase | requests | answers | requests/s | P50 ms | P99 ms | compiles "
        "| RSS MiB: start, min-peak, end | RSS MiB/min, 2nd half "
        "| CPU ms/request: server, clients |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: | --- |")
    for r in results:
        p50 = f"{1e3 * r['p50_s']:.0f}" if r["p50_s"] is not None else "-"
        p99 = f"{1e3 * r['p99_s']:.0f}" if r["p99_s"] is not None else "-"
        slope = r["rss_slope_mib_per_min"]
        slope = f"{slope:+.1f}" if slope is not None else "-"
        print(
            f"| {r['name']} | {r['requests']} | {r['statuses']} | {r['requests_per_s']:.1f} | "
            f"{p50} | {p99} | {r['compiles']} | "
            f"{r['rss_start_mib']:.0f}, {r['rss_min_mib']:.0f}-{r['rss_peak_mib']:.0f}, "
            f"{r['rss_end_mib']:.0f} | {slope} | "
            f"{r['cpu_ms_per_request']:.1f}, {r['client_cpu_ms_per_request']:.2f} |"
        )
    each = ", ".join(f"{r:.2f}" for r in ratios)
    print(f"\nHTTP / in-process throughput: {each} (median {float(np.median(ratios)):.2f})")
    print(f"- load average at the end: {os.getloadavg()[0]:.2f}")
    if args.json:
        figures = {"model": model, "results": results, "ratios": ratios}
        pathlib.Path(args.json).write_text(json.dumps(figures))
    if args.plot:
        plot(results, args.plot, f"soak: {model}, {args.clients} clients")


if __name__ == "__main__":
    main()
