"""lm-evaluation-harness, multiple choice, on the embedded default model: the harness's `hf`
model against "tpuscore", in one run on one machine.

The task is tests/data/lm_eval/tpuscore_mc.yaml's (the test's task) at a realistic size:
`--questions` arithmetic questions (default 300) with four numeric choices each, generated from
`--seed`, asked with `--fewshot` solved examples before each (default 5, drawn from a separate
set of 50), so every context is about 150 tokens and its four continuations 1-3 tokens. Both
models load the same SmolLM2-135M-Instruct Q4_1 GGUF (transformers dequantizes it through
`gguf_file=`), in the same dtype.

Timed: `simple_evaluate` on an already loaded model, from task building to metrics. tpuscore's
time includes its XLA compilations (a harness run compiles every shape it meets once); the
`hf` model runs eagerly with `--hf-batch-size` (default 16; the harness's own default is 1).

    python benchmarks/lm_eval_mc.py                 # 300 questions, float32
    python benchmarks/lm_eval_mc.py --questions 40  # a smoke run
    python benchmarks/lm_eval_mc.py --tpuscore-dtype mixed  # tpuscore mixed, hf float32
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pathlib
import random
import sys
import tempfile
import time

import jax
import lm_eval
import yaml
from bench import cpu_model
from lm_eval.tasks import TaskManager

import tpuscore.integrations.lm_eval  # noqa: F401  registers "tpuscore"
from tpuscore.models.loaders.default import default_model_path

ROOT = pathlib.Path(__file__).resolve().parents[1]
TASK_FILE = ROOT / "tests/data/lm_eval/tpuscore_mc.yaml"
TASK = "tpuscore_mc_bench"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=300)
    parser.add_argument("--fewshot", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    # tpuscore's precisions beyond the two both models have (docs/runtime.md#precision)
    parser.add_argument(
        "--tpuscore-dtype", choices=["float32", "bfloat16", "mixed", "int8"],
        help="tpuscore's dtype (default --dtype's); hf runs in --dtype",
    )  # fmt: skip
    parser.add_argument("--hf-batch-size", type=int, default=16)
    return parser.parse_args(argv)


def question(rng: random.Random) -> dict:
    """One question: a sum or a difference of two numbers, the answer among three near misses
    at a random position."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    op, value = rng.choice([("+", a + b), ("-", a - b)])
    wrong = rng.sample([d for d in range(-12, 13) if d != 0], 3)
    choices = [str(value + d) for d in [0, *wrong]]
    rng.shuffle(choices)
    return {
        "question": f"What is {a} {op} {b}?",
        "choices": choices,
        "answer": choices.index(str(value)),
    }


def write_task(folder: pathlib.Path, args: argparse.Namespace) -> None:
    """The test's task under another name, with generated test and few-shot sets."""
    rng = random.Random(args.seed)
    splits = {"test": args.questions, "train": 50}
    config = yaml.safe_load(TASK_FILE.read_text())
    config["task"] = TASK
    config["dataset_kwargs"]["data_files"] = {}
    for split, count in splits.items():
        path = folder / f"{split}.jsonl"
        path.write_text("".join(json.dumps(question(rng)) + "\n" for _ in range(count)))
        config["dataset_kwargs"]["data_files"][split] = str(path)
    config["training_split"] = "train"
    config["num_fewshot"] = args.fewshot
    (folder / f"{TASK}.yaml").write_text(yaml.safe_dump(config))


def load(model: str, args: argparse.Namespace):
    path = default_model_path()
    model_args = {
        "hf": f"pretrained=$MODEL_DIR,gguf_file={path.name},dtype={args.dtype},"
        f"batch_size={args.hf_batch_size},device=cpu",
        "tpuscore": f"dtype={args.tpuscore_dtype or args.dtype}",
    }[model]
    start = time.perf_counter()
    real_args = model_args.replace("$MODEL_DIR", str(path.parent))
    lm = lm_eval.api.registry.get_model(model).create_from_arg_string(real_args)
    return lm, model_args, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    versions = {p: importlib.metadata.version(p) for p in ("jax", "torch", "lm_eval", "tpuscore")}
    print("# lm-evaluation-harness multiple choice: hf against tpuscore\n")
    print(f"- command: `python {' '.join(sys.argv)}`")
    print(f"- machine: {cpu_model()}, {os.cpu_count()} cores, jax devices {jax.devices()}")
    print(f"- versions: {', '.join(f'{k} {v}' for k, v in versions.items())}")
    model = default_model_path()
    dtypes = f"dtype {args.dtype}" + (
        f" (tpuscore {args.tpuscore_dtype})" if args.tpuscore_dtype else ""
    )
    print(f"- model: $MODEL_DIR/{model.name}, {dtypes}; $MODEL_DIR is {model.parent}")
    print(f"- load average at start: {os.getloadavg()[0]:.2f} (other work skews timings)\n")
    with tempfile.TemporaryDirectory() as folder:
        write_task(pathlib.Path(folder), args)
        manager = TaskManager(include_path=folder)
        runs = {}
        for model in ("hf", "tpuscore"):
            lm, model_args, load_s = load(model, args)
            start = time.perf_counter()
            out = lm_eval.simple_evaluate(
                model=lm, tasks=[TASK], task_manager=manager, log_samples=True, random_seed=0
            )
            runs[model] = (out, model_args, load_s, time.perf_counter() - start)
            del lm
    responses = {
        m: [r for doc in out["samples"][TASK] for r in doc["filtered_resps"]]
        for m, (out, *_) in runs.items()
    }
    n = len(responses["hf"])
    contexts = len({doc["arguments"][0][0] for doc in runs["hf"][0]["samples"][TASK]})
    print(
        f"{args.questions} questions x 4 choices = {n} loglikelihood requests, {contexts} contexts"
    )
    print(f"({args.fewshot}-shot), load average at end: {os.getloadavg()[0]:.2f}\n")
    print("| model | model_args | load s | evaluate s | requests/s | acc | acc_norm |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for model, (out, model_args, load_s, seconds) in runs.items():
        result = out["results"][TASK]
        print(
            f"| {model} | `{model_args}` | {load_s:.1f} | {seconds:.1f} | {n / seconds:.1f} | "
            f"{result['acc,none']:.4f} | {result['acc_norm,none']:.4f} |"
        )
    diffs = [abs(a[0] - b[0]) for a, b in zip(responses["hf"], responses["tpuscore"], strict=True)]
    greedy = sum(a[1] == b[1] for a, b in zip(responses["hf"], responses["tpuscore"], strict=True))
    speedup = runs["hf"][3] / runs["tpuscore"][3]
    print(f"\ntpuscore / hf speed: {speedup:.2f}x; per-request |logprob difference|: ")
    print(f"max {max(diffs):.2e}, mean {sum(diffs) / n:.2e}; is_greedy agrees on {greedy}/{n}")


if __name__ == "__main__":
    main()
