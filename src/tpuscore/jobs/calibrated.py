"""A job's score calibration (docs/calibration.md): the scorer's, checked against the job's
template and labels before any row is read, and recorded in the manifest so a resume under
another calibration, or none, is refused."""

from __future__ import annotations

from typing import Any

from tpuscore.api.argument_checks import labels_to_ids
from tpuscore.api.calibration import Calibration, CalibrationMismatch
from tpuscore.api.errors import ValidationError
from tpuscore.jobs.spec import Layout


def checked(scorer: Any, layout: Layout) -> Calibration | None:
    """The scorer's calibration (None: none), refused (`CalibrationMismatch`) under another
    template than it was fitted with (as `tpuscore serve` refuses another --rerank-template) or
    for labels every row is scored with that it does not cover (a column of nulls otherwise).
    With labels per row, a row it does not cover gets a null `calibrated`, as a server request
    with other labels gets none."""
    fitted = scorer.score_calibration
    if fitted is None:
        return None
    if fitted.template is not None:
        fitted.check(template=layout.template)
    if layout.classification:
        ids: list[int] = list(range(scorer.config.num_labels))
    else:
        options = layout.options
        if "labels" not in options and "label_token_ids" not in options:
            return fitted
        try:
            ids = labels_to_ids(
                options.get("label_token_ids"),
                options.get("labels"),
                scorer.tokenizer,
                scorer.config.vocab_size,
            )
        except ValidationError:
            return fitted  # the first shard refuses these labels with the job's own error
    if not fitted.covers(ids, layout.classification):
        raise CalibrationMismatch(
            f"score_calibration was fitted for {_labels(fitted)}, but this job scores "
            f"{'its classes' if layout.classification else f'token ids {ids}'}; every row's "
            "calibrated would be null: fit one for these labels, or leave it out",
            "labels",
        )
    return fitted


def _labels(fitted: Calibration) -> str:
    if fitted.classification:
        return f"a classification model's classes {list(fitted.label_token_ids)}"
    if fitted.labels:
        return f"labels {list(fitted.labels)} (token ids {list(fitted.label_token_ids)})"
    return f"token ids {list(fitted.label_token_ids)}"


def setting(fitted: Calibration | None) -> dict[str, Any]:
    """What the job's settings record of a calibration: the file's whole content, under
    `score_calibration`; nothing without one, so an output written before calibrations were
    recorded resumes as it was."""
    return {} if fitted is None else {"score_calibration": fitted.to_json()}
