"""A job's resume is refused when what its output depends on changed since it was written: the
input's content (same path, same row count) or the model (same config, other weights, passed as
`scorer=`); the error says what changed."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from test_jobs import CASE, LABELS, Interrupted, StopAfter, pairs_table, read
from tpuscore.jobs import ResumeRefused, load_scorer, score_table

KWARGS = dict(
    query_column="user_text", item_column="item_text", id_columns=["item_id"], labels=LABELS,
    shard_rows=5,
)  # fmt: skip


@pytest.fixture(scope="module")
def scorer(checkpoint_dir):
    return load_scorer(checkpoint_dir(CASE), dtype="float32")


def interrupted(scorer, input, output, shards=1):
    """A run of the job killed after `shards` committed shards."""
    with pytest.raises(Interrupted):
        score_table(input, output, scorer=StopAfter(scorer, shards), **KWARGS)


def test_a_rewritten_input_is_refused(scorer, rng, tmp_path):
    table = pairs_table(rng, 15)
    pq.write_table(table, tmp_path / "pairs.parquet")
    interrupted(scorer, tmp_path / "pairs.parquet", tmp_path / "out")
    edited = table.to_pydict()
    edited["item_text"] = edited["item_text"][::-1]  # the same rows, reordered
    pq.write_table(pa.table(edited), tmp_path / "pairs.parquet")
    with pytest.raises(ResumeRefused) as refused:
        score_table(tmp_path / "pairs.parquet", tmp_path / "out", scorer=scorer, **KWARGS)
    assert refused.value.code == "output_mismatch"
    changed = [c[0] for c in refused.value.changed]  # the size too, if compression differs
    assert "input_fingerprint.sha256" in changed and all("input_fingerprint" in c for c in changed)
    assert "input_fingerprint.sha256" in str(refused.value)
    # Put back, the same input resumes and finishes as an uninterrupted run.
    pq.write_table(table, tmp_path / "pairs.parquet")
    resumed = score_table(tmp_path / "pairs.parquet", tmp_path / "out", scorer=scorer, **KWARGS)
    assert resumed.resumed_rows == 5 and resumed.rows == 10
    score_table(tmp_path / "pairs.parquet", tmp_path / "whole", scorer=scorer, **KWARGS)
    assert read(tmp_path / "out").equals(read(tmp_path / "whole"))


def test_another_model_passed_as_scorer_is_refused(scorer, checkpoint_dir, rng, tmp_path):
    from hf_reference import make_checkpoint

    pq.write_table(pairs_table(rng, 10), tmp_path / "pairs.parquet")
    interrupted(scorer, tmp_path / "pairs.parquet", tmp_path / "out")
    other = load_scorer(make_checkpoint(tmp_path / "other", CASE, seed=1), dtype="float32")
    assert other.config == scorer.config  # only the weights differ
    with pytest.raises(ResumeRefused) as refused:
        score_table(tmp_path / "pairs.parquet", tmp_path / "out", scorer=other, **KWARGS)
    assert [c[0] for c in refused.value.changed] == ["model.weights_sha256"]
