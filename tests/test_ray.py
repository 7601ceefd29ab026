"""tpuscore.integrations.ray on a local Ray cluster (2 CPUs, one cluster for the module): a
dataset of pair rows scored by actors equals the in-process scorer, ids in place, and a bad row
lands in the error columns instead of failing the dataset."""

import numpy as np
import pyarrow as pa
import pytest

from helpers import start_ray
from test_jobs import CASE, LABELS, pairs_table, reference
from tpuscore.jobs import load_scorer

ray = pytest.importorskip("ray")

SPEC = dict(
    labels=LABELS, query_column="user_text", item_column="item_text", id_columns=["item_id"]
)


@pytest.fixture(scope="module")
def cluster():
    start_ray()
    yield
    ray.shutdown()


@pytest.mark.slow  # a local Ray cluster: its worker processes start and import JAX
def test_a_dataset_scores_as_the_in_process_scorer(cluster, checkpoint_dir, rng):
    from tpuscore.integrations.ray import score_dataset

    table = pairs_table(rng, 37).to_pydict()
    bad = int(rng.integers(0, 37))
    table["item_text"][bad] = None
    dataset = ray.data.from_arrow(pa.table(table)).repartition(3)
    scored = score_dataset(
        dataset,
        model=str(checkpoint_dir(CASE)),
        dtype="float32",
        batch_size=16,
        concurrency=1,
        num_cpus=1,
        **SPEC,
    )
    out = pa.concat_tables(ray.get(scored.to_arrow_refs())).sort_by("item_id")
    assert out.column_names == [
        "item_id", "logprob_a", "logprob_b", "score_a", "score_b", "error_code", "error",
    ]  # fmt: skip
    assert out.column("item_id").to_pylist() == sorted(table["item_id"])  # every row, once
    codes = out.column("error_code").to_pylist()
    assert codes[bad] == "invalid_items" and "None" in out.column("error")[bad].as_py()
    assert codes.count(None) == 36 and out.column("logprob_a")[bad].as_py() is None
    good = [r for r in range(37) if r != bad]
    expected = reference(
        load_scorer(checkpoint_dir(CASE), dtype="float32"),
        [table["user_text"][r] for r in good],
        [table["item_text"][r] for r in good],
    )
    got = np.stack([out.column(c).to_numpy()[good] for c in ("logprob_a", "logprob_b")], 1)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)


def test_score_rows_takes_pandas_and_returns_pandas(checkpoint_dir, rng):
    from tpuscore.integrations.ray import ScoreRows

    table = pairs_table(rng, 5)
    score = ScoreRows(str(checkpoint_dir(CASE)), dtype="float32", **SPEC)
    frame = score(table.to_pandas())
    assert list(frame["item_id"]) == table.column("item_id").to_pylist()
    assert frame["error_code"].isna().all()
    arrow = score(table)
    np.testing.assert_array_equal(
        frame["logprob_a"].to_numpy(), arrow.column("logprob_a").to_numpy()
    )


def test_a_pandas_count_column_with_a_missing_value_is_read_as_counts(checkpoint_dir, rng):
    """pandas holds an int column with a missing value as float64: its whole floats are the
    rows' max_item_tokens, as the same column in Arrow, not an error on every row."""
    from tpuscore.integrations.ray import ScoreRows

    table = pairs_table(rng, 4)
    limits = pa.array([3, None, 2, 5], pa.int64())
    table = table.append_column("max_item_tokens", limits)
    score = ScoreRows(str(checkpoint_dir(CASE)), dtype="float32", **SPEC)
    frame = table.to_pandas()
    assert frame["max_item_tokens"].dtype == np.float64
    from_pandas, from_arrow = score(frame), score(table)
    assert from_pandas["error_code"].isna().all(), list(from_pandas["error"])
    np.testing.assert_array_equal(
        from_pandas["logprob_a"].to_numpy(), from_arrow.column("logprob_a").to_numpy()
    )


def test_an_unknown_backend_fails_the_batch_and_an_adapter_row_is_its_own(checkpoint_dir, rng):
    """A bad setting fails the dataset, not each row; a row naming an adapter the scorer did
    not load is that row's error (the `adapter` column, as a job reads it)."""
    from tpuscore.integrations.ray import ScoreRows
    from tpuscore.jobs import JobConfigError

    table = pairs_table(rng, 3)
    table = table.append_column("adapter", pa.array([None, "legal", None], pa.string()))
    with pytest.raises(JobConfigError) as refused:
        ScoreRows(str(checkpoint_dir(CASE)), dtype="float32", backend="nope", **SPEC)(table)
    assert refused.value.code == "unknown_backend"
    out = ScoreRows(str(checkpoint_dir(CASE)), dtype="float32", **SPEC)(table)
    assert out.column("error_code").to_pylist() == [None, "unknown_adapter", None]


def test_score_dataset_refuses_a_bad_setting_before_any_actor_starts():
    """In the driver, typed, before map_batches: not in each actor as it loads the model."""
    from tpuscore.integrations.ray import score_dataset
    from tpuscore.jobs import JobConfigError

    class Dataset:
        def map_batches(self, *args, **kwargs):
            pytest.fail("map_batches was called")

    with pytest.raises(JobConfigError) as refused:
        score_dataset(Dataset(), labels=" yes")  # a string, not a list of labels
    assert refused.value.param == "labels"
    with pytest.raises(JobConfigError) as refused:
        score_dataset(Dataset(), template="plain", labels=LABELS)
    assert refused.value.param == "labels"
    with pytest.raises(TypeError, match="label"):
        score_dataset(Dataset(), label=LABELS)  # a misspelt argument
