"""A `tpuscore job` SIGKILLed at random moments, then run again, finishes with the output of an
uninterrupted run, row for row: nothing lost, nothing twice, the same scores."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from test_jobs import pairs_table

SHARD_ROWS = 12
SHARDS = 10
KILLS = 3


def _committed(manifest_path) -> int:
    try:
        with open(manifest_path) as f:
            return len(json.load(f)["shards"])
    except (OSError, ValueError):
        return 0


@pytest.mark.slow
def test_a_killed_job_run_again_equals_an_uninterrupted_one(checkpoint_dir, rng, tmp_path):
    table = pairs_table(rng, SHARDS * SHARD_ROWS, users=8).to_pydict()
    table["item_text"][int(rng.integers(0, SHARDS * SHARD_ROWS))] = None  # one bad row
    import pyarrow as pa

    pq.write_table(pa.table(table), tmp_path / "pairs.parquet")
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = {
        **os.environ,
        "PYTHONPATH": src,
        "TPUSCORE_COMPILATION_CACHE": str(tmp_path / "cache"),  # restarts load, not compile
    }

    def command(output):
        return [
            sys.executable, "-m", "tpuscore.cli", "job", str(tmp_path / "pairs.parquet"),
            "--output", str(output), "--model", str(checkpoint_dir("qwen3_qknorm")),
            "--dtype", "float32", "--labels", "a", "b", "--query-column", "user_text",
            "--item-column", "item_text", "--id-columns", "user_id,item_id",
            "--shard-rows", str(SHARD_ROWS), "--quiet",
        ]  # fmt: skip

    started = time.monotonic()
    subprocess.run(command(tmp_path / "whole"), env=env, check=True, timeout=600)
    whole_seconds = time.monotonic() - started

    output = tmp_path / "killed"
    manifest = f"{output}.manifest.json"
    killed_at = []

    def wait(seconds: float, limit: int) -> None:
        """Until a random moment `seconds` on, or sooner once `limit` shards are committed."""
        at = time.monotonic() + seconds
        while time.monotonic() < at and _committed(manifest) < limit:
            time.sleep(0.002)

    for kill in range(KILLS):
        process = subprocess.Popen(command(output), env=env)
        before = _committed(manifest)
        deadline = time.monotonic() + 300
        # The first kill lands anywhere in the run's first seconds (startup included); the
        # others once this process has committed a shard, the middle one at a random moment
        # after it, the last one at once. A warm process commits a shard every few tens of
        # milliseconds, so each kill before the last stops early enough to leave it shards.
        if kill == 0:
            wait(rng.uniform(0, min(whole_seconds, 5.0)), limit=SHARDS // 2)
        else:
            while _committed(manifest) == before and process.poll() is None:
                assert time.monotonic() < deadline, "no shard committed"
                time.sleep(0.002)
            if kill < KILLS - 1:
                wait(rng.uniform(0, 0.2), limit=SHARDS - 3)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
        killed_at.append(_committed(manifest))
    print(f"shards committed when killed: {killed_at} of {SHARDS}")
    assert 0 < killed_at[-1] < SHARDS, "the kills should land mid-job"
    subprocess.run(command(output), env=env, check=True, timeout=600)

    whole = pq.read_table(tmp_path / "whole").sort_by("row")
    resumed = pq.read_table(output).sort_by("row")
    assert resumed.num_rows == whole.num_rows == SHARDS * SHARD_ROWS - 1  # nothing lost or doubled
    for name in whole.column_names:
        a, b = whole.column(name).to_numpy(), resumed.column(name).to_numpy()
        if a.dtype.kind == "f":
            np.testing.assert_allclose(b, a, atol=1e-6, rtol=0, err_msg=name)
        else:
            np.testing.assert_array_equal(b, a, err_msg=name)
    errors = [Path(f"{o}.errors.jsonl").read_text() for o in (output, tmp_path / "whole")]
    assert errors[0] == errors[1] and len(errors[0].splitlines()) == 1
    assert sorted(os.listdir(output)) == sorted(os.listdir(tmp_path / "whole"))  # no leftovers
