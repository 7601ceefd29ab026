"""Offline scoring jobs: a table of pairs or requests in, a table of scores out, resumable after
a crash (docs/jobs.md). Needs the `jobs` extra (pyarrow, fsspec)."""

from tpuscore.jobs.job import JobSummary, load_scorer, score_table
from tpuscore.jobs.locking import OutputLocked
from tpuscore.jobs.output import ResumeRefused
from tpuscore.jobs.schemas import read_errors, read_output
from tpuscore.jobs.scoring import score_rows
from tpuscore.jobs.spec import JobConfigError, RowError, RowFailed, Spec, classes_of
from tpuscore.jobs.tables import TableError, open_table

__all__ = [
    "JobConfigError",
    "JobSummary",
    "OutputLocked",
    "ResumeRefused",
    "RowError",
    "RowFailed",
    "Spec",
    "TableError",
    "classes_of",
    "load_scorer",
    "open_table",
    "read_errors",
    "read_output",
    "score_rows",
    "score_table",
]
