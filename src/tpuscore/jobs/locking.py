"""One writer per output: `<output>.lock` names its holder (pid, host, start time) while a job
writes the output; a second job on the same output is refused with `OutputLocked`.

On a local (or NFS) filesystem the lock is the kernel's (`flock` on the lock file): it is
released when its process ends, however it ends, so a lock file a killed job left (a dead pid)
is simply taken over, and two jobs can never both take it. On other fsspec filesystems (object
stores, `memory://`) there is no such primitive: the lock is advisory (the file is checked, then
written and read back), and a lock left by a dead process on the same host is taken over.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from tpuscore.api.processes import pid_alive
from tpuscore.jobs.spec import JobConfigError

log = logging.getLogger(__name__)


class OutputLocked(JobConfigError):
    """Another job holds the output; `holder` is what its lock file says (pid, host, start)."""

    def __init__(self, output: str, lock_path: str, holder: dict[str, Any] | None):
        who = (
            f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"
            if holder
            else "a job whose lock file cannot be read yet"
        )
        super().__init__(
            "output_locked",
            f"{output} is being written by another job ({who}; lock {lock_path}); wait for it "
            "to finish or stop it, or name another output",
            "output",
        )
        self.holder = holder


def holder_record() -> dict[str, Any]:
    """What a lock file says about its holder."""
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "token": uuid.uuid4().hex,
    }


@contextlib.contextmanager
def hold(fs: fsspec.AbstractFileSystem, lock_path: str, output: str) -> Iterator[dict]:
    """Hold the output's lock for the `with` block; raises `OutputLocked` if another job does."""
    if isinstance(fs, LocalFileSystem):
        with _hold_local(lock_path, output) as holder:
            yield holder
    else:
        with _hold_advisory(fs, lock_path, output) as holder:
            yield holder


@contextlib.contextmanager
def _hold_local(path: str, output: str) -> Iterator[dict]:
    import fcntl

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)  # an output not made yet
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputLocked(output, path, _read_local(path)) from None
        try:  # the holder before us may have removed the file after we opened it
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        previous = _parse(os.read(fd, 1 << 16))
        if previous:
            log.warning("taking over %s from pid %s, which no longer holds it", path,
                        previous.get("pid"))  # fmt: skip
        holder = holder_record()
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        os.fsync(fd)
        yield holder
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # while still held: the next job makes a fresh file
        os.close(fd)


def _read_local(path: str) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            return _parse(f.read(1 << 16))
    except FileNotFoundError:
        return None


def _parse(data: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


@contextlib.contextmanager
def _hold_advisory(fs: fsspec.AbstractFileSystem, path: str, output: str) -> Iterator[dict]:
    if fs.exists(path):
        previous = _parse(fs.cat_file(path))
        stale = (
            previous is not None
            and previous.get("host") == socket.gethostname()
            and not pid_alive(previous.get("pid"))
        )
        if not stale:
            raise OutputLocked(output, path, previous)
        log.warning("taking over %s from pid %s, which has ended", path, previous.get("pid"))
    holder = holder_record()
    fs.pipe_file(path, json.dumps(holder).encode())
    if _parse(fs.cat_file(path)) != holder:  # another job wrote it between our check and write
        raise OutputLocked(output, path, _parse(fs.cat_file(path)))
    try:
        yield holder
    finally:
        with contextlib.suppress(FileNotFoundError):
            if _parse(fs.cat_file(path)) == holder:
                fs.rm(path)
