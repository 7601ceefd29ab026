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

from tpuscore.jobs.tables import write_table

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


def commit_table(fs: fsspec.AbstractFileSystem, path: str, table: pa.Table, fmt: str) -> None:
    """Write `table` to `path` atomically, as Parquet or JSON Lines."""
    aside = _aside(path)
    write_table(table, fs, aside, fmt)
    _durable(fs, aside)
    fs.mv(aside, path)


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
