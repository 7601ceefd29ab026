"""Atomic writes for a job's output: every file is written aside under a hidden name, flushed
to disk, then renamed into place (as Spark and Beam commit output files), so a crash leaves
either the old file or the whole new one.

The output is a directory of shards (`part-00000.parquet`, ...), one per `shard_rows` input
rows, readable as one table by pyarrow, pandas, Spark or Ray. Hidden names start with "." and
readers of a Parquet directory skip them.
"""

from __future__ import annotations

import os
import posixpath

import fsspec
import pyarrow as pa
from fsspec.implementations.local import LocalFileSystem

from tpuscore.jobs import fingerprints
from tpuscore.jobs.tables import table_bytes

SUFFIX = {"parquet": ".parquet", "jsonl": ".jsonl"}


def shard_name(index: int, fmt: str) -> str:
    return f"part-{index:05d}{SUFFIX[fmt]}"


def _aside(path: str) -> str:
    head, tail = posixpath.split(path)
    return posixpath.join(head, f".{tail}.{os.getpid()}.tmp")


def _durable(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Flush a local file to disk (fsync) before it is renamed; other filesystems store an
    object whole when it is closed."""
    if isinstance(fs, LocalFileSystem):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def commit(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write `data` to `path` atomically."""
    aside = _aside(path)
    with fs.open(aside, "wb") as f:
        f.write(data)
    _durable(fs, aside)
    fs.mv(aside, path)


def commit_table(
    fs: fsspec.AbstractFileSystem, path: str, table: pa.Table, fmt: str
) -> tuple[int, str]:
    """Write `table` to `path` atomically, as Parquet or JSON Lines; returns the file's size
    and sha256, for the manifest."""
    data = table_bytes(table, fmt)
    commit(fs, path, data)
    return len(data), fingerprints.of_bytes(data)


def verified(fs: fsspec.AbstractFileSystem, path: str, size: int, sha256: str) -> bool:
    """Whether `path` exists with this size and sha256."""
    try:
        return fs.size(path) == size and fingerprints.of_file(fs, path) == sha256
    except FileNotFoundError:
        return False


def intact_segments(
    fs: fsspec.AbstractFileSystem, path: str, segments: list[tuple[int, str]]
) -> int:
    """How many of the consecutive (length, sha256) segments at the start of `path` are
    there, in order, each with its sha256."""
    if not fs.exists(path):
        return _empty_prefix(segments)
    with fs.open(path, "rb") as f:
        for count, (length, sha256) in enumerate(segments):
            data = f.read(length)
            if len(data) != length or fingerprints.of_bytes(data) != sha256:
                return count
    return len(segments)


def _empty_prefix(segments: list[tuple[int, str]]) -> int:
    """The segments a missing file still holds: the leading empty ones."""
    count = 0
    while count < len(segments) and segments[count][0] == 0:
        count += 1
    return count


def clear_aside(fs: fsspec.AbstractFileSystem, directory: str) -> None:
    """Remove files a killed run left half-written in `directory`."""
    if fs.isdir(directory):
        for path in fs.ls(directory, detail=False):
            name = posixpath.basename(path)
            if name.startswith(".") and name.endswith(".tmp"):
                fs.rm(path)


def append(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> int:
    """Append `data` to `path` (made durable) and return the file's new length."""
    with fs.open(path, "ab") as f:
        f.write(data)
    _durable(fs, path)
    return fs.size(path)


def truncate(fs: fsspec.AbstractFileSystem, path: str, length: int) -> None:
    """Cut `path` back to its first `length` bytes: what a killed run appended after the last
    commit goes. Atomic (a rewrite aside); a missing file with length 0 is made empty."""
    if not fs.exists(path):
        if length:
            raise FileNotFoundError(f"{path} is missing, but the manifest records {length} bytes")
        commit(fs, path, b"")
        return
    if fs.size(path) != length:
        with fs.open(path, "rb") as f:
            data = f.read(length)
        if len(data) != length:
            raise ValueError(f"{path} is shorter than the {length} bytes the manifest records")
        commit(fs, path, data)
