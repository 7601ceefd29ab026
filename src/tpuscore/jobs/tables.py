"""Tables in and out: Parquet, JSON Lines and CSV read as a stream of Arrow record batches, from
local paths or fsspec URLs (`file://`, `memory://`, `gs://` and `s3://` with gcsfs / s3fs).

Only the columns a job needs are read where the format allows it (Parquet, CSV), and never more
than one record batch at a time, so memory holds O(batch), not O(rows).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

import attrs
import fsspec
import pyarrow as pa

FORMATS = ("parquet", "jsonl", "csv")
_SUFFIXES = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".csv": "csv",
}


class TableError(ValueError):
    """A table that cannot be read or written as asked: missing, unknown format, missing column."""


def table_format(url: str, given: str | None = None) -> str:
    """The format of `url`: `given`, else from its suffix (.parquet/.pq, .jsonl/.ndjson/.json,
    .csv)."""
    if given is not None:
        if given not in FORMATS:
            raise TableError(f"format {given!r} is unknown; expected one of {', '.join(FORMATS)}")
        return given
    suffix = os.path.splitext(url.rstrip("/"))[1].lower()
    if suffix not in _SUFFIXES:
        raise TableError(
            f"cannot tell the format of {url!r} from its suffix; name a .parquet, .jsonl or "
            ".csv file (or pass the format)"
        )
    return _SUFFIXES[suffix]


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem of `url` and the path on it (a plain path is a local file)."""
    fs, path = fsspec.core.url_to_fs(os.fspath(url))
    return fs, path


@attrs.define
class Table:
    """An input table: its URL, format and schema, and its row count where the format records it
    (Parquet) or where it was counted (`count_rows`)."""

    url: str
    format: str
    schema: pa.Schema
    num_rows: int | None
    text: tuple[str, ...] = ()  # CSV columns read as strings, whatever pyarrow would infer

    def as_text(self, columns: Sequence[str]) -> Table:
        """This table with `columns` read as strings where its format has no types (CSV, whose
        inference makes a column of numbers int: an item "123" would not be text)."""
        if self.format != "csv":
            return self
        schema = self.schema
        for name in columns:
            for index in schema.get_all_field_indices(name):
                schema = schema.set(index, pa.field(name, pa.string()))
        return attrs.evolve(self, schema=schema, text=tuple(columns))

    def batches(self, columns: Sequence[str], batch_rows: int) -> Iterator[pa.RecordBatch]:
        """The table's rows in order, as record batches of at most `batch_rows` rows holding
        `columns` (in that order)."""
        missing = [c for c in columns if c not in self.schema.names]
        if missing:
            raise TableError(
                f"{self.url} has no column {missing[0]!r}; its columns are "
                f"{', '.join(self.schema.names)}"
            )
        fs, path = filesystem(self.url)
        with fs.open(path, "rb") as f, _reading(self.url, self.format):
            for batch in _read(f, self.format, list(columns), batch_rows, self.text):
                for start in range(0, batch.num_rows, batch_rows):
                    yield batch.slice(start, batch_rows).select(list(columns))

    def count_rows(self) -> int:
        """The row count, counted by reading the file once (lines for JSON Lines and CSV: a
        quoted newline inside a CSV field counts as a row, so that count is an estimate)."""
        if self.num_rows is None:
            fs, path = filesystem(self.url)
            lines, last = 0, b"\n"
            with fs.open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    lines += chunk.count(b"\n")
                    last = chunk[-1:]
            lines += last != b"\n"  # a last line without its newline
            self.num_rows = max(0, lines - (self.format == "csv"))  # the header
        return self.num_rows


def open_table(url: str | os.PathLike, format: str | None = None) -> Table:
    """The table at `url` with its schema (read from its start; JSON Lines and CSV types are
    inferred from the first block, as pyarrow infers them)."""
    url = os.fspath(url)
    fmt = table_format(url, format)
    fs, path = filesystem(url)
    if not fs.isfile(path):
        raise TableError(f"{url}: no such file")
    with fs.open(path, "rb") as f, _reading(url, fmt):
        if fmt == "parquet":
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(f)
            return Table(url, fmt, meta.schema_arrow, meta.metadata.num_rows)
        reader = _open_stream(f, fmt, None)
        return Table(url, fmt, reader.schema, None)


@contextlib.contextmanager
def _reading(url: str, fmt: str) -> Iterator[None]:
    """pyarrow's errors reading `url` (not the format, a JSON Lines value whose type changes
    after the first block) as the `TableError` a job reports as bad input."""
    try:
        yield
    except pa.ArrowException as e:
        raise TableError(f"{url} cannot be read as {fmt}: {e}") from None


def _open_stream(f, fmt: str, columns: list[str] | None, text: Sequence[str] = ()):
    if fmt == "jsonl":
        import pyarrow.json as pj

        return pj.open_json(f)
    import pyarrow.csv as pc

    types = {name: pa.string() for name in text}
    return pc.open_csv(
        f, convert_options=pc.ConvertOptions(include_columns=columns, column_types=types)
    )


def _read(
    f, fmt: str, columns: list[str], batch_rows: int, text: Sequence[str]
) -> Iterator[pa.RecordBatch]:
    if fmt == "parquet":
        import pyarrow.parquet as pq

        yield from pq.ParquetFile(f).iter_batches(batch_size=batch_rows, columns=columns)
        return
    yield from _open_stream(f, fmt, columns, text)


def table_bytes(table: pa.Table, fmt: str) -> bytes:
    """`table` as a Parquet file or JSON Lines (one object per row, columns in order, values as
    `values.to_json` writes them)."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        return sink.getvalue().to_pybytes()
    if fmt == "jsonl":
        import json

        from tpuscore.jobs.values import to_json

        names, columns = table.column_names, [to_json(column) for column in table.columns]
        rows = (dict(zip(names, row, strict=True)) for row in zip(*columns, strict=True))
        return "".join(
            json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n" for row in rows
        ).encode()
    raise TableError(f"cannot write {fmt}; output is parquet or jsonl")
