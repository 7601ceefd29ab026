"""Adapter mixing: items/s of `score_batch` when the traffic names 0, 1, 4 or 16 LoRA adapters.

The default model (SmolLM2-135M-Instruct, float32) with 16 random LoRA adapters written in
PEFT's file format (`adapter_config.json` + `adapter_model.safetensors`, all seven projections,
ranks alternating 8 and 16, alpha 2r). The traffic is --requests requests at SGLang's geometry
(each its own 300-token query, 10 items of 10 tokens, 2 labels), run as one `score_batch`, the
adapters named round robin. Rows:

- `base, no adapters loaded`: the scorer without adapters (the decoder's plain path);
- `base, 16 loaded`: the scorer with the 16 adapters, every request the base (index 0: the
  low-rank product still runs, on zeros, which is what a base row costs beside adapters);
- `1 / 4 / 16 adapters`: requests round robin over the first k adapters.

Every row runs once untimed (compiling its shapes), then --repeats times on fresh token ids (so
the prefix cache never hits); the best is reported. Adapters never change the compiled shapes,
so the rows with adapters share their executables.

    python benchmarks/adapters.py                   # 16 requests, 3 repeats
    python benchmarks/adapters.py --requests 8 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import tempfile
import time

import numpy as np
from safetensors.numpy import save_file

from tpuscore import Scorer
from tpuscore.models.adapters import TARGET_PARAMS, projection_dims

QUERY_TOKENS, ITEMS, ITEM_TOKENS, LABELS = 300, 10, 10, [2, 3]
MODULE_PATH = {m: ("self_attn" if m[0] in "qkvo" else "mlp") for m in TARGET_PARAMS}


def write_adapter(path: pathlib.Path, config, rank: int, seed: int) -> pathlib.Path:
    """A random LoRA adapter on every projection of every layer, as peft saves one."""
    rng = np.random.default_rng(seed)
    dims = projection_dims(config)
    tensors = {}
    for layer in range(config.num_layers):
        for module, param in TARGET_PARAMS.items():
            d_in, d_out = dims[param]
            name = f"base_model.model.model.layers.{layer}.{MODULE_PATH[module]}.{module}"
            tensors[f"{name}.lora_A.weight"] = rng.normal(0, d_in**-0.5, (rank, d_in))
            tensors[f"{name}.lora_B.weight"] = rng.normal(0, 0.01, (d_out, rank))
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.astype(np.float32) for k, v in tensors.items()}, path / "adapter_model.safetensors"
    )
    config_json = {
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": list(TARGET_PARAMS), "task_type": "CAUSAL_LM",
    }  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config_json))
    return path


def traffic(rng, vocab: int, requests: int, adapters: list[str | None]) -> list[dict]:
    def ids(n):
        return rng.integers(100, vocab, n).tolist()

    return [
        {
            "query": ids(QUERY_TOKENS),
            "items": [ids(ITEM_TOKENS) for _ in range(ITEMS)],
            "label_token_ids": LABELS,
            "adapter": adapters[i % len(adapters)],
        }
        for i in range(requests)
    ]


def items_per_second(scorer, rng, requests: int, adapters, repeats: int, backend: str) -> float:
    vocab = scorer.config.vocab_size
    scorer.score_batch(traffic(rng, vocab, requests, adapters), backend=backend)  # compile
    best = float("inf")
    for _ in range(repeats):
        batch = traffic(rng, vocab, requests, adapters)
        start = time.perf_counter()
        scorer.score_batch(batch, backend=backend)
        best = min(best, time.perf_counter() - start)
    return requests * ITEMS / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    plain = Scorer.from_pretrained(None, dtype="float32")
    with tempfile.TemporaryDirectory() as tmp:
        paths = {
            f"lora{i}": write_adapter(
                pathlib.Path(tmp) / f"lora{i}", plain.config, (8, 16)[i % 2], i
            )
            for i in range(16)
        }
        loaded = Scorer.from_pretrained(None, dtype="float32", adapters=paths)
    names = loaded.adapters
    rows = [("base, no adapters loaded", plain, [None]), ("base, 16 loaded", loaded, [None])]
    rows += [(f"{k} adapter{'s' * (k > 1)}", loaded, names[:k]) for k in (1, 4, 16)]
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    cpu = next(
        (x.split(":", 1)[1].strip() for x in lines if "model name" in x), platform.processor()
    )
    print(
        f"{cpu}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; backend {args.backend}; "
        f"{args.requests} requests x {ITEMS} items, query {QUERY_TOKENS}, items {ITEM_TOKENS}"
    )
    base = None
    print("| traffic | items/s | vs base alone |\n| --- | ---: | ---: |")
    for label, scorer, adapters in rows:
        rate = items_per_second(scorer, rng, args.requests, adapters, args.repeats, args.backend)
        base = base or rate
        print(f"| {label} | {rate:.1f} | {rate / base:.2f} |", flush=True)
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
