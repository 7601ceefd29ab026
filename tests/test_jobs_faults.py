"""Fault injection on `tpuscore job` processes: a job stopped mid-run while a second process is
started on the same output, SIGKILLs at random moments, a shard deleted and another cut short
(an input edited between runs is test_jobs_resume.py's, in process). Each ends in a clear
refusal (exit status 2 and what was wrong) or in a complete table equal to an uninterrupted
run's: never a silent mix."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from test_jobs import CASE, pairs_table
from tpuscore.jobs import load_scorer, score_table

SHARD_ROWS = 8
SHARDS = 16


def _committed(manifest_path) -> int:
    try:
        with open(manifest_path) as f:
            return len(json.load(f)["shards"])
    except (OSError, ValueError, KeyError):
        return 0


def _until(condition, process, limit=300.0):
    """Poll `condition` (a file written by the job) until true; fail if the job exits first."""
    deadline = time.monotonic() + limit
    while not condition():
        assert process.poll() is None, "the job ended before the event"
        assert time.monotonic() < deadline, "no event"
        time.sleep(0.005)


def _same_table(got: pa.Table, want: pa.Table) -> None:
    assert got.column_names == want.column_names
    assert got.column("row").to_pylist() == want.column("row").to_pylist()  # none lost, none twice
    for name in want.column_names:
        a, b = want.column(name).to_numpy(), got.column(name).to_numpy()
        if a.dtype.kind == "f":
            np.testing.assert_allclose(b, a, atol=1e-6, rtol=0, err_msg=name)
        else:
            np.testing.assert_array_equal(b, a, err_msg=name)


@pytest.mark.slow  # five `tpuscore job` processes; in process: test_jobs_resume.py, _lock.py
def test_faults_end_in_a_refusal_or_the_uninterrupted_table(checkpoint_dir, rng, tmp_path):
    table = pairs_table(rng, SHARDS * SHARD_ROWS, users=5).to_pydict()
    table["item_text"][int(rng.integers(0, SHARDS * SHARD_ROWS))] = None  # one bad row
    source = tmp_path / "pairs.parquet"
    pq.write_table(pa.table(table), source)
    settings = dict(
        query_column="user_text", item_column="item_text", id_columns=["user_id", "item_id"],
        labels=["a", "b"], shard_rows=SHARD_ROWS,
    )  # fmt: skip
    score_table(source, tmp_path / "whole", scorer=load_scorer(checkpoint_dir(CASE)), **settings)
    whole = pq.read_table(tmp_path / "whole").sort_by("row")
    whole_errors = Path(f"{tmp_path / 'whole'}.errors.jsonl").read_text()

    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = {**os.environ, "PYTHONPATH": src, "TPUSCORE_COMPILATION_CACHE": str(tmp_path / "cc")}
    output = tmp_path / "out"
    manifest = f"{output}.manifest.json"
    command = [
        sys.executable, "-m", "tpuscore.cli", "job", str(source), "--output", str(output),
        "--model", str(checkpoint_dir(CASE)), "--labels", "a", "b", "--query-column",
        "user_text", "--item-column", "item_text", "--id-columns", "user_id,item_id",
        "--shard-rows", str(SHARD_ROWS), "--quiet",
    ]  # fmt: skip

    def start():
        return subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)

    def refused(needle):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 2, done.stderr[-2000:]
        assert needle in done.stderr, done.stderr[-2000:]

    # 1. A job stopped after its first commit, still holding the output: a second process on
    # the same output is refused, naming the holder; then the stopped job is SIGKILLed.
    first = start()
    _until(lambda: _committed(manifest) >= 1, first)
    first.send_signal(signal.SIGSTOP)
    refused(f"being written by another job (pid {first.pid}")
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=60)
    assert Path(f"{output}.lock").exists()  # left behind, naming a dead pid

    # 2. SIGKILLs at random moments of a shard's work, each run taking the dead one's lock over.
    # The moment is a random share of the shard time this run just showed (a fixed delay let a
    # fast machine commit every shard before the kill).
    for _ in range(2):
        job = start()
        before = _committed(manifest)
        _until(lambda before=before: _committed(manifest) > before, job)
        shard_start = time.monotonic()
        _until(lambda before=before: _committed(manifest) > before + 1, job)
        time.sleep(rng.uniform(0, 1) * (time.monotonic() - shard_start))
        job.send_signal(signal.SIGKILL)
        job.wait(timeout=60)
    killed_at = _committed(manifest)
    assert 3 <= killed_at < SHARDS, f"the kills should land mid-job ({killed_at} of {SHARDS})"

    # 3. A committed shard deleted and another cut short; the next run scores them again and
    # finishes the job: the table complete, equal to the uninterrupted run's.
    committed = sorted(Path(output).glob("part-*"))[:killed_at]
    deleted, cut = rng.choice(len(committed), size=2, replace=False)
    committed[deleted].unlink()
    size = committed[cut].stat().st_size
    committed[cut].write_bytes(committed[cut].read_bytes()[: int(rng.integers(1, size))])
    assert subprocess.run(command, env=env, timeout=600).returncode == 0
    _same_table(pq.read_table(output).sort_by("row"), whole)
    assert Path(f"{output}.errors.jsonl").read_text() == whole_errors
    assert sorted(os.listdir(output)) == sorted(os.listdir(tmp_path / "whole"))
    assert not Path(f"{output}.lock").exists()
