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

import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import pyarrow as pa

from tpuscore.api.calibration import Calibration
from tpuscore.api.chunking import Chunking
from tpuscore.jobs import calibrated, fingerprints, locking, schemas, shards
from tpuscore.jobs.output import Output, paths
from tpuscore.jobs.scoring import check_options, score_rows
from tpuscore.jobs.spec import JobConfigError, Spec, classes_of
from tpuscore.jobs.tables import TableError, filesystem, open_table, table_format
from tpuscore.scorer import Scorer

ON_ERROR = ("skip", "fail")


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
    repaired: int = 0  # committed shards found missing or damaged, and scored again

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        """The one-line summary the CLI prints."""
        if not self.rows and self.resumed_rows:
            return f"tpuscore job: already complete ({self.resumed_rows} rows) -> {self.output}"
        used = ", ".join(f"{name} {n}" for name, n in sorted(self.backends.items())) or "none"
        resumed = f", resumed after row {self.resumed_rows}" if self.resumed_rows else ""
        if self.repaired:
            resumed += f", {self.repaired} damaged or missing shards scored again"
        return (
            f"tpuscore job: {self.rows} rows, {self.errors} errors, {self.seconds:.1f} s, "
            f"{self.rows_per_second:.1f} rows/s, backends: {used}{resumed} -> {self.output}"
        )


def output_paths(output: str) -> tuple[str, str, str]:
    """(shard directory, manifest, errors file) of an output URL."""
    return paths(output)


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
    chunking: Chunking | Mapping[str, Any] | None = None,
    on_error: str = "skip",
    shard_rows: int = 4096,
    input_format: str | None = None,
    output_format: str | None = None,
    overwrite: bool = False,
    show_progress: bool = False,
    score_calibration: str | os.PathLike | None = None,
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
        model, dtype: what `load_scorer` loads when no scorer is given (refused with one: the
            scorer's would run). The manifest records
            the model's fingerprint (config, dtype, weights' hash) and the input's (size and
            content hash), so a resume with another model or input is refused.
        backend: the backend of every `score_batch` call (default the scorer's).
        query_column, item_column, id_columns, labels, label_token_ids, template, instruction,
            item_suffix, max_item_tokens, truncate, item_first, chunking: what to score, as
            `Spec` says (chunking: each item a document scored by its chunks).
        on_error: "skip" writes a bad row to the errors file and goes on; "fail" raises
            `RowFailed` at the first.
        shard_rows: input rows per shard: per `score_batch` call, per output file, and the
            window in which a query's pair rows are grouped.
        input_format, output_format: "parquet", "jsonl" or "csv" (input only); default from the
            name's suffix.
        overwrite: delete an existing output first instead of resuming it.
        show_progress: a tqdm bar over the rows on stderr.
        score_calibration: a `tpuscore fit-calibration` file that `load_scorer` loads with the
            model (refused, `CalibrationMismatch`, if fitted for another); with a `scorer`, set
            it on the scorer instead. When the scorer has a calibration, the output has a
            `calibrated` column (docs/jobs.md), the calibration must have been fitted under the
            job's template and for its labels, and the manifest records it: a resume under
            another calibration, or none, is refused.

    Returns:
        A `JobSummary`.

    Raises:
        JobConfigError (a `ValidationError`): a setting every row would fail on, a missing
            column, or an output that is not a job's (`output_exists`).
        CalibrationMismatch (a `ValidationError`, `calibration_mismatch`): a score calibration
            fitted for another model, template or labels.
        ResumeRefused (a `JobConfigError`, `output_mismatch`): an output written from another
            input, model or settings; `changed` says what differs.
        OutputLocked (a `JobConfigError`, `output_locked`): another job is writing the output
            (`<output>.lock` names it).
        TableError: an input that cannot be read as the format.
        RowFailed: with on_error="fail", the first bad row.
    """
    check_run(on_error, shard_rows)
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
        chunking=chunking,
    )
    table = open_table(input, input_format)
    table = table.as_text(spec.text_columns(table.schema.names))
    layout = spec.layout(table.schema)  # a bad column or setting fails before the model loads
    out_format = _output_format(output, output_format)
    if scorer is None:
        scorer = load_scorer(model, dtype=dtype, score_calibration=score_calibration)
    elif score_calibration is not None:
        raise JobConfigError(
            "invalid_argument",
            "score_calibration is loaded with the model; with a scorer given, load it there "
            "(Scorer.from_pretrained(..., score_calibration=) or scorer.score_calibration)",
            "score_calibration",
        )
    else:  # the scorer's own model and dtype run, so another named here would be ignored
        for name, value in (("model", model), ("dtype", dtype)):
            if value is not None:
                raise JobConfigError(
                    "invalid_argument",
                    f"{name} is what load_scorer loads when no scorer is given; with a scorer, "
                    f"the scorer's runs: leave {name} out (or load the scorer with it)",
                    name,
                )
    layout = spec.layout(
        table.schema, classes_of(scorer), calibrated=scorer.score_calibration is not None
    )
    check_options(scorer, layout, backend)  # before the output opens: a corrected rerun starts
    fitted: Calibration | None = calibrated.checked(scorer, layout)
    in_fs, in_path = filesystem(input)
    settings = _jsonable(
        {
            "input": input,
            "input_fingerprint": fingerprints.of_input(in_fs, in_path),
            "input_format": table.format,
            "output_format": out_format,
            "shard_rows": shard_rows,
            # Without chunking, the spec as versions before it wrote it: their outputs resume.
            "spec": attrs.asdict(spec, filter=lambda a, v: a.name != "chunking" or v is not None),
            "output_schema": schemas.encode(_output_schema(table.schema, layout)),
            "model": fingerprints.of_model(scorer),
            "backend": backend,
        }
        # The columns each row's own options come from: a version that reads another (the
        # adapter column) must not resume an output that read them otherwise.
        | ({"row_options": list(layout.row_options)} if layout.row_options else {})
        | calibrated.setting(fitted)
    )
    fs, path = filesystem(output)
    _refuse_output_holding_input(in_fs, in_path, fs, path, output)
    with locking.hold(fs, f"{path.rstrip('/')}.lock", output):
        out = Output.open(fs, path, output, out_format, settings, overwrite)
        summary = _run(out, table, layout, scorer, shard_rows, backend, on_error, show_progress)
    return attrs.evolve(summary, seconds=time.perf_counter() - start)


def check_run(on_error: Any, shard_rows: Any) -> None:
    """`score_table`'s on_error and shard_rows, checked (`tpuscore job` checks them before it
    loads the model)."""
    if on_error not in ON_ERROR:
        raise JobConfigError(
            "invalid_argument", f"on_error must be skip or fail, got {on_error!r}", "on_error"
        )
    if isinstance(shard_rows, bool) or not isinstance(shard_rows, int) or shard_rows < 1:
        raise JobConfigError(
            "invalid_argument", f"shard_rows must be an int >= 1, got {shard_rows!r}", "shard_rows"
        )


def _run(out, table, layout, scorer, shard_rows, backend, on_error, show_progress) -> JobSummary:
    """Score the shards `out` wants, committing each; the summary's seconds are filled in by
    the caller."""
    resumed = out.kept_rows
    if out.manifest.complete:
        return JobSummary(out.name, 0, 0, 0.0, {}, resumed, 0)
    total = table.num_rows
    if total is None and show_progress:
        total = table.count_rows()
    from tqdm.auto import tqdm

    rows = errors = count = 0
    repaired = len(out.redo)
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
        for index, first_row, rows_in in _shards(table, layout.columns, shard_rows, out.wanted):
            scored = score_rows(
                scorer,
                layout,
                rows_in,
                first_row=first_row,
                backend=backend,
                fail_fast=on_error == "fail",
            )
            numbers = pa.array(range(first_row, first_row + rows_in.num_rows), pa.int64())
            kept = scored.table.add_column(0, "row", numbers).filter(pa.array(~scored.failed))
            out.commit(index, first_row, rows_in.num_rows, kept, scored.errors)
            rows += rows_in.num_rows
            errors += len(scored.errors)
            count += 1
            backends.update(scored.backends)
            bar.update(rows_in.num_rows)
    out.finish()
    return JobSummary(out.name, rows, errors, 0.0, dict(backends), resumed, count, repaired)


def _output_schema(input_schema: pa.Schema, layout) -> pa.Schema:
    """row, the id columns as the input has them, then the score columns."""
    ids = [input_schema.field(c) for c in layout.id_columns]
    return pa.schema([pa.field("row", pa.int64()), *ids, *layout.score_schema()])


def _refuse_output_holding_input(in_fs, in_path: str, fs, path: str, output: str) -> None:
    """An output whose directory or files beside it are (or hold) the input is refused: an
    overwrite would delete the input before it is read."""
    if in_fs.protocol != fs.protocol:
        return
    directory, *files = paths(path)
    if in_path in files or in_path == directory or in_path.startswith(f"{directory}/"):
        raise JobConfigError(
            "output_holds_input",
            f"the output {output} holds the input {in_path}; name an output apart from it",
            "output",
        )


def _output_format(output: str, given: str | None) -> str:
    if given is None and not os.path.splitext(output.rstrip("/"))[1]:
        return "parquet"
    fmt = table_format(output, given)
    if fmt not in shards.SUFFIX:
        raise TableError(f"output is parquet or jsonl, not {fmt}")
    return fmt


def _shards(
    table, columns: list[str], shard_rows: int, wanted: Callable[[int], bool]
) -> Iterator[tuple[int, int, pa.Table]]:
    """(index, first row, rows) of each wanted shard of `shard_rows` input rows, in order,
    holding one shard at a time (the rows of shards not wanted are read and dropped)."""
    pending: list[pa.RecordBatch] = []
    held = index = 0
    for batch in table.batches(columns, shard_rows):
        while batch.num_rows:
            take = min(batch.num_rows, shard_rows - held)
            if wanted(index):
                pending.append(batch.slice(0, take))
            batch, held = batch.slice(take), held + take
            if held == shard_rows:
                if pending:
                    yield index, index * shard_rows, pa.Table.from_batches(pending)
                pending, held, index = [], 0, index + 1
    if pending:
        yield index, index * shard_rows, pa.Table.from_batches(pending)
    elif index == held == 0 and wanted(0):  # an empty table: one empty shard holds the columns
        yield 0, 0, pa.schema([table.schema.field(c) for c in columns]).empty_table()


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
