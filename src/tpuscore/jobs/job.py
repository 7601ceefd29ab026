"""`score_table`: score a table of pairs or requests into a table of scores, as a resumable job.

    from tpuscore import jobs
    jobs.score_table("pairs.parquet", "scores.parquet", labels=[" yes", " no"],
                     query_column="user_text", item_column="item_text",
                     id_columns=["user_id", "item_id"])

The input is read as a stream, `shard_rows` rows at a time; each shard is scored in one
`score_batch` call, written aside and renamed into the output directory, then recorded in the
manifest (`manifest.py`). Running the same call again after a crash resumes after the last
committed shard, and the finished output equals an uninterrupted run's: a shard's scores depend
only on its rows, never on what ran before (the scorer from `load_scorer` keeps no prefix cache
between calls).
"""

from __future__ import annotations

import json
import os
import posixpath
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import pyarrow as pa

from tpuscore.jobs import fingerprints, shards
from tpuscore.jobs import manifest as manifests
from tpuscore.jobs.scoring import JobConfigError, Spec, classes_of, score_rows
from tpuscore.jobs.tables import TableError, filesystem, open_table, table_format
from tpuscore.scorer import Scorer

ON_ERROR = ("skip", "fail")


class ResumeRefused(JobConfigError):
    """An output written by a job with another input, model or settings: resuming it would mix
    two jobs' rows. `changed` holds (what, recorded value, this run's value) per difference."""

    def __init__(self, output: str, changed: list[tuple[str, Any, Any]]):
        said = "; ".join(f"{what}: {_cut(old)} -> {_cut(new)}" for what, old, new in changed[:6])
        more = f" (and {len(changed) - 6} more)" if len(changed) > 6 else ""
        super().__init__(
            "output_mismatch",
            f"{output} holds a job run on another input, model or settings ({said}{more}); "
            "re-run with the same ones to resume, or pass overwrite to start again",
            "output",
        )
        self.changed = changed


def _cut(value: Any, limit: int = 80) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def load_scorer(model: str | os.PathLike | None = None, **kwargs: Any) -> Scorer:
    """`Scorer.from_pretrained(model, **kwargs)` with no prefix cache: its backends keep nothing
    from one call to the next, so a row's scores do not depend on the rows scored before it (a
    query's K/V cached by an earlier call changes the rounding by ~1e-5)."""
    options = {k: dict(v) for k, v in (kwargs.pop("backend_options", None) or {}).items()}
    options.setdefault("prefill_extend", {})["prefix_cache_bytes"] = 0
    return Scorer.from_pretrained(model, backend_options=options, **kwargs)


@attrs.frozen
class JobSummary:
    """What a run did. rows: input rows this run scored (errors included); resumed_rows: rows
    earlier runs had committed; backends: items scored per backend."""

    output: str
    rows: int
    errors: int
    seconds: float
    backends: dict[str, int]
    resumed_rows: int = 0
    shards: int = 0

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        """The one-line summary the CLI prints."""
        if not self.rows and self.resumed_rows:
            return f"tpuscore job: already complete ({self.resumed_rows} rows) -> {self.output}"
        used = ", ".join(f"{name} {n}" for name, n in sorted(self.backends.items())) or "none"
        resumed = f", resumed after row {self.resumed_rows}" if self.resumed_rows else ""
        return (
            f"tpuscore job: {self.rows} rows, {self.errors} errors, {self.seconds:.1f} s, "
            f"{self.rows_per_second:.1f} rows/s, backends: {used}{resumed} -> {self.output}"
        )


def output_paths(output: str) -> tuple[str, str, str]:
    """(shard directory, manifest, errors file) of an output URL."""
    output = output.rstrip("/")
    return output, f"{output}.manifest.json", f"{output}.errors.jsonl"


def score_table(
    input: str | os.PathLike,
    output: str | os.PathLike,
    *,
    scorer: Scorer | None = None,
    model: str | os.PathLike | None = None,
    dtype: str | None = None,
    backend: str | None = None,
    query_column: str = "query",
    item_column: str | None = None,
    id_columns: Sequence[str] = (),
    labels: Sequence[str] | None = None,
    label_token_ids: Sequence[int] | None = None,
    template: str | None = None,
    instruction: str | None = None,
    item_suffix: str | None = None,
    max_item_tokens: int | None = None,
    truncate: str | None = None,
    item_first: bool = False,
    on_error: str = "skip",
    shard_rows: int = 4096,
    input_format: str | None = None,
    output_format: str | None = None,
    overwrite: bool = False,
    show_progress: bool = False,
) -> JobSummary:
    """Score every row of a table and write the scores as a table, resuming an interrupted run.

    Args:
        input: a Parquet, JSON Lines or CSV file: a local path or an fsspec URL.
        output: where the scores go: a directory of shards (`part-00000.parquet`, ...) with
            `<output>.manifest.json` and `<output>.errors.jsonl` beside it. Parquet unless its
            name ends in .jsonl (or `output_format` says).
        scorer: the scorer to run; default `load_scorer(model, dtype=dtype)`. A scorer with a
            prefix cache still works, but a resumed run's scores may then differ from an
            uninterrupted run's by rounding.
        model, dtype: what `load_scorer` loads when no scorer is given. The manifest records
            the model's fingerprint (config, dtype, weights' hash) and the input's (size and
            content hash), so a resume with another model or input is refused.
        backend: the backend of every `score_batch` call (default the scorer's).
        query_column, item_column, id_columns, labels, label_token_ids, template, instruction,
            item_suffix, max_item_tokens, truncate, item_first: what to score, as `Spec` says.
        on_error: "skip" writes a bad row to the errors file and goes on; "fail" raises
            `RowFailed` at the first.
        shard_rows: input rows per shard: per `score_batch` call, per output file, and the
            window in which a query's pair rows are grouped.
        input_format, output_format: "parquet", "jsonl" or "csv" (input only); default from the
            name's suffix.
        overwrite: delete an existing output first instead of resuming it.
        show_progress: a tqdm bar over the rows on stderr.

    Returns:
        A `JobSummary`.

    Raises:
        JobConfigError (a `ValidationError`): a setting every row would fail on, a missing
            column, or an output that is not a job's (`output_exists`).
        ResumeRefused (a `JobConfigError`, `output_mismatch`): an output written from another
            input, model or settings; `changed` says what differs.
        TableError: an input that cannot be read as the format.
        RowFailed: with on_error="fail", the first bad row.
    """
    if on_error not in ON_ERROR:
        raise JobConfigError(
            "invalid_argument", f"on_error must be skip or fail, got {on_error!r}", "on_error"
        )
    if isinstance(shard_rows, bool) or not isinstance(shard_rows, int) or shard_rows < 1:
        raise JobConfigError(
            "invalid_argument", f"shard_rows must be an int >= 1, got {shard_rows!r}", "shard_rows"
        )
    start = time.perf_counter()
    input, output = os.fspath(input), os.fspath(output)
    spec = Spec(
        query_column=query_column,
        item_column=item_column,
        id_columns=id_columns,
        labels=labels,
        label_token_ids=label_token_ids,
        template=template,
        instruction=instruction,
        item_suffix=item_suffix,
        max_item_tokens=max_item_tokens,
        truncate=truncate,
        item_first=item_first,
    )
    table = open_table(input, input_format)
    layout = spec.layout(table.schema)  # a bad column or setting fails before the model loads
    out_format = _output_format(output, output_format)
    if scorer is None:
        scorer = load_scorer(model, dtype=dtype)
    layout = spec.layout(table.schema, classes_of(scorer))
    in_fs, in_path = filesystem(input)
    settings = _jsonable(
        {
            "input": input,
            "input_fingerprint": fingerprints.of_input(in_fs, in_path),
            "input_format": table.format,
            "output_format": out_format,
            "shard_rows": shard_rows,
            "spec": attrs.asdict(spec),
            "model": fingerprints.of_model(scorer),
            "backend": backend,
        }
    )
    fs, path = filesystem(output)
    directory, manifest_path, errors_path = output_paths(path)
    manifest = _prepare(fs, directory, manifest_path, errors_path, settings, overwrite, output)
    resumed = manifest.next_row
    if manifest.complete:
        return JobSummary(output, 0, 0, time.perf_counter() - start, {}, resumed, 0)

    total = table.num_rows
    if total is None and show_progress:
        total = table.count_rows()
    from tqdm.auto import tqdm

    rows = errors = count = 0
    backends: Counter = Counter()
    with tqdm(
        total=total,
        initial=resumed,
        unit="row",
        desc="tpuscore job",
        disable=not show_progress,
        file=sys.stderr,
        smoothing=0.1,
    ) as bar:
        for first_row, rows_in in _shards(table, layout.columns, shard_rows, resumed):
            scored = score_rows(
                scorer,
                layout,
                rows_in,
                first_row=first_row,
                backend=backend,
                fail_fast=on_error == "fail",
            )
            numbers = pa.array(range(first_row, first_row + rows_in.num_rows), pa.int64())
            out = scored.table.add_column(0, "row", numbers).filter(pa.array(~scored.failed))
            name = shards.shard_name(first_row // shard_rows, out_format)
            shards.commit_table(fs, posixpath.join(directory, name), out, out_format)
            errors_bytes = manifest.errors_bytes
            if scored.errors:
                lines = "".join(
                    json.dumps(_jsonable(e.to_json()), ensure_ascii=False) + "\n"
                    for e in scored.errors
                )
                errors_bytes = shards.append(fs, errors_path, lines.encode())
            record = manifests.ShardRecord(
                name, first_row, rows_in.num_rows, out.num_rows, len(scored.errors), errors_bytes
            )
            manifest = manifest.committed(record)
            manifests.save(fs, manifest_path, manifest)  # the commit point
            rows += rows_in.num_rows
            errors += len(scored.errors)
            count += 1
            backends.update(scored.backends)
            bar.update(rows_in.num_rows)
    manifest = attrs.evolve(manifest, complete=True)
    manifests.save(fs, manifest_path, manifest)
    seconds = time.perf_counter() - start
    return JobSummary(output, rows, errors, seconds, dict(backends), resumed, count)


def _output_format(output: str, given: str | None) -> str:
    if given is None and not os.path.splitext(output.rstrip("/"))[1]:
        return "parquet"
    fmt = table_format(output, given)
    if fmt not in shards.SUFFIX:
        raise TableError(f"output is parquet or jsonl, not {fmt}")
    return fmt


def _prepare(fs, directory, manifest_path, errors_path, settings, overwrite, output):
    """The manifest to continue from: a new one, or the existing one after the files a killed
    run left uncommitted are removed (aside files, shards past the manifest, errors past its
    recorded length)."""
    existing = None
    if not overwrite:
        try:
            existing = manifests.load(fs, manifest_path)
        except (ValueError, KeyError, TypeError) as e:
            raise JobConfigError(
                "manifest_unreadable",
                f"{manifest_path} cannot be read as a tpuscore job's manifest ({e}); pass "
                "overwrite to start the job again",
                "output",
            ) from None
    if overwrite:
        for path in (directory, manifest_path, errors_path):
            if fs.exists(path):
                fs.rm(path, recursive=True)
        existing = None
    if existing is None:
        if fs.exists(directory) and (not fs.isdir(directory) or fs.ls(directory)):
            raise JobConfigError(
                "output_exists",
                f"{output} exists and is not a tpuscore job's output (no {manifest_path}); "
                "remove it, name another output, or pass overwrite",
                "output",
            )
        fs.makedirs(directory, exist_ok=True)
        existing = manifests.Manifest(settings)
        shards.truncate(fs, errors_path, 0)
        manifests.save(fs, manifest_path, existing)
        return existing
    if existing.settings != settings:
        raise ResumeRefused(output, fingerprints.differences(existing.settings, settings))
    fs.makedirs(directory, exist_ok=True)
    shards.clear_aside(fs, directory)
    committed = {s.file for s in existing.shards}
    for path in fs.ls(directory, detail=False):
        name = posixpath.basename(path)
        if name.startswith("part-") and name not in committed:
            fs.rm(path)
    shards.truncate(fs, errors_path, existing.errors_bytes)
    return existing


def _shards(
    table, columns: list[str], shard_rows: int, skip: int
) -> Iterator[tuple[int, pa.Table]]:
    """(first row, rows) of each shard of `shard_rows` input rows from row `skip` on (a multiple
    of shard_rows), holding one shard at a time."""
    pending: list[pa.RecordBatch] = []
    held = 0
    row = 0  # input rows read so far
    first = skip
    for batch in table.batches(columns, shard_rows):
        if row + batch.num_rows <= skip:  # committed by an earlier run
            row += batch.num_rows
            continue
        if row < skip:
            batch = batch.slice(skip - row)
            row = skip
        row += batch.num_rows
        pending.append(batch)
        held += batch.num_rows
        while held >= shard_rows:
            rows = pa.Table.from_batches(pending).combine_chunks()
            yield first, rows.slice(0, shard_rows)
            rest = rows.slice(shard_rows)
            pending, held = rest.to_batches(), rest.num_rows
            first += shard_rows
    if held:
        yield first, pa.Table.from_batches(pending).combine_chunks()


def _jsonable(value: Any) -> Any:
    """Tuples as lists and numpy scalars as Python ones, so a value survives a JSON round trip
    unchanged (settings are compared after one)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, str | bytes):
        return value.item()
    return value
