"""What a job reads and writes: its settings (`Spec`), resolved against a table's schema into a
`Layout` (the query, item, id and option columns; the score columns and their types), and the
errors a job or a row reports (`JobConfigError`, `RowError`)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import attrs
import pyarrow as pa

from tpuscore.api import argument_checks, templates
from tpuscore.api.chunking import Chunking
from tpuscore.api.errors import ValidationError
from tpuscore.api.requests import TRUNCATE_SIDES

# Score options a row may carry in a column of the same name, where the job does not set them
# (`adapter`: one of the scorer's LoRA adapters, by name; null is the base model).
ROW_OPTIONS = ("labels", "label_token_ids", "item_suffix", "max_item_tokens", "truncate", "adapter")
TEXT_ROW_OPTIONS = ("item_suffix", "adapter")
PAIRS, REQUESTS = "pairs", "requests"
# The column of calibrated P(positive) per item, as `ScoreResult.calibrated` and /v1/score's
# `calibrated` carry it (docs/calibration.md): null where the calibration does not cover a row.
CALIBRATED = "calibrated"
# A chunked document's own columns (docs/jobs.md, "Long documents"): its aggregated score, its best
# chunk (an index among its chunks) and that chunk's [start, end) tokens.
CHUNK_COLUMNS = {
    "chunk_score": pa.float32(),
    "best_chunk": pa.int32(),
    "chunk_start": pa.int32(),
    "chunk_end": pa.int32(),
}


class JobConfigError(ValidationError):
    """A job setting every row would fail on (its labels, template, options, columns)."""


@attrs.frozen
class RowError:
    """A row that could not be scored: its number, its ids (as JSON values, `values.to_json`)
    and the validation error."""

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
        ids = f" {error.ids}" if error.ids else ""
        super().__init__(f"row {error.row}{ids}: {error.message} [code {error.code}]")
        self.error = error


def _optional_tuple(value: Any, param: str = "labels") -> tuple | None:
    """A list (the labels, or `param`'s values) as a tuple; a lone string is refused (it would
    become its characters)."""
    if value is None:
        return None
    if isinstance(value, str | bytes):
        raise JobConfigError(
            "invalid_argument", f"{param} must be a list, got the string {value!r}", param
        )
    return tuple(value)


def _id_columns(value: Any) -> tuple[str, ...]:
    return _optional_tuple(value, "id_columns") or ()


def _chunking(value: Any) -> Chunking | None:
    """A `Chunking` from itself or a mapping of its fields (a bad one: `JobConfigError`)."""
    if value is None:
        return None
    try:
        return Chunking.of(value)
    except ValidationError as e:
        raise JobConfigError(e.code, str(e), e.param) from None


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
        chunking: each item a document, scored by its chunks as `Scorer.score(chunking=)`
            scores it (a `Chunking` or a mapping of its fields; docs/chunking.md): the score
            columns hold the best chunk's scores, and four more columns the document's.
    """

    query_column: str = "query"
    item_column: str | None = None
    id_columns: tuple[str, ...] = attrs.field(default=(), converter=_id_columns)
    labels: tuple[str, ...] | None = attrs.field(default=None, converter=_optional_tuple)
    label_token_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_optional_tuple)
    template: str | None = None
    instruction: str | None = None
    item_suffix: str | None = None
    max_item_tokens: int | None = None
    truncate: str | None = None
    item_first: bool = False
    chunking: Chunking | None = attrs.field(default=None, converter=_chunking)

    def options(self, classification: bool = False) -> dict[str, Any]:
        """The score options the job sets for every row (`classification`: for a model that
        scores its own classes, so a template brings its rendering and suffix, not labels)."""
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
            options["item_suffix"] = tmpl.item_suffix
            if not classification:
                options["labels"] = list(tmpl.labels)
        elif self.instruction is not None:
            raise JobConfigError(
                "invalid_argument", "instruction is only used with a template", "instruction"
            )
        if classification:
            for name in ("labels", "label_token_ids"):
                if getattr(self, name) is not None:
                    raise JobConfigError(
                        "labels_on_classification_model",
                        f"{name} were given, but the model has a classification head: it "
                        "scores its own classes; leave out labels and label_token_ids",
                        name,
                    )
        if self.labels is not None and self.label_token_ids is not None:
            raise JobConfigError(
                "invalid_argument", "give labels or label_token_ids, not both", "labels"
            )
        for name in ("labels", "label_token_ids"):
            if getattr(self, name) is not None:
                options[name] = list(getattr(self, name))
        # Checked here, before a model loads, as `score` would check them for every row.
        truncate = self.truncate if self.truncate is not None else TRUNCATE_SIDES[0]
        try:
            argument_checks.check_truncation(self.max_item_tokens, truncate)
        except ValidationError as e:
            raise JobConfigError(e.code, str(e), e.param) from None
        for name in ("item_suffix", "max_item_tokens", "truncate"):
            if getattr(self, name) is not None:
                options[name] = getattr(self, name)
        if self.item_first:
            options["item_first"] = True
        if self.chunking is not None:
            try:
                self.chunking.check_cap(self.max_item_tokens)
            except ValidationError as e:
                raise JobConfigError(e.code, str(e), e.param) from None
        return options

    def item_column_of(self, names: Sequence[str]) -> str:
        """The item column of a table with these column names (its default: item, else items)."""
        if self.item_column is not None:
            return self.item_column
        return "item" if "item" in names else "items"

    def text_columns(self, names: Sequence[str]) -> list[str]:
        """The columns read as text where a table has no types of its own (CSV): the query and
        the item (CSV holds no token-id lists) and the text row options."""
        wanted = [self.query_column, self.item_column_of(names), *TEXT_ROW_OPTIONS]
        return [c for c in dict.fromkeys(wanted) if c in names]

    def layout(
        self, schema: pa.Schema, classes: Sequence[str] | None = None, calibrated: bool = False
    ) -> Layout:
        """How this spec reads a table of `schema`, for a causal LM or (`classes`: its class
        names, `classes_of(scorer)`) a classification model, with a `calibrated` column where
        the scorer has a score calibration; a missing column or a bad setting raises
        `JobConfigError`."""
        classification = classes is not None
        options = self.options(classification)
        names = schema.names
        item_column = self.item_column_of(names)
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
        row_options = tuple(n for n in ROW_OPTIONS if n in names and n not in options)
        read = {self.query_column: "query_column", item_column: "item_column"}
        read |= {c: "id_columns" for c in self.id_columns} | {n: n for n in row_options}
        for column, param in read.items():
            if names.count(column) > 1:
                raise JobConfigError(
                    "duplicate_column",
                    f"the table has {names.count(column)} columns named {column!r}; rename them "
                    "so that the job reads one",
                    param,
                )
        shape = REQUESTS if _holds_items(schema.field(item_column).type) else PAIRS
        if classification or "labels" in options or "label_token_ids" in options:
            row_options = tuple(n for n in row_options if n not in ("labels", "label_token_ids"))
        fixed = classes if classification else options.get("labels", options.get("label_token_ids"))
        layout = Layout(
            shape=shape,
            query_column=self.query_column,
            item_column=item_column,
            id_columns=self.id_columns,
            options=options,
            row_options=row_options,
            label_names=None if fixed is None else label_names(fixed),
            classification=classification,
            template=self.template,
            instruction=self.instruction,
            # A chunk's calibrated probability is not its document's: none is written.
            calibrated=calibrated and self.chunking is None,
            chunking=self.chunking,
        )
        _refuse_collisions(layout)
        return layout


# Output columns besides the ids and scores: the job's row number, Ray's error columns.
OUTPUT_COLUMNS = ("row", "error_code", "error")


def _refuse_collisions(layout: Layout) -> None:
    """An id column whose name the output already uses (or given twice) is refused before any
    row is read: the output would hold two columns of one name, or lose one."""
    seen: set[str] = set()
    taken = {*OUTPUT_COLUMNS, *layout.score_columns()}
    for column in layout.id_columns:
        if column in seen or column in taken:
            why = "is given twice" if column in seen else "is also an output column"
            raise JobConfigError(
                "column_collision",
                f"id column {column!r} {why}; the output's columns are row, the id columns, "
                f"{', '.join(layout.score_columns())} (and error_code, error from Ray); rename "
                "it in the input",
                "id_columns",
            )
        seen.add(column)


def _holds_items(t: pa.DataType) -> bool:
    """Whether an item column of type t holds a list of items (text or token-id lists) per row,
    rather than one item (text, or one token-id list)."""
    lists = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)
    if not any(is_list(t) for is_list in lists):
        return False
    inner = t.value_type
    return not pa.types.is_integer(inner)


def classes_of(scorer: Any) -> tuple[str, ...] | None:
    """A classification model's class names (id2label, else their positions); None for a
    causal LM, which is scored by label tokens."""
    config = scorer.config
    if not config.num_labels:
        return None
    return tuple(config.id2label) or tuple(str(i) for i in range(config.num_labels))


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
    classification: bool = False
    calibrated: bool = False  # a `calibrated` column after the scores
    chunking: Chunking | None = None  # items are documents: CHUNK_COLUMNS after the scores

    @property
    def kinds(self) -> tuple[str, str]:
        """The score columns' prefixes: what `ScoreResult.logprobs` holds (log-probabilities,
        or a classification head's logits), then `label_probs` (scores)."""
        return ("logit" if self.classification else "logprob"), "score"

    @property
    def columns(self) -> list[str]:
        """The input columns this layout reads."""
        needed = [*self.id_columns, self.query_column, self.item_column, *self.row_options]
        return list(dict.fromkeys(needed))

    def score_columns(self) -> list[str]:
        """The output's score columns, in order."""
        if self.label_names is None:
            columns = [f"{kind}s" for kind in self.kinds]
        else:
            columns = [f"{kind}_{name}" for kind in self.kinds for name in self.label_names]
        if self.calibrated:
            columns.append(CALIBRATED)
        return [*columns, *CHUNK_COLUMNS] if self.chunking is not None else columns

    def score_schema(self) -> pa.Schema:
        """The score columns' names and types: float32 per (pair row, label), a list of them
        per item for request rows, and one more list level for labels per row; `calibrated`
        and `chunk_score` are one float32 per item (pair row), a list of them per request row,
        and the best chunk's index and span int32 alike."""
        many = self.shape == REQUESTS

        def per_item(t: pa.DataType) -> pa.DataType:
            return pa.list_(t) if many else t

        scores = per_item(pa.float32())
        types = {CALIBRATED: scores, **{c: per_item(t) for c, t in CHUNK_COLUMNS.items()}}
        t = scores if self.label_names is not None else pa.list_(scores)
        return pa.schema([(name, types.get(name, t)) for name in self.score_columns()])
