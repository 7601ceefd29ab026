"""One writer per output: a job on an output another process is writing is refused with
`OutputLocked`, which names the holder; a lock left by a process that has ended (SIGKILL) is
taken over; on filesystems without kernel locks (memory://) the lock is advisory, and works the
same within these cases."""

import os
import signal
import socket
import subprocess
import sys

import fsspec
import pyarrow.parquet as pq
import pytest

from test_jobs import CASE, LABELS, pairs_table, read
from tpuscore.jobs import OutputLocked, load_scorer, locking, score_table

KWARGS = dict(query_column="user_text", item_column="item_text", labels=LABELS, shard_rows=4)
HOLDER = """
import sys
from fsspec.implementations.local import LocalFileSystem
from tpuscore.jobs.locking import hold
with hold(LocalFileSystem(), sys.argv[1], "out"):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes it, or kills this process
"""


@pytest.fixture(scope="module")
def scorer(checkpoint_dir):
    return load_scorer(checkpoint_dir(CASE), dtype="float32")


@pytest.mark.slow  # a subprocess imports tpuscore
def test_a_second_process_is_refused_and_a_killed_holder_is_taken_over(scorer, rng, tmp_path):
    pq.write_table(pairs_table(rng, 6), tmp_path / "pairs.parquet")
    output = tmp_path / "out"
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, f"{output}.lock"], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": src},
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(OutputLocked) as refused:
            score_table(tmp_path / "pairs.parquet", output, scorer=scorer, **KWARGS)
        assert refused.value.code == "output_locked"
        assert refused.value.holder["pid"] == holder.pid
        assert refused.value.holder["host"] == socket.gethostname()
        assert f"pid {holder.pid}" in str(refused.value)
        assert not os.path.exists(f"{output}.manifest.json")  # nothing touched
        with pytest.raises(OutputLocked):  # overwrite does not break a lock either
            score_table(tmp_path / "pairs.parquet", output, scorer=scorer, overwrite=True, **KWARGS)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    assert os.path.exists(f"{output}.lock")  # left by the killed holder, naming a dead pid
    summary = score_table(tmp_path / "pairs.parquet", output, scorer=scorer, **KWARGS)
    assert summary.rows == 6 and read(output).num_rows == 6
    assert not os.path.exists(f"{output}.lock")  # released at the end


def test_the_lock_is_held_within_one_process_too(scorer, rng, tmp_path):
    from fsspec.implementations.local import LocalFileSystem

    pq.write_table(pairs_table(rng, 4), tmp_path / "pairs.parquet")
    output = tmp_path / "out"
    with (
        locking.hold(LocalFileSystem(), f"{output}.lock", str(output)) as holder,
        pytest.raises(OutputLocked) as refused,
    ):
        score_table(tmp_path / "pairs.parquet", output, scorer=scorer, **KWARGS)
    assert refused.value.holder == holder


def test_an_advisory_lock_on_a_store_refuses_a_live_holder_and_takes_a_dead_ones(scorer, rng):
    import json

    fs = fsspec.filesystem("memory")
    with fs.open("/locks/pairs.parquet", "wb") as f:
        pq.write_table(pairs_table(rng, 4), f)

    def run():
        return score_table(
            "memory://locks/pairs.parquet", "memory://locks/out", scorer=scorer, **KWARGS
        )

    with locking.hold(fs, "/locks/out.lock", "out"), pytest.raises(OutputLocked):
        run()
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    dead = {"pid": int(ended.stdout), "host": socket.gethostname(), "started": "then"}
    fs.pipe_file("/locks/out.lock", json.dumps(dead).encode())
    assert run().rows == 4 and not fs.exists("/locks/out.lock")
    fs.pipe_file("/locks/out.lock", json.dumps({**dead, "host": "elsewhere"}).encode())
    with pytest.raises(OutputLocked, match="elsewhere"):  # another host's pid: cannot tell
        run()


def test_an_output_in_a_directory_not_made_yet_is_written(scorer, rng, tmp_path):
    """The lock file goes beside the output, so its directory is made first, as the output's
    is (not a FileNotFoundError from the lock)."""
    pq.write_table(pairs_table(rng, 4), tmp_path / "pairs.parquet")
    output = tmp_path / "nightly" / "2026-11-27" / "scores"
    summary = score_table(tmp_path / "pairs.parquet", output, scorer=scorer, **KWARGS)
    assert summary.rows == 4 and read(output).num_rows == 4
    assert not os.path.exists(f"{output}.lock")
