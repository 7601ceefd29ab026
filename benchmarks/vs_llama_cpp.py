"""tpuscore against llama.cpp on the same Q4_1 GGUF, in one process, interleaved rounds.

llama.cpp (through llama-cpp-python's low-level API, an optional peer: `CMAKE_ARGS=-DGGML_NATIVE=ON
pip install llama-cpp-python`, with CC=clang CXX=clang++ where clang exists: a GCC 12 build
miscompiles llama.cpp's AMX kernels) runs its best method for this workload: the query
prefilled once as sequence 0, copied into one sequence per item (`llama_memory_seq_cp` on a
unified KV cache, so the query's K/V are shared, not copied), then every item's tokens decoded
in one `llama_batch` with its own seq_id (at most 63 at a time: llama.cpp's limit is 64
sequences), logits kept only at each item's last token; 2 threads. tpuscore scores the same
token ids with its default backend choice ("auto") from the dequantized GGUF.

Flash attention is set through the field the installed llama-cpp-python has (`flash_attn_type`
from 0.3.17, where the old `flash_attn` is ignored), and the header reports the setting that
took effect, llama.cpp's extra buffer types (its AMX and repacked kernels; `--no-extra-bufts`
turns them off) and the CPU features the build uses (`llama_print_system_info`).

Each round draws a fresh query and items (neither side's caches can hit), then times both in
turn; the table shows medians. Scores are compared on every round.

    python benchmarks/vs_llama_cpp.py                         # float32 and mixed, three geometries
    python benchmarks/vs_llama_cpp.py --dtype mixed --geometry sglang --rounds 3
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

import numpy as np

from tpuscore import Scorer
from tpuscore.models.loaders.default import default_model_path

GEOMETRIES = {  # query tokens, items, item tokens
    "sglang": (300, 10, 10),
    "short": (100, 100, 10),
    "long_items": (32, 16, 100),
}
LABELS = 2
MAX_SEQ = 64  # llama.cpp's LLAMA_MAX_SEQ: sequences one context holds


def import_llama_cpp():
    try:
        from llama_cpp import llama_cpp
    except ImportError:
        sys.exit(f"llama.cpp peer: not installed; install it with: {LLAMA_INSTALL}")
    return llama_cpp


LLAMA_INSTALL = (
    'CMAKE_ARGS="-DGGML_NATIVE=ON" CC=clang CXX=clang++ pip install llama-cpp-python '
    "(a 15-20 minute build; drop CC/CXX where clang is missing)"
)
FLASH_ATTN_TYPES = {-1: "auto", 0: "off", 1: "on"}  # llama.cpp's llama_flash_attn_type


class LlamaCpp:
    """One llama.cpp context on a GGUF, scoring with a shared query prefix (module docstring)."""

    def __init__(
        self, path: str, n_ctx: int, n_seq: int, threads: int, flash_attn: bool,
        extra_bufts: bool = True,
    ):  # fmt: skip
        lc = self.lc = import_llama_cpp()
        self._quiet = lc.llama_log_callback(lambda *_: None)  # kept alive: C holds it
        lc.llama_log_set(self._quiet, ctypes.c_void_p(0))
        lc.llama_backend_init()
        model_params = lc.llama_model_default_params()
        self.extra_bufts = _set_field(model_params, "use_extra_bufts", extra_bufts)
        self.model = lc.llama_model_load_from_file(path.encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = lc.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_ctx, 512
        params.n_seq_max, params.kv_unified = n_seq, True
        params.n_threads = params.n_threads_batch = threads
        # A ctypes Structure takes any attribute name silently: set only fields it has.
        if _has_field(params, "flash_attn_type"):
            params.flash_attn_type = 1 if flash_attn else 0
            self.flash_attn = FLASH_ATTN_TYPES.get(params.flash_attn_type, "?")
        elif _has_field(params, "flash_attn"):
            params.flash_attn = flash_attn
            self.flash_attn = "on" if params.flash_attn else "off"
        else:
            self.flash_attn = "not settable in this build"
        params.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, params)
        self.memory = lc.llama_get_memory(self.ctx)
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(n_ctx, 0, 1)

    def describe(self) -> str:
        """The build and the settings that took effect, for a benchmark's header."""
        import llama_cpp

        system = self.lc.llama_print_system_info().decode(errors="replace").strip()
        bufts = {True: "on", False: "off", None: "not settable in this build"}[self.extra_bufts]
        return (
            f"llama-cpp-python {llama_cpp.__version__}, flash attention {self.flash_attn}, "
            f"extra buffer types (AMX/repacked kernels) {bufts}; system info: {system}"
        )

    def _decode(self, tokens: list[tuple[int, int, int, bool]]) -> None:
        """Decode (token, position, seq_id, keep logits) in one batch."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(tokens)
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _logprobs(self, index: int, labels: list[int]) -> np.ndarray:
        row = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, index), (self.vocab,))
        row = row.astype(np.float64)
        top = row.max()
        return (row[labels] - top - np.log(np.exp(row - top).sum())).astype(np.float32)

    def score(self, query: list[int], items: list[list[int]], labels: list[int]) -> np.ndarray:
        """log P(label | query + item) [items, labels]. Items go in groups of at most
        `MAX_SEQ` - 1 sequences (llama.cpp's limit), each group's sequences removed after it."""
        lc = self.lc
        lc.llama_memory_clear(self.memory, True)
        self._decode([(t, p, 0, p == len(query) - 1) for p, t in enumerate(query)])
        after_query = self._logprobs(len(query) - 1, labels)
        out = []
        for start in range(0, len(items), MAX_SEQ - 1):
            group = items[start : start + MAX_SEQ - 1]
            for seq in range(1, len(group) + 1):
                lc.llama_memory_seq_cp(self.memory, 0, seq, -1, -1)
            batch, last = [], []
            for seq, item in enumerate(group, start=1):
                for j, t in enumerate(item):
                    batch.append((t, len(query) + j, seq, j == len(item) - 1))
                last.append(len(batch) - 1 if item else None)
            if batch:
                self._decode(batch)
            out += [after_query if i is None else self._logprobs(i, labels) for i in last]
            for seq in range(1, len(group) + 1):
                lc.llama_memory_seq_rm(self.memory, seq, -1, -1)
        return np.stack(out)


def _has_field(struct, name: str) -> bool:
    return any(field[0] == name for field in type(struct)._fields_)


def _set_field(struct, name: str, value: bool) -> bool | None:
    """Set a bool field where the struct has it; the value that took effect, None without it."""
    if not _has_field(struct, name):
        return None
    setattr(struct, name, value)
    return bool(getattr(struct, name))


def timed(fn, *args) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def run_geometry(name, scorer, llama, args, rng) -> dict:
    query_len, n_items, item_len = GEOMETRIES[name]
    vocab = scorer.config.vocab_size

    def draw():
        query = rng.integers(0, vocab, query_len).tolist()
        items = [rng.integers(0, vocab, item_len).tolist() for _ in range(n_items)]
        return query, items, rng.choice(vocab, LABELS, replace=False).tolist()

    ours = lambda q, i, lab: scorer.score(q, i, lab, backend=args.backend).logprobs  # noqa: E731
    q, i, lab = draw()  # warm-up: compiles tpuscore's shapes, sizes llama.cpp's buffers
    ours(q, i, lab), llama.score(q, i, lab)
    times = {"tpuscore": [], "llama.cpp": []}
    gap = 0.0
    load = os.getloadavg()[0]
    for r in range(args.rounds):
        q, i, lab = draw()
        order = [("tpuscore", ours), ("llama.cpp", llama.score)]
        results = {}
        for peer, fn in order if r % 2 == 0 else order[::-1]:
            seconds, results[peer] = timed(fn, q, i, lab)
            times[peer].append(seconds)
        gap = max(gap, float(np.max(np.abs(results["tpuscore"] - results["llama.cpp"]))))
    med = {peer: statistics.median(t) for peer, t in times.items()}
    return {
        "geometry": f"{name}: query {query_len} + {n_items} x {item_len}",
        "ours": n_items / med["tpuscore"],
        "theirs": n_items / med["llama.cpp"],
        "gap": gap,
        "load": (load + os.getloadavg()[0]) / 2,
        "spread": {p: (max(t) - min(t)) / statistics.median(t) for p, t in times.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", action="append", choices=["float32", "mixed", "bfloat16"])
    parser.add_argument("--geometry", action="append", choices=list(GEOMETRIES))
    parser.add_argument("--backend", default="auto", help="tpuscore's backend (default auto)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    parser.add_argument("--flash-attn", action="store_true", help="llama.cpp's flash attention")
    parser.add_argument(
        "--no-extra-bufts", dest="extra_bufts", action="store_false",
        help="turn off llama.cpp's extra buffer types (its AMX kernels: a GCC build crashes there)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    dtypes = args.dtype or ["float32", "mixed"]
    geometries = args.geometry or list(GEOMETRIES)
    path = str(default_model_path())
    n_ctx = max(q + n * t for q, n, t in GEOMETRIES.values())
    n_seq = min(MAX_SEQ, max(n for _, n, _ in GEOMETRIES.values()) + 1)
    llama = LlamaCpp(path, n_ctx, n_seq, args.threads, args.flash_attn, args.extra_bufts)
    print(f"- command: `python {' '.join(sys.argv)}`")
    print(f"- model: {os.path.basename(path)}; llama.cpp {args.threads} threads; tpuscore "
          f"backend {args.backend}; medians of {args.rounds} interleaved rounds, a fresh query "
          f"each; {os.cpu_count()} cores")  # fmt: skip
    print(f"- llama.cpp: {llama.describe()}\n")
    print("| dtype | geometry | tpuscore items/s | llama.cpp items/s | ratio | max abs diff "
          "| spread (ours / theirs) | load avg |")  # fmt: skip
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
    for dtype in dtypes:
        scorer = Scorer.from_pretrained(None, dtype=dtype)
        for name in geometries:
            row = run_geometry(name, scorer, llama, args, np.random.default_rng(args.seed))
            spread = f"{row['spread']['tpuscore']:.0%} / {row['spread']['llama.cpp']:.0%}"
            print(
                f"| {dtype} | {row['geometry']} | {row['ours']:.2f} | {row['theirs']:.2f} | "
                f"{row['ours'] / row['theirs']:.2f}x | {row['gap']:.3f} | {spread} | "
                f"{row['load']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
