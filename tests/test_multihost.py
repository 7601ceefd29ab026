"""Two JAX processes on 127.0.0.1 (2 CPU devices each, gloo collectives) run
examples/multihost.py over one 2x2 mesh: data split between the processes, weights between each
process's devices. Both must return the scores a single unsharded process computes."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tpuscore import Scorer

EXAMPLE = Path(__file__).parent.parent / "examples" / "multihost.py"
BACKENDS = ["prefill_extend", "packed_dense", "packed_segment"]
LABELS = [" a", " the", "e"]  # single tokens of the tests' tokenizer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # a subprocess
def test_two_processes_score_as_one(checkpoint_dir, tmp_path):
    model = checkpoint_dir("llama_gqa_untied")  # 2 kv heads, MLP width 58: 2 divides both
    coordinator = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    command = [sys.executable, str(EXAMPLE), "--coordinator", coordinator, "--num-processes", "2",
               "--cpu-devices", "2", "--model-axis", "2", "--model", str(model), "--timeout", "240",
               "--labels", *LABELS]  # fmt: skip
    command += [arg for backend in BACKENDS for arg in ("--backend", backend)]
    processes = [
        subprocess.Popen(
            [*command, "--process-id", str(i), "--out", str(tmp_path / f"{i}.json")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        logs = [p.communicate(timeout=300)[0] for p in processes]
    finally:
        for p in processes:
            p.kill()
    for p, log in zip(processes, logs, strict=True):
        assert p.returncode == 0, log[-4000:]

    sys.path.insert(0, str(EXAMPLE.parent))
    from multihost import REQUESTS

    single = Scorer.from_pretrained(model, dtype="float32")
    for i in range(2):
        scores = json.loads((tmp_path / f"{i}.json").read_text())["scores"]
        assert len(scores) == len(BACKENDS)
        requests = [request | {"labels": LABELS} for request in REQUESTS]
        for step, backend in enumerate(BACKENDS):
            want = single.score_batch(requests, backend=backend)
            for got, expected in zip(scores[step], want, strict=True):
                np.testing.assert_allclose(got, expected.logprobs, atol=1e-5, rtol=0)
