"""A job's output as a set of files with one commit protocol: the shard directory, the manifest
and the errors file beside it.

Opening an output to resume verifies what the manifest records before trusting it: the settings
and fingerprints (`fingerprints`), every committed shard (present, its size and sha256) and the
errors file (each shard's lines, by length and sha256). A missing or damaged shard is scored
again (`redo`); from the first damaged stretch of the errors file on, the shards are forgotten
and scored again, since their errors cannot be told apart.
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

import attrs
import fsspec
import pyarrow as pa

from tpuscore.jobs import fingerprints, shards
from tpuscore.jobs import manifest as manifests
from tpuscore.jobs.spec import JobConfigError, RowError


class ResumeRefused(JobConfigError):
    """An output written by a job with another input, model or settings: resuming it would mix
    two jobs' rows. `changed` holds (what, recorded value, this run's value) per difference."""

    def __init__(self, output: str, changed: list[tuple[str, Any, Any]]):
        said = "; ".join(f"{what}: {_cut(old)} -> {_cut(new)}" for what, old, new in changed[:6])
        more = f" (and {len(changed) - 6} more)" if len(changed) > 6 else ""
        super().__init__(
            "output_mismatch",
            f"{output} holds a job run on another input, model, score calibration or settings "
            f"({said}{more}); "
            "re-run with the same ones to resume, or pass overwrite to start again",
            "output",
        )
        self.changed = changed


def _cut(value: Any, limit: int = 80) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def paths(output: str) -> tuple[str, str, str]:
    """(shard directory, manifest, errors file) of an output path."""
    output = output.rstrip("/")
    return output, f"{output}.manifest.json", f"{output}.errors.jsonl"


@attrs.define
class Output:
    """An opened output: its files, the manifest to go on from, and the committed shards that
    must be scored again (`redo`: missing or damaged)."""

    fs: fsspec.AbstractFileSystem
    name: str  # as the caller gave it, for messages
    directory: str
    manifest_path: str
    errors_path: str
    format: str
    manifest: manifests.Manifest
    redo: set[int]

    @classmethod
    def open(
        cls,
        fs: fsspec.AbstractFileSystem,
        path: str,
        name: str,
        fmt: str,
        settings: dict[str, Any],
        overwrite: bool,
    ) -> Output:
        """The output at `path`, new (or emptied, with overwrite) or verified for a resume."""
        directory, manifest_path, errors_path = paths(path)
        existing = None if overwrite else _load(fs, manifest_path)
        if overwrite:
            for p in (directory, manifest_path, errors_path):
                if fs.exists(p):
                    fs.rm(p, recursive=True)
        if existing is None:
            if fs.exists(directory) and (not fs.isdir(directory) or fs.ls(directory)):
                raise JobConfigError(
                    "output_exists",
                    f"{name} exists and is not a tpuscore job's output (no {manifest_path}); "
                    "remove it, name another output, or pass overwrite",
                    "output",
                )
            fs.makedirs(directory, exist_ok=True)
            manifest = manifests.Manifest(settings)
            shards.truncate(fs, errors_path, 0)
            manifests.save(fs, manifest_path, manifest)
            return cls(fs, name, directory, manifest_path, errors_path, fmt, manifest, set())
        if existing.settings != settings:
            raise ResumeRefused(name, fingerprints.differences(existing.settings, settings))
        output = cls(fs, name, directory, manifest_path, errors_path, fmt, existing, set())
        output._verify()
        return output

    def _verify(self) -> None:
        """Check every committed shard and the errors file against the manifest; remove what a
        killed run left after its last commit."""
        fs, records = self.fs, self.manifest.shards
        segments, start = [], 0
        for record in records:
            segments.append((record.errors_bytes - start, record.errors_sha256))
            start = record.errors_bytes
        intact = shards.intact_segments(fs, self.errors_path, segments)
        if intact < len(records):  # the errors of these shards are lost: score them again
            self.manifest = attrs.evolve(self.manifest, shards=records[:intact], complete=False)
            manifests.save(fs, self.manifest_path, self.manifest)
        fs.makedirs(self.directory, exist_ok=True)
        shards.clear_aside(fs, self.directory)
        committed = {r.file for r in self.manifest.shards}
        for p in fs.ls(self.directory, detail=False):
            if posixpath.basename(p).startswith("part-") and posixpath.basename(p) not in committed:
                fs.rm(p)
        shards.truncate(fs, self.errors_path, self.manifest.errors_bytes)
        self.redo = {
            i
            for i, r in enumerate(self.manifest.shards)
            if not shards.verified(fs, posixpath.join(self.directory, r.file), r.bytes, r.sha256)
        }
        if self.redo:
            self.manifest = attrs.evolve(self.manifest, complete=False)

    @property
    def kept_rows(self) -> int:
        """Input rows committed by earlier runs and verified."""
        return sum(r.rows for i, r in enumerate(self.manifest.shards) if i not in self.redo)

    def wanted(self, index: int) -> bool:
        """Whether shard `index` is to be scored by this run."""
        return index in self.redo or index >= len(self.manifest.shards)

    def commit(
        self, index: int, first_row: int, rows: int, table: pa.Table, errors: list[RowError]
    ) -> None:
        """Write shard `index` (input rows [first_row, first_row + rows); `table` the rows that
        scored, `errors` those that did not) and commit it in the manifest."""
        name = shards.shard_name(index, self.format)
        size, sha256 = shards.commit_table(
            self.fs, posixpath.join(self.directory, name), table, self.format
        )
        if index in self.redo:  # its errors are in the errors file, verified
            record = attrs.evolve(
                self.manifest.shards[index], written=table.num_rows, bytes=size, sha256=sha256
            )
            self.redo.discard(index)
        else:
            lines = "".join(
                json.dumps(e.to_json(), ensure_ascii=False) + "\n" for e in errors
            ).encode()
            errors_bytes = self.manifest.errors_bytes
            if lines:
                errors_bytes = shards.append(self.fs, self.errors_path, lines)
            record = manifests.ShardRecord(
                name, first_row, rows, table.num_rows, size, sha256, len(errors), errors_bytes,
                fingerprints.of_bytes(lines),
            )  # fmt: skip
        self.manifest = self.manifest.committed(record)
        manifests.save(self.fs, self.manifest_path, self.manifest)  # the commit point

    def finish(self) -> None:
        self.manifest = attrs.evolve(self.manifest, complete=True)
        manifests.save(self.fs, self.manifest_path, self.manifest)


def _load(fs: fsspec.AbstractFileSystem, path: str) -> manifests.Manifest | None:
    try:
        return manifests.load(fs, path)
    except (ValueError, KeyError, TypeError) as e:
        raise JobConfigError(
            "manifest_unreadable",
            f"{path} cannot be read as a tpuscore job's manifest ({e}); pass overwrite to "
            "start the job again",
            "output",
        ) from None
