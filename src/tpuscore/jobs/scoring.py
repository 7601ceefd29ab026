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
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import pyarrow as pa
import scipy.special

from tpuscore.api import templates
from tpuscore.api.errors import ValidationError
from tpuscore.jobs.grouping import freeze, group_rows

# Score options a row may carry in a column of the same name, where the job does not set them.
ROW_OPTIONS = ("labels", "label_token_ids", "item_suffix", "max_item_tokens", "truncate")
PAIRS, REQUESTS = "pairs", "requests"
# Validation runs over every request, in order, before any is scored: a request that is always
# invalid, put last, makes `score_batch` a validator that never runs the model.
_SENTINEL = {"query": None, "items": []}
_LOCATED = re.compile(r"^requests\[(\d+)\](?:\.(.*))?$")


class JobConfigError(ValidationError):
    """A job setting every row would fail on (its labels, template, options, columns)."""


@attrs.frozen
class RowError:
    """A row that could not be scored: its number, ids and the validation error."""

    row: int
    ids: dict[str, Any]
    code: str
    message: str
    param: str | None

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


class RowFailed(Exception):
    """A row failed under `on_error="fail"`."""

    def __init__(self, error: RowError):
        super().__init__(f"row {error.row} {error.ids or ''}: {error.message} [code {error.code}]")
        self.error = error


def _optional_tuple(value: Any) -> tuple | None:
    """A list of labels as a tuple; a lone string is refused (it would become its characters)."""
    if value is None:
        return None
    if isinstance(value, str | bytes):
        raise JobConfigError(
            "invalid_argument", f"labels must be a list, got the string {value!r}", "labels"
        )
    return tuple(value)


@attrs.frozen(kw_only=True)
class Spec:
    """What to score in a table, and how: the columns, the labels and the score options.

    Attributes:
        query_column: the query column (text, or token ids).
        item_column: the item column: one item per row (pair rows) or a list of items (request
            rows); default "item" if the table has one, else "items".
        id_columns: columns carried through to the output, before the scores.
        labels, label_token_ids: the labels of every row (at most one of them); neither: each
            row's own, from a `labels` or `label_token_ids` column.
        template: a `tpuscore.api.templates` name that renders queries and items and supplies
            the labels and item suffix, as `Scorer.rank` takes it.
        instruction: the template's instruction (default the template's own).
        item_suffix, max_item_tokens, truncate, item_first: as `Scorer.score` takes them, for
            every row (None: a row's own column of that name, or the default).
    """

    query_column: str = "query"
    item_column: str | None = None
    id_columns: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    labels: tuple[str, ...] | None = attrs.field(default=None, converter=_optional_tuple)
    label_token_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_optional_tuple)
    template: str | None = None
    instruction: str | None = None
    item_suffix: str | None = None
    max_item_tokens: int | None = None
    truncate: str | None = None
    item_first: bool = False

    def options(self) -> dict[str, Any]:
        """The score options the job sets for every row."""
        options: dict[str, Any] = {}
        if self.template is not None:
            tmpl = templates.get(self.template)
            for name in ("labels", "label_token_ids", "item_suffix"):
                if getattr(self, name) is not None:
                    raise JobConfigError(
                        "invalid_argument",
                        f"template {tmpl.name!r} supplies the labels {list(tmpl.labels)} and the "
                        f"item suffix; do not also give {name}",
                        name,
                    )
            options.update(labels=list(tmpl.labels), item_suffix=tmpl.item_suffix)
        elif self.instruction is not None:
            raise JobConfigError(
                "invalid_argument", "instruction is only used with a template", "instruction"
            )
        if self.labels is not None and self.label_token_ids is not None:
            raise JobConfigError(
                "invalid_argument", "give labels or label_token_ids, not both", "labels"
            )
        for name in ("labels", "label_token_ids"):
            if getattr(self, name) is not None:
                options[name] = list(getattr(self, name))
        for name in ("item_suffix", "max_item_tokens", "truncate"):
            if getattr(self, name) is not None:
                options[name] = getattr(self, name)
        if self.item_first:
            options["item_first"] = True
        return options

    def layout(self, schema: pa.Schema) -> Layout:
        """How this spec reads a table of `schema`; a missing column or a bad setting raises
        `JobConfigError`."""
        options = self.options()
        names = schema.names
        item_column = self.item_column
        if item_column is None:
            item_column = "item" if "item" in names else "items"
        for param, column in [("query_column", self.query_column), ("item_column", item_column)]:
            if column not in names:
                raise JobConfigError(
                    "missing_column",
                    f"the table has no {param.split('_')[0]} column {column!r}; its columns are "
                    f"{', '.join(names)}",
                    param,
                )
        for column in self.id_columns:
            if column not in names:
                raise JobConfigError(
                    "missing_column",
                    f"the table has no id column {column!r}; its columns are {', '.join(names)}",
                    "id_columns",
                )
        shape = REQUESTS if _holds_items(schema.field(item_column).type) else PAIRS
        row_options = tuple(n for n in ROW_OPTIONS if n in names and n not in options)
        if "labels" in options or "label_token_ids" in options:
            row_options = tuple(n for n in row_options if n not in ("labels", "label_token_ids"))
        fixed = options.get("labels", options.get("label_token_ids"))
        return Layout(
            shape=shape,
            query_column=self.query_column,
            item_column=item_column,
            id_columns=self.id_columns,
            options=options,
            row_options=row_options,
            label_names=None if fixed is None else label_names(fixed),
            template=self.template,
            instruction=self.instruction,
        )


def _holds_items(t: pa.DataType) -> bool:
    """Whether an item column of type t holds a list of items (text or token-id lists) per row,
    rather than one item (text, or one token-id list)."""
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        return False
    inner = t.value_type
    return not pa.types.is_integer(inner)


def label_names(labels: Sequence[Any]) -> list[str]:
    """Column-name parts for the labels: each label's text without surrounding spaces where all
    are distinct words (" yes", " no" -> yes, no), else their positions (0, 1, ...)."""
    names = [str(label).strip() for label in labels]
    if all(re.fullmatch(r"\w+", n) for n in names) and len(set(names)) == len(names):
        return names
    return [str(i) for i in range(len(labels))]


@attrs.frozen(kw_only=True)
class Layout:
    """A spec resolved against a table's schema."""

    shape: str
    query_column: str
    item_column: str
    id_columns: tuple[str, ...]
    options: dict[str, Any]
    row_options: tuple[str, ...]
    label_names: list[str] | None  # None: labels per row, in list columns
    template: str | None
    instruction: str | None

    @property
    def columns(self) -> list[str]:
        """The input columns this layout reads."""
        needed = [*self.id_columns, self.query_column, self.item_column, *self.row_options]
        return list(dict.fromkeys(needed))

    def score_columns(self) -> list[str]:
        if self.label_names is None:
            return ["logprobs", "scores"]
        return [f"{kind}_{name}" for kind in ("logprob", "score") for name in self.label_names]


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
    """One request and the rows it scores (one row, or a query's pair rows)."""

    rows: list[int]
    request: dict[str, Any]


def score_rows(
    scorer: Any,
    layout: Layout,
    batch: pa.RecordBatch | pa.Table,
    *,
    first_row: int = 0,
    backend: str | None = None,
    fail_fast: bool = False,
) -> Scored:
    """Score `batch`'s rows with `scorer.score_batch` in one call.

    Args:
        scorer: a `tpuscore.Scorer`.
        layout: `Spec.layout` of the batch's schema.
        batch: rows holding at least `layout.columns`.
        first_row: the number of the batch's first row in its table, for error records.
        backend: as `score_batch` takes it.
        fail_fast: raise `RowFailed` at the first bad row instead of setting it aside.

    Raises:
        JobConfigError: an error every row would meet (a job-wide label that is not one token).
        RowFailed: with fail_fast, a bad row.
        ValidationError: the backend cannot run these requests (`unknown_backend`).
    """
    n = batch.num_rows
    ids = {c: batch.column(c).to_pylist() for c in layout.id_columns}
    errors: dict[int, RowError] = {}

    def reject(row: int, e: ValidationError) -> None:
        error = RowError(first_row + row, {c: v[row] for c, v in ids.items()}, *_unlocated(e))
        if fail_fast:
            raise RowFailed(error)
        errors[row] = error

    units = _units(layout, batch, reject)
    try:
        results = scorer.score_batch([u.request for u in units], backend=backend)
    except ValidationError as e:  # validation runs first: nothing was scored
        k, _ = _location(e)
        repaired = _repair(scorer, units[k], e, layout, reject)
        rest = _runnable(scorer, units[k + 1 :], layout, reject)
        units = units[:k] + ([repaired] if repaired is not None else []) + rest
        results = scorer.score_batch([u.request for u in units], backend=backend)

    backends: collections.Counter = collections.Counter()
    logprobs: list[Any] = [None] * n  # per row: [labels] (pairs) or [items, labels]
    for unit, result in zip(units, results, strict=True):
        backends[result.backend] += len(result.logprobs)
        if layout.shape == PAIRS:
            for row, lp in zip(unit.rows, result.logprobs, strict=True):
                logprobs[row] = lp
        else:
            logprobs[unit.rows[0]] = result.logprobs
    failed = np.zeros(n, bool)
    failed[list(errors)] = True
    columns = {c: batch.column(c) for c in layout.id_columns}
    columns.update(_score_columns(layout, logprobs))
    table = pa.table(columns)
    return Scored(table, failed, [errors[r] for r in sorted(errors)], backends)


def _units(layout: Layout, batch, reject) -> list[_Unit]:
    """The batch's rows as requests: a row's own options, the template rendered, pair rows of
    one query and options grouped."""
    n = batch.num_rows
    queries = batch.column(layout.query_column).to_pylist()
    items = batch.column(layout.item_column).to_pylist()
    own = {name: batch.column(name).to_pylist() for name in layout.row_options}
    tmpl = templates.get(layout.template) if layout.template is not None else None
    rows, options = [], []
    for r in range(n):
        opts = {name: values[r] for name, values in own.items() if values[r] is not None}
        if tmpl is not None:
            try:
                queries[r], items[r] = _render(tmpl, layout, queries[r], items[r])
            except ValidationError as e:
                reject(r, e)
                continue
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


def _runnable(scorer: Any, units: list[_Unit], layout: Layout, reject) -> list[_Unit]:
    """`units` without their bad rows (each passed to `reject`), found by validation alone: the
    model runs nothing here. Linear in the units, whatever the number of bad rows."""
    kept: list[_Unit] = []
    start = 0
    while start < len(units):
        located = _first_invalid(scorer, [u.request for u in units[start:]])
        if located is None:
            kept.extend(units[start:])
            break
        k, e = located
        kept.extend(units[start : start + k])
        repaired = _repair(scorer, units[start + k], e, layout, reject)
        if repaired is not None:
            kept.append(repaired)
        start += k + 1
    return kept


def _first_invalid(scorer: Any, requests: list[dict]) -> tuple[int, ValidationError] | None:
    """(index, error) of the first request `score_batch` refuses, or None: all are valid."""
    try:
        scorer.score_batch([*requests, _SENTINEL])
    except ValidationError as e:
        index, _ = _location(e)
        return None if index == len(requests) else (index, e)
    raise RuntimeError("score_batch accepted a request without a query")


def _location(e: ValidationError) -> tuple[int, str]:
    """(request index, parameter within it) of a `score_batch` error; one that names no request
    is not a row's fault and is raised again."""
    match = _LOCATED.match(e.param or "")
    if match is None:
        raise e
    return int(match.group(1)), match.group(2) or ""


def _unlocated(e: ValidationError) -> tuple[str, str, str | None]:
    """(code, message, param) of a `score_batch` error without its "requests[i]" location."""
    _, param = _location(e)
    message = re.sub(r"^requests\[\d+\]: ", "", str(e))
    return e.code, message, param or None


def _repair(scorer: Any, unit: _Unit, e: ValidationError, layout: Layout, reject) -> _Unit | None:
    """The unit without its bad rows (rejected), or None when none is left. The error is the
    job's when it names an option the job set for every row."""
    _, param = _location(e)
    name = re.split(r"[.\[]", param, maxsplit=1)[0]
    if name in layout.options:
        code, message, param = _unlocated(e)
        raise JobConfigError(code, message, param)
    if len(unit.rows) == 1 or not name.startswith("items"):
        for row in unit.rows:
            reject(row, e)
        return None
    # A query's pair rows: find the bad items one at a time, each validated on its own.
    singles = [{**unit.request, "items": [item]} for item in unit.request["items"]]
    good = []
    start = 0
    while start < len(singles):
        located = _first_invalid(scorer, singles[start:])
        if located is None:
            good.extend(range(start, len(singles)))
            break
        k, single_error = located
        good.extend(range(start, start + k))
        reject(unit.rows[start + k], single_error)
        start += k + 1
    if len(good) == len(singles):  # no item is bad alone: the error is the request's
        for row in unit.rows:
            reject(row, e)
        return None
    if not good:
        return None
    request = {**unit.request, "items": [unit.request["items"][g] for g in good]}
    return _Unit([unit.rows[g] for g in good], request)


def _score_columns(layout: Layout, logprobs: list[Any]) -> dict[str, pa.Array]:
    """Per-row logprobs (None for a failed row) as the output's score columns."""
    n = len(logprobs)
    if layout.label_names is None:  # labels per row: list columns
        lp = [None if x is None else np.asarray(x, np.float32) for x in logprobs]
        sm = [None if x is None else scipy.special.softmax(x, axis=-1) for x in lp]
        return {"logprobs": _lists(lp, layout.shape), "scores": _lists(sm, layout.shape)}
    labels = len(layout.label_names)
    columns: dict[str, pa.Array] = {}
    if layout.shape == PAIRS:
        lp = np.full((n, labels), np.nan, np.float32)
        ok = np.array([x is not None for x in logprobs], bool)
        if ok.any():
            lp[ok] = np.stack([x for x in logprobs if x is not None])
        sm = scipy.special.softmax(lp, axis=1).astype(np.float32)
        for kind, values in (("logprob", lp), ("score", sm)):
            for j, name in enumerate(layout.label_names):
                columns[f"{kind}_{name}"] = pa.array(values[:, j], mask=~ok)
        return columns
    for kind in ("logprob", "score"):
        for j, name in enumerate(layout.label_names):
            per_row = []
            for x in logprobs:
                if x is None:
                    per_row.append(None)
                    continue
                x = np.asarray(x, np.float32).reshape(-1, labels)
                v = x if kind == "logprob" else scipy.special.softmax(x, axis=1)
                per_row.append(v[:, j].astype(np.float32))
            columns[f"{kind}_{name}"] = pa.array(per_row, type=pa.list_(pa.float32()))
    return columns


def _lists(values: list[Any], shape: str) -> pa.Array:
    """Per-row float arrays (None: null) as list<float32> (pairs) or list<list<float32>>."""
    kind = pa.list_(pa.float32()) if shape == PAIRS else pa.list_(pa.list_(pa.float32()))
    return pa.array([None if v is None else v.astype(np.float32).tolist() for v in values], kind)
