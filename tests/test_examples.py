"""Every example runs to completion on the embedded default model, as a user would run it.

The five run at once, as subprocesses started by one module fixture: each spends most of its
time loading the model, so together they take about as long as the slowest, not the sum.
"""

import os
import pathlib
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.default_model

ROOT = pathlib.Path(__file__).resolve().parent.parent
TIMEOUT_S = 600  # generous: the machine running the suite may be busy; alone each takes < 1 min

# example -> lines its output must contain
EXPECTED = {
    "recommend.py": ["Page 1: 8 candidates", "Page 2: 8 candidates", "query from the prefix cache"],
    "rerank.py": ["(template 'plain')", "[1] Paris is the capital"],
    "classify.py": ["-> sports", "-> technology"],
    "multiple_choice.py": ["acc ", "honey", "predicted"],
    "serve_client.py": ["POST /v1/score", "usage:", "POST /v1/rerank (top_n 2)"],
}


def arguments(name: str) -> list[str]:
    """serve_client starts its own server where none answers: on a free port, not 8000."""
    if name != "serve_client.py":
        return []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return ["--url", f"http://127.0.0.1:{port}"]


@pytest.fixture(scope="module")
def runs(default_model_path, tmp_path_factory):
    """example name -> (return code, output), all started together."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *sys.path])}
    out_dir = tmp_path_factory.mktemp("examples")
    started = {}
    for name in EXPECTED:
        log = open(out_dir / f"{name}.log", "w+")  # noqa: SIM115 (closed below)
        process = subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / name), *arguments(name)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        started[name] = (process, log)
    finished = {}
    for name, (process, log) in started.items():
        try:
            code = process.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            code = "timeout"
        log.seek(0)
        finished[name] = (code, log.read())
        log.close()
    return finished


@pytest.mark.slow  # five subprocesses
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs(runs, name):
    code, output = runs[name]
    assert code == 0, output
    for line in EXPECTED[name]:
        assert line in output, output
