"""A job's output schema in its manifest, and the output and errors file read back with it:
`read_output` and `read_errors` give every id column the Arrow type it had in the input, from
Parquet or from the JSON the errors file and a JSON Lines output hold (`values`)."""

from __future__ import annotations

import base64
import json
import os
import posixpath

import pyarrow as pa

from tpuscore.jobs import fingerprints, values
from tpuscore.jobs import manifest as manifests
from tpuscore.jobs.output import paths
from tpuscore.jobs.tables import TableError, filesystem

ERROR_FIELDS = [
    pa.field("code", pa.string()),
    pa.field("message", pa.string()),
    pa.field("param", pa.string()),
]


def encode(schema: pa.Schema) -> str:
    """A schema as text for the manifest (Arrow's IPC form, base64)."""
    return base64.b64encode(schema.serialize().to_pybytes()).decode()


def decode(text: str) -> pa.Schema:
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))


def _manifest(output: str | os.PathLike):
    fs, path = filesystem(os.fspath(output))
    directory, manifest_path, errors_path = paths(path)
    manifest = manifests.load(fs, manifest_path)
    if manifest is None:
        raise TableError(f"{output} has no manifest ({manifest_path}): not a job's output")
    return fs, directory, errors_path, manifest, decode(manifest.settings["output_schema"])


def read_output(output: str | os.PathLike) -> pa.Table:
    """The committed rows of a job's output, in row order, with the types of its schema; a
    committed shard missing or damaged is a `TableError` naming it (the job run again repairs
    it)."""
    fs, directory, _, manifest, schema = _manifest(output)
    tables = []
    for record in manifest.shards:
        try:
            tables.append(_read_shard(fs, directory, record, manifest, schema))
        except (OSError, ValueError, KeyError, pa.ArrowException) as e:
            raise TableError(
                f"{output}: shard {record.file} cannot be read ({type(e).__name__}: {e}); run "
                "the job again to score it again"
            ) from None
    return pa.concat_tables(tables) if tables else schema.empty_table()


def _read_shard(
    fs, directory: str, record: manifests.ShardRecord, manifest, schema: pa.Schema
) -> pa.Table:
    """A committed shard's rows, its bytes checked against the manifest's record first: a shard
    changed since its commit would parse as other (or shifted) rows."""
    with fs.open(posixpath.join(directory, record.file), "rb") as f:
        data = f.read(record.bytes + 1)
    if len(data) != record.bytes or fingerprints.of_bytes(data) != record.sha256:
        raise ValueError(
            f"it changed since its commit (the manifest records {record.bytes} bytes with "
            f"sha256 {record.sha256[:12]}...)"
        )
    if manifest.settings["output_format"] == "parquet":
        import pyarrow.parquet as pq

        # Parquet has no second unit: timestamp[s] comes back as [ms] without the cast
        return pq.read_table(pa.BufferReader(data)).cast(schema)
    rows = [json.loads(line) for line in data.decode().splitlines()]
    columns = [values.from_json([r[f.name] for r in rows], f.type) for f in schema]
    return pa.Table.from_arrays(columns, schema=schema)


def read_errors(output: str | os.PathLike) -> pa.Table:
    """The errors file of a job's output as a table: row, the id columns (their input types),
    code, message, param; an errors file missing or damaged is a `TableError` naming it (the
    job run again repairs it)."""
    fs, _, errors_path, manifest, schema = _manifest(output)
    ids = [f for f in schema if f.name in manifest.settings["spec"]["id_columns"]]
    errors_schema = pa.schema([pa.field("row", pa.int64()), *ids, *ERROR_FIELDS])
    try:
        with fs.open(errors_path, "rb") as f:
            data = f.read(manifest.errors_bytes)
        if len(data) < manifest.errors_bytes:
            raise ValueError(f"{len(data)} bytes, not the {manifest.errors_bytes} committed")
        lines = [json.loads(line) for line in data.decode().splitlines()]
    except (OSError, ValueError) as e:
        raise TableError(
            f"{output}: {errors_path} cannot be read ({type(e).__name__}: {e}); run the job "
            "again to score its rows again"
        ) from None
    columns = [values.from_json([e["row"] for e in lines], pa.int64())]
    columns += [values.from_json([e["ids"][f.name] for e in lines], f.type) for f in ids]
    columns += [pa.array([e[f.name] for e in lines], f.type) for f in ERROR_FIELDS]
    return pa.Table.from_arrays(columns, schema=errors_schema)
