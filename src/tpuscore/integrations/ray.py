"""Score a Ray Data dataset of pair or request rows on a cluster: one model per actor.

    import ray
    from tpuscore.integrations.ray import ScoreRows, score_dataset

    ds = ray.data.read_parquet("gs://bucket/pairs/")
    scored = score_dataset(ds, labels=[" yes", " no"], id_columns=["user_id", "item_id"],
                           concurrency=8, num_cpus=4)  # 8 replicas of the model
    scored.write_parquet("gs://bucket/scores/")

`ScoreRows` is the class `Dataset.map_batches` runs in each actor: it loads the model once
(`tpuscore.jobs.load_scorer`) and scores each batch with `tpuscore.jobs.score_rows`, so the
columns out are the job's (`tpuscore job`): the id columns, then the label logprobs and softmax
scores, plus `error_code` and `error`, null on rows that scored and set on rows that failed
validation (whose scores are null). A bad row never fails the dataset; a bad setting (a label
that is not one token, a missing column) does, at the first batch. Needs the `ray` extra.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import pyarrow as pa

from tpuscore.jobs import Spec, calibrated, classes_of, load_scorer, score_rows


class ScoreRows:
    """A callable class for `ray.data.Dataset.map_batches(ScoreRows, fn_constructor_kwargs=...)`.

    Args:
        model, dtype: what `tpuscore.jobs.load_scorer` loads, once per actor (a model path must
            be readable from every node: a shared filesystem, or a hub id each node downloads).
        backend: the backend of every `score_batch` call (default auto).
        scorer_options: more `Scorer.from_pretrained` arguments (mesh, profile, ...).
        score_calibration: a `tpuscore fit-calibration` file fitted for the model (refused,
            `CalibrationMismatch`, otherwise): the rows also get a `calibrated` column, as
            `tpuscore job --score-calibration` writes it (docs/jobs.md).
        **spec: `tpuscore.jobs.Spec`'s fields: query_column, item_column, id_columns, labels,
            label_token_ids, template, instruction, item_suffix, max_item_tokens, truncate,
            item_first, chunking.
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        dtype: str | None = None,
        backend: str | None = None,
        scorer_options: dict[str, Any] | None = None,
        score_calibration: str | os.PathLike | None = None,
        **spec: Any,
    ):
        self.spec = Spec(**spec)
        self.spec.options()  # a bad setting fails here, before the model loads
        options = dict(scorer_options or {})
        if score_calibration is not None:
            options["score_calibration"] = score_calibration
        self.scorer = load_scorer(model, dtype=dtype, **options)
        self.classes = classes_of(self.scorer)
        self.spec.options(self.classes is not None)  # labels given to a classification model
        self.calibrated = self.scorer.score_calibration is not None
        self.backend = backend

    def __call__(self, batch: Any) -> Any:
        """Score a batch (a pyarrow Table, a pandas DataFrame or a dict of columns); returns the
        same kind."""
        kind = "arrow"
        if isinstance(batch, dict):
            kind, table = "dict", pa.table(batch)
        elif isinstance(batch, pa.Table):
            table = batch
        else:
            kind, table = "pandas", pa.Table.from_pandas(batch, preserve_index=False)
        layout = self.spec.layout(table.schema, self.classes, self.calibrated)
        calibrated.checked(self.scorer, layout)  # another template or labels: the dataset fails
        scored = score_rows(self.scorer, layout, table, backend=self.backend)
        codes: list[str | None] = [None] * table.num_rows
        messages: list[str | None] = [None] * table.num_rows
        for error in scored.errors:
            codes[error.row] = error.code
            messages[error.row] = error.message
        out = scored.table.append_column("error_code", pa.array(codes, pa.string()))
        out = out.append_column("error", pa.array(messages, pa.string()))
        if kind == "pandas":
            return out.to_pandas()
        if kind == "dict":
            return {
                name: out.column(name).to_numpy(zero_copy_only=False) for name in out.schema.names
            }
        return out


def score_dataset(
    dataset: Any,
    *,
    concurrency: int | tuple[int, int] = 1,
    batch_size: int = 1024,
    num_cpus: float | None = None,
    num_gpus: float | None = None,
    resources: dict[str, float] | None = None,
    **kwargs: Any,
) -> Any:
    """`dataset.map_batches(ScoreRows, ...)`: the scored dataset, lazily, as Ray Data is.

    Args:
        dataset: a `ray.data.Dataset` of pair or request rows.
        concurrency: the number of actors (model replicas), or (min, max) to autoscale.
        batch_size: rows per batch, and so per `score_batch` call.
        num_cpus, num_gpus, resources: what each actor holds, as Ray takes them; a TPU host's
            chips are a custom resource, e.g. `resources={"TPU": 4}` for a v5e-4 host.
        **kwargs: `ScoreRows`' arguments (model, labels, id_columns, ...).
    """
    # ScoreRows' own arguments, not the Spec's: read off its signature, so they cannot drift.
    scorer_arguments = set(inspect.signature(ScoreRows).parameters) - {"spec"}
    # A bad setting or a misspelt argument fails here, in the driver, before any actor loads.
    Spec(**{k: v for k, v in kwargs.items() if k not in scorer_arguments}).options()
    remote_args: dict[str, Any] = {}
    if num_cpus is not None:
        remote_args["num_cpus"] = num_cpus
    if num_gpus is not None:
        remote_args["num_gpus"] = num_gpus
    if resources:
        remote_args["resources"] = resources
    return dataset.map_batches(
        ScoreRows,
        fn_constructor_kwargs=kwargs,
        concurrency=concurrency,
        batch_size=batch_size,
        batch_format="pyarrow",
        **remote_args,
    )
