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


def test_a_resume_in_another_precision_names_it(scorer, checkpoint_dir, rng, tmp_path):
    """mixed keeps float32's dtype for attention and stores other weights: the refusal names the
    precision, not only the weights' hash."""
    pq.write_table(pairs_table(rng, 10), tmp_path / "pairs.parquet")
    interrupted(scorer, tmp_path / "pairs.parquet", tmp_path / "out")
    mixed = load_scorer(checkpoint_dir(CASE), dtype="mixed")
    with pytest.raises(ResumeRefused) as refused:
        score_table(tmp_path / "pairs.parquet", tmp_path / "out", scorer=mixed, **KWARGS)
    assert ("model.dtype", "float32", "mixed") in refused.value.changed


def test_missing_or_damaged_shards_are_scored_again(scorer, rng, tmp_path):
    from pathlib import Path

    from tpuscore.jobs.job import output_paths

    table = pairs_table(rng, 15).to_pydict()
    table["item_text"][7] = None  # an error in the middle shard
    table["item_text"][12] = None
    pq.write_table(pa.table(table), tmp_path / "pairs.parquet")
    run = lambda output: score_table(tmp_path / "pairs.parquet", output, scorer=scorer, **KWARGS)  # noqa: E731
    run(tmp_path / "whole")
    whole = read(tmp_path / "whole")
    whole_errors = Path(output_paths(str(tmp_path / "whole"))[2]).read_bytes()
    output = tmp_path / "out"
    directory, _, errors_path = output_paths(str(output))
    assert run(output).rows == 15
    shard = [Path(directory, f"part-0000{i}.parquet") for i in range(3)]

    def damages():
        yield "deleted", lambda: shard[1].unlink()
        yield "truncated", lambda: shard[0].write_bytes(shard[0].read_bytes()[:-9])
        data = bytearray(shard[2].read_bytes())
        data[len(data) // 2] ^= 0x55  # one byte flipped, the size unchanged
        yield "corrupted", lambda: shard[2].write_bytes(bytes(data))

    for what, damage in damages():
        damage()
        again = run(output)
        assert (again.repaired, again.rows, again.shards) == (1, 5, 1), what
        assert read(output).equals(whole), what
        assert Path(errors_path).read_bytes() == whole_errors, what
        assert run(output).rows == 0  # complete, and verified so
    # The errors file cut inside the second shard's line: from that shard on, scored again.
    Path(errors_path).write_bytes(whole_errors[: whole_errors.index(b"\n") - 5])
    again = run(output)
    assert (again.rows, again.shards, again.resumed_rows) == (10, 2, 5)
    assert read(output).equals(whole) and Path(errors_path).read_bytes() == whole_errors


@pytest.mark.parametrize("text", ["[]", "null", '"a manifest"', '{"format": "tpuscore-job/2"}'])
def test_a_manifest_that_is_not_a_jobs_is_refused_as_unreadable(scorer, rng, tmp_path, text):
    """Valid JSON of another shape is `manifest_unreadable` (a JobConfigError), not an
    AttributeError; overwrite starts the job again."""
    from tpuscore.jobs import JobConfigError

    pq.write_table(pairs_table(rng, 5), tmp_path / "pairs.parquet")
    (tmp_path / "out").mkdir()
    (tmp_path / "out.manifest.json").write_text(text)
    with pytest.raises(JobConfigError) as refused:
        score_table(tmp_path / "pairs.parquet", tmp_path / "out", scorer=scorer, **KWARGS)
    assert (refused.value.code, refused.value.param) == ("manifest_unreadable", "output")
    again = score_table(
        tmp_path / "pairs.parquet", tmp_path / "out", scorer=scorer, overwrite=True, **KWARGS
    )
    assert again.rows == 5


def test_read_output_names_a_missing_or_damaged_shard(scorer, rng, tmp_path):
    """`read_output` of an output whose committed shard was replaced, deleted or cut short is
    a TableError that says which shard and how to repair it (run the job again)."""
    from tpuscore.jobs import TableError, read_output

    pq.write_table(pairs_table(rng, 10), tmp_path / "pairs.parquet")
    score_table(tmp_path / "pairs.parquet", tmp_path / "out", scorer=scorer, **KWARGS)
    shard = tmp_path / "out" / "part-00001.parquet"
    # Another shard's valid Parquet: read unchecked, its rows would come back twice.
    shard.write_bytes((tmp_path / "out" / "part-00000.parquet").read_bytes())
    with pytest.raises(TableError, match="part-00001.*changed since its commit"):
        read_output(tmp_path / "out")
    shard.write_bytes(shard.read_bytes()[:20])
    with pytest.raises(TableError, match="part-00001"):
        read_output(tmp_path / "out")
    shard.unlink()
    with pytest.raises(TableError, match="part-00001"):
        read_output(tmp_path / "out")
    assert (
        score_table(tmp_path / "pairs.parquet", tmp_path / "out", scorer=scorer, **KWARGS).repaired
        == 1
    )
    assert read_output(tmp_path / "out").num_rows == 10


def test_read_errors_names_a_damaged_errors_file(scorer, rng, tmp_path):
    """An errors file cut short (or gone) is a TableError naming it, as `read_output` names a
    damaged shard, not a JSONDecodeError; the job run again repairs it."""
    from tpuscore.jobs import TableError, read_errors

    table = pairs_table(rng, 10).to_pydict()
    table["item_text"][2] = table["item_text"][7] = None
    pq.write_table(pa.table(table), tmp_path / "pairs.parquet")
    score_table(tmp_path / "pairs.parquet", tmp_path / "out", scorer=scorer, **KWARGS)
    errors = tmp_path / "out.errors.jsonl"
    whole = errors.read_bytes()
    errors.write_bytes(whole[: len(whole) - 30])
    with pytest.raises(TableError, match="out.errors.jsonl"):
        read_errors(tmp_path / "out")
    errors.unlink()
    with pytest.raises(TableError, match="out.errors.jsonl"):
        read_errors(tmp_path / "out")
    score_table(tmp_path / "pairs.parquet", tmp_path / "out", scorer=scorer, **KWARGS)
    assert read_errors(tmp_path / "out")["row"].to_pylist() == [2, 7]
