"""A job's manifest: which shards are committed, so a re-run resumes after the last of them.

It sits beside the output as `<output>.manifest.json` and is replaced atomically (written aside,
then renamed) after each shard; that rename is the shard's commit point. It also holds the job's
settings, so a re-run with other settings is refused instead of mixing two jobs' rows.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import fsspec

from tpuscore.jobs.shards import commit

FORMAT = "tpuscore-job/2"


@attrs.frozen
class ShardRecord:
    """A committed shard: its file (in the output directory) with its size and sha256, its
    input rows [first_row, first_row + rows), the rows written (rows less the errors), and its
    errors: their count, the errors file's length once they were appended and the sha256 of the
    lines they added (a resume verifies both files against these)."""

    file: str
    first_row: int
    rows: int
    written: int
    bytes: int
    sha256: str
    errors: int
    errors_bytes: int
    errors_sha256: str


@attrs.frozen
class Manifest:
    """settings: what the job was run with (compared on resume). complete: every input row is
    in a committed shard."""

    settings: dict[str, Any]
    shards: tuple[ShardRecord, ...] = ()
    complete: bool = False

    @property
    def next_row(self) -> int:
        """The first input row no committed shard holds."""
        return self.shards[-1].first_row + self.shards[-1].rows if self.shards else 0

    @property
    def errors_bytes(self) -> int:
        return self.shards[-1].errors_bytes if self.shards else 0

    def committed(self, shard: ShardRecord) -> Manifest:
        """With `shard` added after the others, or in place of the record of its file."""
        shards = list(self.shards)
        for i, old in enumerate(shards):
            if old.file == shard.file:
                shards[i] = shard
                return attrs.evolve(self, shards=tuple(shards))
        return attrs.evolve(self, shards=(*shards, shard))

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "settings": self.settings,
            "complete": self.complete,
            "shards": [attrs.asdict(s) for s in self.shards],
        }

    @classmethod
    def from_json(cls, value: Any) -> Manifest:
        if not isinstance(value, dict) or value.get("format") != FORMAT:
            found = (
                f"format {value.get('format')!r}"
                if isinstance(value, dict)
                else f"a JSON {type(value).__name__}"
            )
            raise ValueError(f"not a {FORMAT} manifest ({found})")
        shards = tuple(ShardRecord(**s) for s in value["shards"])
        return cls(value["settings"], shards, bool(value["complete"]))


def load(fs: fsspec.AbstractFileSystem, path: str) -> Manifest | None:
    """The manifest at `path`, or None if there is none."""
    if not fs.exists(path):
        return None
    with fs.open(path, "rb") as f:
        return Manifest.from_json(json.loads(f.read()))


def save(fs: fsspec.AbstractFileSystem, path: str, manifest: Manifest) -> None:
    """Replace the manifest at `path` atomically: a reader (or a re-run after a crash) sees the
    old one or the new one, never a mix."""
    commit(fs, path, json.dumps(manifest.to_json(), indent=1).encode())
