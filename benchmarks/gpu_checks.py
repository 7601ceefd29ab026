"""Checks that need an accelerator and the test suite's references, in one process for the
device tool's short leases: LoRA adapters mixed in one batch on every backend (packed_segment
on its Triton kernel) against transformers + peft, and the precisions a GPU is offered.

    python benchmarks/gpu_checks.py            # on a GPU host (runs on CPU too, slowly)

Builds test_lora_scorer.py's tiny random base and its three peft adapters (tests/
lora_reference.py), scores one `score_batch` mixing them and the base on each backend in
float32, and prints each backend's largest difference from peft (unmerged and merged); then
scores a request in each precision and prints its difference from float32, or the error that
refuses it.
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

import jax
import numpy as np

TESTS = pathlib.Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))

from hf_reference import MODEL_VOCAB_SIZE, hf_logprobs, make_checkpoint  # noqa: E402
from lora_reference import ADAPTERS, peft_logprobs, save_adapter  # noqa: E402
from tpuscore import Scorer  # noqa: E402
from tpuscore.models.model import PRECISIONS  # noqa: E402

BACKENDS = ["prefill_extend", "serial", "packed_dense", "packed_segment"]


def adapters(root: pathlib.Path) -> None:
    base = make_checkpoint(root / "base", "llama_gqa_untied", seed=3)
    paths = {
        name: save_adapter(base, root / name, seed=10 + i, **kwargs)
        for i, (name, kwargs) in enumerate(ADAPTERS.items())
    }
    scorer = Scorer.from_pretrained(base, dtype="float32", adapters=paths)
    rng = np.random.default_rng(0)
    labels = rng.choice(MODEL_VOCAB_SIZE, size=3, replace=False).tolist()
    shared = rng.integers(0, MODEL_VOCAB_SIZE, 23).tolist()
    requests = []
    for adapter in [None, *paths, *paths]:
        query = shared if len(requests) <= len(paths) else rng.integers(0, MODEL_VOCAB_SIZE, 17)
        items = [rng.integers(0, MODEL_VOCAB_SIZE, int(rng.integers(3, 9))).tolist()]
        items += [rng.integers(0, MODEL_VOCAB_SIZE, 5).tolist() for _ in range(2)]
        requests.append(
            {"query": list(map(int, query)), "items": items, "label_token_ids": labels}
            | {"adapter": adapter}
        )
    expected = []
    for request in requests:
        seqs = [request["query"] + item for item in request["items"]]
        name = request["adapter"]
        if name is None:
            want = hf_logprobs(base, seqs, labels)
            expected.append((want, want))
        else:
            expected.append(
                tuple(peft_logprobs(base, paths[name], seqs, labels, merged) for merged in (0, 1))
            )
    print("| backend | max diff vs peft | vs peft merged |")
    print("| --- | ---: | ---: |")
    for backend in BACKENDS:
        results = scorer.score_batch(requests, backend=backend)
        pairs = list(zip(results, expected, strict=True))
        diffs = [
            max(float(np.abs(np.asarray(r.logprobs) - e[k]).max()) for r, e in pairs)
            for k in (0, 1)
        ]
        print(f"| {backend} | {diffs[0]:.2e} | {diffs[1]:.2e} |")
    return base


def precisions(base: pathlib.Path) -> None:
    rng = np.random.default_rng(1)
    query = rng.integers(0, MODEL_VOCAB_SIZE, 40).tolist()
    items = rng.integers(0, MODEL_VOCAB_SIZE, (6, 7)).tolist()
    reference = None
    print("\n| precision | max |logprob - float32's| |")
    print("| --- | --- |")
    for precision in PRECISIONS:
        try:
            scorer = Scorer.from_pretrained(base, dtype=precision)
            got = np.asarray(scorer.score(query, items, [5, 9]).logprobs)
        except Exception as e:  # the refusal is the result
            print(f"| {precision} | refused: {type(e).__name__}: {str(e)[:150]} |")
            continue
        reference = got if reference is None else reference
        print(f"| {precision} | {float(np.abs(got - reference).max()):.2e} |")


def main() -> None:
    print(f"jax {jax.__version__}, devices {jax.devices()}\n")
    with tempfile.TemporaryDirectory() as root:
        base = adapters(pathlib.Path(root))
        precisions(base)


if __name__ == "__main__":
    main()
