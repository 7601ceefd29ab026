"""Score a batch of table rows: rows to requests, bad rows set aside with their error, the rest
scored in one `Scorer.score_batch` call, and the scores back as Arrow columns in row order.

Two shapes of table, told apart by the item column's type:

- pair rows: one (query, item) pair per row, the item a string (or token ids): a recommender's
  table. The rows of one query are grouped into one request (`grouping`).
- request rows: a query and a list of items per row, as `Scorer.score` takes them.

The job (`job.py`) and the Ray integration (`tpuscore.integrations.ray`) both score through
`score_rows`, so they write the same columns.
"""

from __future__ import annotations

import collections
import re
from typing import Any

import attrs
import numpy as np
import pyarrow as pa

from tpuscore.api import templates, validation
from tpuscore.api.errors import ValidationError
from tpuscore.jobs import values
from tpuscore.jobs.grouping import freeze, group_rows
from tpuscore.jobs.spec import (
    CALIBRATED,
    CHUNK_COLUMNS,
    PAIRS,
    REQUESTS,
    JobConfigError,
    Layout,
    RowError,
    RowFailed,
)
from tpuscore.tasks import chunking as chunked

# A request's size bounds that a query's grouped pair rows can pass together though no row
# passes them alone: such a group is scored in parts instead.
GROUP_TOO_LARGE = frozenset({"too_many_items", "too_many_scores", "request_too_large"})
# Row options that are counts: a column of them with nulls arrives as floats from pandas (an
# int Series with a missing value is float64), which a whole float reads back as.
COUNT_OPTIONS = frozenset({"max_item_tokens"})


@attrs.frozen
class Scored:
    """A scored batch: the id and score columns for every row (nulls where a row failed),
    which rows failed and why, and items scored per backend."""

    table: pa.Table
    failed: np.ndarray  # bool [rows]
    errors: list[RowError]
    backends: collections.Counter


@attrs.define
class _Unit:
    """One request and the rows it scores (one row, or a query's pair rows); with chunking,
    its items' chunks, which the prepared request scores in their place."""

    rows: list[int]
    request: dict[str, Any]
    chunks: chunked.ChunkedRequest | None = None


def score_rows(
    scorer: Any,
    layout: Layout,
    batch: pa.RecordBatch | pa.Table,
    *,
    first_row: int = 0,
    backend: str | None = None,
    fail_fast: bool = False,
) -> Scored:
    """Score `batch`'s rows with one `scorer.run` call over the requests `scorer.prepare`
    accepts; a request it refuses sets its rows aside, each with its own typed error.

    Args:
        scorer: a `tpuscore.Scorer`.
        layout: `Spec.layout` of the batch's schema (and the scorer's classes).
        batch: rows holding at least `layout.columns`.
        first_row: the number of the batch's first row in its table, for error records.
        backend: as `Scorer.run` takes it.
        fail_fast: raise `RowFailed` at the first bad row instead of setting it aside.

    Raises:
        JobConfigError: an error every row would meet (a job-wide label that is not one token,
            an unknown backend).
        RowFailed: with fail_fast, a bad row.
        ValidationError: the backend cannot run these requests.
    """
    n = batch.num_rows
    errors: dict[int, ValidationError] = {}

    def reject(row: int, e: ValidationError) -> None:
        if fail_fast:
            raise RowFailed(_row_error(layout, batch, first_row, row, e))
        errors[row] = e

    units, prepared = [], []
    for unit in _units(layout, batch, reject):
        for ready_unit, request in _prepare(scorer, unit, layout, reject, backend):
            units.append(ready_unit)
            prepared.append(request)
    results = scorer.run(prepared, backend=backend)

    backends: collections.Counter = collections.Counter()
    # per row: (raw, scores, calibrated), [labels], [labels] and a float (None: not covered),
    # or [items, labels], [items, labels] and [items]
    per_row: list[Any] = [None] * n
    for unit, result in zip(units, results, strict=True):
        backends[result.backend] += len(result.logprobs)
        if unit.chunks is not None:
            _documents(unit, result, layout, per_row)
            continue
        calibrated = result.calibrated
        if layout.shape == PAIRS:
            for k, row in enumerate(unit.rows):
                p = None if calibrated is None else calibrated[k]
                per_row[row] = (result.logprobs[k], result.label_probs[k], p)
        else:
            per_row[unit.rows[0]] = (result.logprobs, result.label_probs, calibrated)
    failed = np.zeros(n, bool)
    failed[list(errors)] = True
    columns = {c: batch.column(c) for c in layout.id_columns}
    columns.update(_score_columns(layout, per_row))
    rejected = [_row_error(layout, batch, first_row, r, errors[r]) for r in sorted(errors)]
    return Scored(pa.table(columns), failed, rejected, backends)


def _documents(unit: _Unit, result, layout: Layout, per_row: list[Any]) -> None:
    """A chunked unit's rows: per document the best chunk's scores (no calibrated one: a
    chunk's is not its document's) and (aggregated score, best chunk, its start, its end),
    as `Scorer.score(chunking=)` gives them."""
    documents = unit.chunks.documents(result)
    chunks = unit.chunks.chunks
    first = np.searchsorted(chunks.document, np.arange(chunks.num_documents))
    best = first + documents.best_chunk
    spans = np.array(documents.best_span, np.int64).reshape(-1, 2)
    own = (documents.scores, documents.best_chunk, spans[:, 0], spans[:, 1])
    if layout.shape == PAIRS:
        for d, row in enumerate(unit.rows):
            values = tuple(v[d] for v in own)
            per_row[row] = (result.logprobs[best[d]], result.label_probs[best[d]], None, values)
    else:
        per_row[unit.rows[0]] = (result.logprobs[best], result.label_probs[best], None, own)


def check_options(scorer: Any, layout: Layout, backend: str | None = None) -> None:
    """Refuse the options the job sets for every row (its labels, suffix, truncation) and its
    backend (registered, able to run them) before a row is read or an output opened: a request
    of no items meets each check (with labels per row, under a stand-in label for the rows').

    Raises:
        JobConfigError: an option or backend the scorer refuses, with its code and param.
    """
    own_labels = {"label_token_ids": [0]} if layout.label_names is None else {}
    request = {"query": [], "items": [], **own_labels, **layout.options}
    try:
        prepared = scorer.prepare_request(request, backend=backend)
        if layout.chunking is not None and layout.label_names is not None:
            chunked.positive_label(prepared)  # one job-wide label: no chunk could be ranked
    except ValidationError as e:
        raise JobConfigError(e.code, str(e), e.param) from None


def _row_error(layout: Layout, batch, first_row: int, row: int, e: ValidationError) -> RowError:
    """The `RowError` of a batch's row: its number, its ids as JSON values, the error."""
    ids = {c: values.to_json(batch.column(c).slice(row, 1))[0] for c in layout.id_columns}
    return RowError(first_row + row, ids, e.code, str(e), e.param)


def _option_values(column: pa.ChunkedArray | pa.Array, name: str) -> list[Any]:
    """A row option column's values; a count's whole floats as ints (any other value is left
    for the scorer to refuse)."""
    found = column.to_pylist()
    if name not in COUNT_OPTIONS or not pa.types.is_floating(column.type):
        return found
    return [int(v) if isinstance(v, float) and v.is_integer() else v for v in found]


def _units(layout: Layout, batch, reject) -> list[_Unit]:
    """The batch's rows as requests: a row's own options, the template rendered, pair rows of
    one query and options grouped."""
    n = batch.num_rows
    queries = batch.column(layout.query_column).to_pylist()
    items = batch.column(layout.item_column).to_pylist()
    own = {name: _option_values(batch.column(name), name) for name in layout.row_options}
    tmpl = templates.get(layout.template) if layout.template is not None else None
    rows, options = [], []
    for r in range(n):
        opts = {name: values[r] for name, values in own.items() if values[r] is not None}
        if tmpl is not None:
            try:
                queries[r], rendered = _render(tmpl, layout, queries[r], items[r])
            except ValidationError as e:
                reject(r, e)
                continue
            if layout.chunking is None:  # else each chunk is rendered, not the document
                items[r] = rendered
        rows.append(r)
        options.append(opts)
    if layout.shape == REQUESTS:
        return [
            _Unit([r], {"query": queries[r], "items": items[r], **layout.options, **opts})
            for r, opts in zip(rows, options, strict=True)
        ]
    keys = [(freeze(queries[r]), freeze(o)) for r, o in zip(rows, options, strict=True)]
    units = []
    for group in group_rows(keys):
        members = [rows[g] for g in group]
        request = {
            "query": queries[members[0]],
            "items": [items[r] for r in members],
            **layout.options,
            **options[group[0]],
        }
        units.append(_Unit(members, request))
    return units


def _render(tmpl: templates.Template, layout: Layout, query: Any, items: Any) -> tuple[Any, Any]:
    if not isinstance(query, str):
        raise ValidationError(
            "invalid_query", f"a template renders text: query must be a str, got {query!r}", "query"
        )
    many = items if layout.shape == REQUESTS else [items]
    if not isinstance(many, list) or not all(isinstance(it, str) for it in many):
        raise ValidationError(
            "invalid_items", f"a template renders text: items must be str, got {items!r}", "items"
        )
    rendered = [tmpl.render_item(it) for it in many]
    return tmpl.render_query(query, layout.instruction), (
        rendered if layout.shape == REQUESTS else rendered[0]
    )


def _prepare(
    scorer: Any, unit: _Unit, layout: Layout, reject, backend: str | None
) -> list[tuple[_Unit, Any]]:
    """(unit, prepared request) pairs that score the unit's rows but its bad ones (each passed
    to `reject` with its own error): the unit itself, or its parts where a query's pair rows
    are more than one request of the scorer may hold (`Scorer(limits=)`), or none. An error in
    an option the job set for every row is the job's (`JobConfigError`); a row's option that
    `backend` cannot run (an adapter) is the row's, as `score_batch` refuses it."""
    try:
        return [(unit, _prepared(scorer, unit, layout, backend))]
    except ValidationError as e:
        error = e
    if error.code in GROUP_TOO_LARGE and len(unit.rows) > 1:
        half, items = len(unit.rows) // 2, unit.request["items"]
        parts = [
            _Unit(rows, {**unit.request, "items": part})
            for rows, part in ((unit.rows[:half], items[:half]), (unit.rows[half:], items[half:]))
        ]
        return [
            ready for part in parts for ready in _prepare(scorer, part, layout, reject, backend)
        ]
    name = re.split(r"[.\[]", error.param or "", maxsplit=1)[0]
    # The job's options and its backend are the job's; a row's adapter its backend cannot run
    # is the row's.
    if name in layout.options or (name == "backend" and error.code != "adapter_unsupported"):
        raise JobConfigError(error.code, str(error), error.param)
    if len(unit.rows) == 1 or name != "items":
        for row in unit.rows:
            reject(row, error)
        return []
    # A query's pair rows: each item prepared on its own finds the bad ones.
    good = []
    for k, item in enumerate(unit.request["items"]):
        try:
            _prepared(scorer, _Unit([unit.rows[k]], {**unit.request, "items": [item]}), layout,
                      backend)  # fmt: skip
            good.append(k)
        except ValidationError as e:
            reject(unit.rows[k], e)
    if len(good) == len(unit.rows):  # no item is bad alone: the error is the request's
        for row in unit.rows:
            reject(row, error)
        return []
    if not good:
        return []
    request = {**unit.request, "items": [unit.request["items"][k] for k in good]}
    return _prepare(scorer, _Unit([unit.rows[k] for k in good], request), layout, reject, backend)


def _prepared(scorer: Any, unit: _Unit, layout: Layout, backend: str | None):
    """The unit's request prepared; with chunking, of its items' chunks as `Scorer.score(
    chunking=)` prepares them (each rendered by the job's template as a document), kept on the
    unit to read the result back."""
    if layout.chunking is None:
        return scorer.prepare_request(unit.request, backend=backend)
    render = templates.get(layout.template).render_item if layout.template else None

    def prepare(chunk_items: list[Any]):
        if render is not None:
            chunk_items = [render(c) for c in chunk_items]
        return scorer.prepare_request({**unit.request, "items": chunk_items}, backend=backend)

    query, items, options = validation.request_arguments(unit.request)
    unit.chunks = chunked.prepare_chunks(
        scorer.engine, query, items, layout.chunking, options, prepare
    )
    return unit.chunks.request


def _score_columns(layout: Layout, per_row: list[Any]) -> dict[str, pa.Array]:
    """Per-row (raw, scores) values (None for a failed row) as the output's score columns:
    `ScoreResult.logprobs` (log-probabilities, or a classification head's logits) and
    `ScoreResult.label_probs` (the softmax over the labels, or the class probabilities), and
    with a calibration `ScoreResult.calibrated`."""
    columns: dict[str, pa.Array] = {}
    if layout.label_names is None:  # labels per row: list columns
        for part, kind in enumerate(layout.kinds):
            values = [None if x is None else x[part] for x in per_row]
            columns[f"{kind}s"] = _lists(values, layout.shape)
        return _with_chunks(_with_calibrated(columns, layout, per_row), layout, per_row)
    labels = len(layout.label_names)
    ok = np.array([x is not None for x in per_row], bool)
    for part, kind in enumerate(layout.kinds):
        if layout.shape == PAIRS:
            values = np.full((len(per_row), labels), np.nan, np.float32)
            if ok.any():
                values[ok] = np.stack([x[part] for x in per_row if x is not None])
            for j, name in enumerate(layout.label_names):
                columns[f"{kind}_{name}"] = pa.array(values[:, j], mask=~ok)
            continue
        for j, name in enumerate(layout.label_names):
            column = [None if x is None else np.asarray(x[part][:, j], np.float32) for x in per_row]
            columns[f"{kind}_{name}"] = pa.array(column, type=pa.list_(pa.float32()))
    return _with_chunks(_with_calibrated(columns, layout, per_row), layout, per_row)


def _with_chunks(
    columns: dict[str, pa.Array], layout: Layout, per_row: list[Any]
) -> dict[str, pa.Array]:
    """`columns` and, with chunking, each document's CHUNK_COLUMNS (null for a failed row)."""
    if layout.chunking is None:
        return columns
    schema = layout.score_schema()
    for part, name in enumerate(CHUNK_COLUMNS):
        found = [None if x is None else x[3][part] for x in per_row]
        if layout.shape == REQUESTS:
            found = [None if v is None else np.asarray(v).tolist() for v in found]
        else:
            found = [None if v is None else v.item() for v in found]
        columns[name] = pa.array(found, schema.field(name).type)
    return columns


def _with_calibrated(
    columns: dict[str, pa.Array], layout: Layout, per_row: list[Any]
) -> dict[str, pa.Array]:
    """`columns` and, where the layout has one, the calibrated column: null for a failed row and
    for a row whose labels the calibration does not cover."""
    if not layout.calibrated:
        return columns
    values = [None if x is None else x[2] for x in per_row]
    if layout.shape == PAIRS:
        column = pa.array([None if v is None else float(v) for v in values], pa.float32())
    else:
        column = pa.array(
            [None if v is None else np.asarray(v, np.float32) for v in values],
            type=pa.list_(pa.float32()),
        )
    return {**columns, CALIBRATED: column}


def _lists(values: list[Any], shape: str) -> pa.Array:
    """Per-row float arrays (None: null) as list<float32> (pairs) or list<list<float32>>."""
    kind = pa.list_(pa.float32()) if shape == PAIRS else pa.list_(pa.list_(pa.float32()))
    return pa.array(
        [None if v is None else np.asarray(v, np.float32).tolist() for v in values], kind
    )
