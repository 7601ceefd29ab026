"""tpuscore.jobs: tables of pairs or requests scored into tables of scores, errors set aside,
resumed after an interruption. The scores are checked against the reference backend scoring each
row on its own; the kill test (test_jobs_kill.py) and the memory bound (test_jobs_memory.py)
run the job in subprocesses."""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import scipy.special

from tpuscore import ValidationError
from tpuscore.jobs import JobConfigError, RowFailed, grouping, load_scorer, score_table
from tpuscore.jobs.job import output_paths
from tpuscore.jobs.spec import label_names

CASE = "llama_gqa_untied"
WORDS = [
    "the", "river", "ran", "past", "old", "mill", "under", "stone", "bridge", "apples", "bread",
    "cheese", "park", "light",
]  # fmt: skip
LABELS = ["a", "b"]  # single tokens in the tests' tokenizer


@pytest.fixture(scope="module")
def scorer(checkpoint_dir):
    return load_scorer(checkpoint_dir(CASE), dtype="float32")


def _text(rng, lo, hi):
    return " ".join(rng.choice(WORDS, size=int(rng.integers(lo, hi))))


def pairs_table(rng, n, users=6):
    """Pair rows: runs of one user's rows, and users that come back after others."""
    queries = [_text(rng, 3, 12) for _ in range(users)]
    user = np.sort(rng.integers(0, users, size=n))
    user[rng.random(n) < 0.2] = rng.integers(0, users)  # some rows away from their run
    return pa.table(
        {
            "user_id": user.astype(np.int64),
            "item_id": np.arange(n, dtype=np.int64) * 7,
            "user_text": [queries[u] for u in user],
            "item_text": [_text(rng, 1, 6) for _ in range(n)],
        }
    )


def reference(scorer, queries, items, labels=LABELS):
    """Each pair scored on its own by the reference backend: [rows, labels] logprobs."""
    requests = [
        {"query": q, "items": [it], "labels": labels} for q, it in zip(queries, items, strict=True)
    ]
    results = scorer.score_batch(requests, backend="reference")
    return np.stack([r.logprobs[0] for r in results])


def read(output):
    return pq.read_table(output).sort_by("row")


def test_pair_rows_score_as_the_reference_scores_each_row(scorer, rng, tmp_path):
    table = pairs_table(rng, 57)
    pq.write_table(table, tmp_path / "pairs.parquet")
    summary = score_table(
        tmp_path / "pairs.parquet",
        tmp_path / "scores.parquet",
        scorer=scorer,
        query_column="user_text",
        item_column="item_text",
        id_columns=["user_id", "item_id"],
        labels=LABELS,
        shard_rows=20,
    )
    out = pq.read_table(tmp_path / "scores.parquet")  # the directory, as any reader reads it
    assert out.column_names == [
        "row", "user_id", "item_id", "logprob_a", "logprob_b", "score_a", "score_b",
    ]  # fmt: skip
    assert out.column("row").to_pylist() == list(range(57))  # input order
    assert out.column("item_id").to_pylist() == table.column("item_id").to_pylist()
    assert out.column("user_id").to_pylist() == table.column("user_id").to_pylist()
    expected = reference(
        scorer, table.column("user_text").to_pylist(), table.column("item_text").to_pylist()
    )
    got = np.stack([out.column("logprob_a").to_numpy(), out.column("logprob_b").to_numpy()], 1)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    softmax = np.stack([out.column("score_a").to_numpy(), out.column("score_b").to_numpy()], 1)
    np.testing.assert_allclose(softmax, scipy.special.softmax(expected, axis=1), atol=1e-5)
    assert (summary.rows, summary.errors, summary.shards) == (57, 0, 3)
    assert sum(summary.backends.values()) == 57
    assert sorted(os.listdir(tmp_path / "scores.parquet")) == [
        "part-00000.parquet", "part-00001.parquet", "part-00002.parquet",
    ]  # fmt: skip
    assert "57 rows, 0 errors" in summary.line()


def test_request_rows_with_labels_per_row_from_json_lines(scorer, rng, tmp_path):
    rows = [
        {
            "qid": f"q{i}",
            "query": _text(rng, 2, 9),
            "items": [_text(rng, 1, 5) for _ in range(int(rng.integers(0, 4)))],
            "labels": [["a", "b"], ["b", "c", "a"]][i % 2],
        }
        for i in range(9)
    ]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    score_table(
        f"file://{tmp_path}/requests.jsonl",
        tmp_path / "scores.jsonl",
        scorer=scorer,
        id_columns=["qid"],
        shard_rows=4,
    )
    directory = tmp_path / "scores.jsonl"
    out = [
        json.loads(line)
        for name in sorted(os.listdir(directory))
        for line in (directory / name).read_text().splitlines()
    ]
    assert [o["qid"] for o in out] == [r["qid"] for r in rows]
    for row, o in zip(rows, out, strict=True):
        assert list(o) == ["row", "qid", "logprobs", "scores"]
        if not row["items"]:
            assert o["logprobs"] == []
            continue
        expected = reference(
            scorer, [row["query"]] * len(row["items"]), row["items"], row["labels"]
        )
        np.testing.assert_allclose(o["logprobs"], expected, atol=1e-5, rtol=0)
        np.testing.assert_allclose(o["scores"], scipy.special.softmax(expected, 1), atol=1e-5)


def test_a_fixed_size_list_of_texts_is_each_rows_items(scorer, rng, tmp_path):
    """An item column of fixed_size_list<string> (what numpy arrays of texts become) holds
    request rows, as a list<string> column does, not one item per row."""
    queries = [_text(rng, 2, 9) for _ in range(3)]
    items = [[_text(rng, 1, 5) for _ in range(2)] for _ in queries]
    column = pa.FixedSizeListArray.from_arrays(pa.array(sum(items, [])), 2)
    pq.write_table(pa.table({"query": queries, "items": column}), tmp_path / "in.parquet")
    score_table(tmp_path / "in.parquet", tmp_path / "out", scorer=scorer, labels=LABELS)
    out = read(tmp_path / "out")
    got = np.stack([out["logprob_a"].to_pylist(), out["logprob_b"].to_pylist()], -1)
    for query, row_items, row in zip(queries, items, got, strict=True):
        expected = reference(scorer, [query] * 2, row_items)
        np.testing.assert_allclose(row, expected, atol=1e-5, rtol=0)


def test_bad_rows_go_to_the_errors_file_and_the_rest_is_scored(scorer, rng, tmp_path):
    table = pairs_table(rng, 30).to_pydict()
    table["item_text"][4] = None  # not text
    table["user_text"][11], table["item_text"][11] = "", ""  # nothing to score after
    table["item_text"][12] = "x" * 600  # longer than the model's 512 positions
    pq.write_table(pa.table(table), tmp_path / "pairs.parquet")
    output = tmp_path / "scores.parquet"
    summary = score_table(
        tmp_path / "pairs.parquet",
        output,
        scorer=scorer,
        query_column="user_text",
        item_column="item_text",
        id_columns=["item_id"],
        labels=LABELS,
        shard_rows=8,
    )
    errors = [
        json.loads(line) for line in Path(output_paths(str(output))[2]).read_text().splitlines()
    ]
    assert [(e["row"], e["ids"], e["code"]) for e in errors] == [
        (4, {"item_id": 28}, "invalid_items"),
        (11, {"item_id": 77}, "empty_sequence"),
        (12, {"item_id": 84}, "sequence_too_long"),
    ]
    assert summary.errors == 3 and summary.rows == 30
    out = read(output)
    good = [r for r in range(30) if r not in (4, 11, 12)]
    assert out.column("row").to_pylist() == good
    expected = reference(
        scorer, [table["user_text"][r] for r in good], [table["item_text"][r] for r in good]
    )
    np.testing.assert_allclose(out.column("logprob_a").to_numpy(), expected[:, 0], atol=1e-5)

    with pytest.raises(RowFailed, match="row 4") as failed:
        score_table(
            tmp_path / "pairs.parquet",
            tmp_path / "stop.parquet",
            scorer=scorer,
            query_column="user_text",
            item_column="item_text",
            labels=LABELS,
            on_error="fail",
            shard_rows=8,
        )
    assert failed.value.error.code == "invalid_items"


def test_settings_every_row_would_fail_on_stop_the_job(scorer, rng, tmp_path):
    pq.write_table(pairs_table(rng, 5), tmp_path / "pairs.parquet")
    common = dict(scorer=scorer, query_column="user_text", item_column="item_text")
    with pytest.raises(JobConfigError) as bad:  # " yes" is three tokens here
        score_table(tmp_path / "pairs.parquet", tmp_path / "a.parquet", labels=[" yes"], **common)
    assert bad.value.param == "labels"
    assert not (tmp_path / "a.parquet.errors.jsonl").exists()  # a job's error, not rows'
    with pytest.raises(JobConfigError) as missing:
        score_table(
            tmp_path / "pairs.parquet", tmp_path / "b.parquet", id_columns=["nope"], **common
        )
    assert missing.value.code == "missing_column" and isinstance(missing.value, ValidationError)
    with pytest.raises(JobConfigError, match="template"):
        score_table(
            tmp_path / "pairs.parquet", tmp_path / "c", template="plain", labels=LABELS, **common
        )


@pytest.mark.parametrize("name, value", [("dtype", "bfloat16"), ("model", "another/model")])
def test_a_model_or_dtype_beside_a_scorer_is_refused(scorer, tmp_path, name, value):
    """The scorer's own model and dtype run: another named beside it would be ignored, silently
    (as a score_calibration beside a scorer is refused)."""
    pq.write_table(pa.table({"query": ["a b"], "item": ["c"]}), tmp_path / "pairs.parquet")
    with pytest.raises(JobConfigError) as refused:
        score_table(
            tmp_path / "pairs.parquet", tmp_path / "out", scorer=scorer, labels=LABELS,
            **{name: value},
        )  # fmt: skip
    assert (refused.value.code, refused.value.param) == ("invalid_argument", name)


def test_a_refused_setting_leaves_no_output_to_resume(scorer, rng, tmp_path):
    """A job-wide label every row would fail on is refused before the output is opened, so the
    corrected command starts the job instead of being refused as another job's resume."""
    pq.write_table(pairs_table(rng, 5), tmp_path / "pairs.parquet")
    common = dict(scorer=scorer, query_column="user_text", item_column="item_text")
    for bad in (
        {"labels": [" yes", " no"]},  # three tokens
        {"labels": [b"a", b"b"]},  # not text
        {"labels": LABELS, "backend": "nope"},
    ):
        with pytest.raises(JobConfigError) as refused:
            score_table(tmp_path / "pairs.parquet", tmp_path / "out", **bad, **common)
        assert refused.value.param.startswith(next(k for k in ("backend", "labels") if k in bad))
        assert not (tmp_path / "out.manifest.json").exists()
    summary = score_table(tmp_path / "pairs.parquet", tmp_path / "out", labels=LABELS, **common)
    assert summary.rows == 5 and not summary.resumed_rows


class Interrupted(Exception):
    pass


class StopAfter:
    """A scorer that raises once `calls` run calls have scored: a crash after a shard's
    scoring, before its commit."""

    def __init__(self, scorer, calls):
        self.scorer, self.calls = scorer, calls

    def run(self, requests, **kwargs):
        results = self.scorer.run(requests, **kwargs)
        self.calls -= 1
        if self.calls < 0:
            raise Interrupted
        return results

    def __getattr__(self, name):
        return getattr(self.scorer, name)


def test_a_rerun_resumes_after_the_last_committed_shard(scorer, rng, tmp_path):
    table = pairs_table(rng, 45).to_pydict()
    table["item_text"][30] = None
    pq.write_table(pa.table(table), tmp_path / "pairs.parquet")
    kwargs = dict(
        query_column="user_text",
        item_column="item_text",
        id_columns=["item_id"],
        labels=LABELS,
        shard_rows=10,
    )
    whole = score_table(tmp_path / "pairs.parquet", tmp_path / "whole", scorer=scorer, **kwargs)
    output = tmp_path / "resumed"
    directory, manifest_path, errors_path = output_paths(str(output))
    with pytest.raises(Interrupted):
        score_table(tmp_path / "pairs.parquet", output, scorer=StopAfter(scorer, 2), **kwargs)
    assert sorted(os.listdir(directory)) == ["part-00000.parquet", "part-00001.parquet"]
    # What a kill leaves between a shard's rename and the manifest's: files past the commit.
    Path(directory, "part-00002.parquet").write_bytes(b"half")
    Path(directory, ".part-00003.parquet.123.tmp").write_bytes(b"half")
    with open(errors_path, "a") as f:
        f.write('{"row": 99, "half": ')
    with pytest.raises(Interrupted):  # shard 3 holds the bad row: its error is committed
        score_table(tmp_path / "pairs.parquet", output, scorer=StopAfter(scorer, 2), **kwargs)
    resumed = score_table(tmp_path / "pairs.parquet", output, scorer=scorer, **kwargs)
    assert resumed.resumed_rows == 40 and resumed.rows == 5 and resumed.shards == 1
    assert read(output).equals(read(tmp_path / "whole"))  # every value, bit for bit
    errors = Path(errors_path).read_text().splitlines()
    assert [json.loads(e)["row"] for e in errors] == [30] and whole.errors == 1
    assert not [n for n in os.listdir(directory) if n.startswith(".")]
    # Finished: a re-run does nothing; other settings are refused; overwrite starts again.
    again = score_table(tmp_path / "pairs.parquet", output, scorer=scorer, **kwargs)
    assert again.rows == 0 and again.resumed_rows == 45
    with pytest.raises(JobConfigError, match="shard_rows") as other:
        score_table(
            tmp_path / "pairs.parquet", output, scorer=scorer, **{**kwargs, "shard_rows": 9}
        )
    assert other.value.code == "output_mismatch"
    assert [c[:3] for c in other.value.changed] == [("shard_rows", 10, 9)]
    fresh = score_table(tmp_path / "pairs.parquet", output, scorer=scorer, overwrite=True, **kwargs)
    assert fresh.rows == 45 and read(output).equals(read(tmp_path / "whole"))


def test_fsspec_urls_and_csv(scorer, rng, tmp_path):
    """A CSV's items of digits are text (pyarrow would infer int64), its ids keep their
    inferred type."""
    import fsspec

    table = pairs_table(rng, 12)
    digits = [str(n) for n in rng.integers(0, 10**6, size=12)]
    table = table.set_column(3, "item_text", pa.array(digits))
    fs = fsspec.filesystem("memory")
    with fs.open("/jobs/pairs.csv", "wb") as f:
        f.write(table.to_pandas().to_csv(index=False).encode())
    summary = score_table(
        "memory://jobs/pairs.csv",
        "memory://jobs/out.jsonl",
        scorer=scorer,
        query_column="user_text",
        item_column="item_text",
        id_columns=["user_id"],
        labels=LABELS,
        shard_rows=5,
    )
    assert summary.rows == 12 and fs.exists("/jobs/out.jsonl.manifest.json")
    lines = [
        json.loads(line)
        for path in sorted(fs.ls("/jobs/out.jsonl", detail=False))
        for line in fs.cat_file(path).decode().splitlines()
    ]
    assert [o["row"] for o in lines] == list(range(12))
    assert [o["user_id"] for o in lines] == table.column("user_id").to_pylist()
    expected = reference(
        scorer, table.column("user_text").to_pylist(), table.column("item_text").to_pylist()
    )
    np.testing.assert_allclose([o["logprob_b"] for o in lines], expected[:, 1], atol=1e-5)


def _jsonl_whose_item_turns_a_number(path):
    """Past pyarrow's first 1 MB block, where the column types were inferred."""
    lines = [json.dumps({"query": "the mill", "item": f"bread {i}"}) for i in range(30000)]
    path.write_text("\n".join([*lines, json.dumps({"query": "the", "item": 5})]) + "\n")


@pytest.mark.parametrize(
    "name, write",
    [
        ("garbage.parquet", lambda p: p.write_bytes(b"PAR1 not parquet PAR1")),
        ("empty.jsonl", lambda p: p.write_text("")),
        ("broken.jsonl", lambda p: p.write_text('{"query": "a", "item": "b"}\n{not json\n')),
        ("retyped.jsonl", _jsonl_whose_item_turns_a_number),
    ],
)
def test_an_input_that_cannot_be_read_is_a_table_error(scorer, tmp_path, name, write):
    """Not pyarrow's own exception: `tpuscore job` reports a TableError as bad input."""
    from tpuscore.jobs import TableError

    write(tmp_path / name)
    with pytest.raises(TableError, match=name):
        score_table(
            tmp_path / name, tmp_path / "out", scorer=scorer, labels=LABELS, shard_rows=50000
        )


def test_grouping_and_label_names():
    assert grouping.group_rows(["q1", "q1", "q2", "q1", "q3"]) == [[0, 1, 3], [2], [4]]
    assert grouping.freeze([[1, 2], {"b": [3]}]) == ((1, 2), (("b", (3,)),))
    assert label_names([" yes", " no"]) == ["yes", "no"]
    assert label_names([" yes", "yes"]) == ["0", "1"]  # not distinct once stripped
    assert label_names([5, 9]) == ["5", "9"]
    assert label_names(["a b", "c"]) == ["0", "1"]


def test_the_job_command(checkpoint_dir, rng, tmp_path, capsys):
    from tpuscore.cli import main

    table = pairs_table(rng, 9).to_pydict()
    table["item_text"][3] = "x" * 600
    pq.write_table(pa.table(table), tmp_path / "pairs.parquet")
    args = [
        "job", str(tmp_path / "pairs.parquet"), "--model", str(checkpoint_dir(CASE)),
        "--dtype", "float32", "--labels", "a", "b", "--query-column", "user_text",
        "--item-column", "item_text", "--id-columns", "user_id,item_id", "--shard-rows", "4",
    ]  # fmt: skip
    assert main([*args, "--output", str(tmp_path / "out.jsonl")]) == 0
    err = capsys.readouterr().err
    assert "tpuscore job: 9 rows, 1 errors" in err and "%|" not in err  # no bar off a terminal
    assert sorted(os.listdir(tmp_path / "out.jsonl")) == [f"part-0000{i}.jsonl" for i in range(3)]
    assert main([*args, "--output", str(tmp_path / "out.jsonl"), "--quiet"]) == 0
    assert capsys.readouterr().err == ""  # finished already, and quiet
    assert main([*args, "--output", str(tmp_path / "stop"), "--on-error", "fail"]) == 2
    assert "row 3" in capsys.readouterr().err
    assert main([*args, "--output", str(tmp_path / "x"), "--query-column", "nope"]) == 2
    assert "no query column 'nope'" in capsys.readouterr().err


def test_the_command_caches_compiles_in_the_user_cache_directory(monkeypatch, tmp_path):
    from tpuscore.engine import compilation_cache

    monkeypatch.delenv(compilation_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    if sys.platform.startswith("linux"):
        assert compilation_cache.command_dir() == str(tmp_path / "tpuscore" / "jax-compilation")
    assert compilation_cache.command_dir(disabled=True) == ""
    monkeypatch.setenv(compilation_cache.ENV, "off")
    assert compilation_cache.command_dir() == "" and compilation_cache.enable("off") is None
    monkeypatch.setenv(compilation_cache.ENV, str(tmp_path / "mine"))
    assert compilation_cache.command_dir() == str(tmp_path / "mine")
    assert compilation_cache.command_dir(disabled=True) == ""  # the flag wins


@pytest.mark.parametrize(
    "id_columns, classes",
    [
        (["row"], None),
        (["user_id", "logprob_b"], None),
        (["score_a"], None),
        (["error"], None),
        (["user_id", "user_id"], None),
        (["logit_positive"], ("negative", "positive")),
    ],
)
def test_id_columns_that_collide_with_the_output_are_refused(id_columns, classes, tmp_path):
    from tpuscore.jobs import Spec

    names = ["user_id", "query", "item", *id_columns]
    schema = pa.schema([(n, pa.string()) for n in dict.fromkeys(names)])
    spec = Spec(id_columns=id_columns, labels=None if classes else LABELS)
    with pytest.raises(JobConfigError) as refused:
        spec.layout(schema, classes)
    assert (refused.value.code, refused.value.param) == ("column_collision", "id_columns")
    assert repr(id_columns[-1]) in str(refused.value)


def test_id_columns_given_as_one_string_are_refused():
    """A lone string is not read as its characters: "ab" would silently carry columns a and b."""
    from tpuscore.jobs import Spec

    with pytest.raises(JobConfigError) as refused:
        Spec(id_columns="ab", labels=LABELS)
    assert (refused.value.code, refused.value.param) == ("invalid_argument", "id_columns")


@pytest.mark.parametrize(
    "names, id_columns, param",
    [
        (["query", "item", "item"], [], "item_column"),
        (["query", "query", "item"], [], "query_column"),
        (["query", "item", "id", "id"], ["id"], "id_columns"),
        (["query", "item", "truncate", "truncate"], [], "truncate"),
    ],
)
def test_a_column_the_job_reads_named_twice_in_the_input_is_refused(names, id_columns, param):
    """Arrow and Parquet allow two columns of one name; which one the job would read is
    ambiguous, so it is refused (not a KeyError from the schema)."""
    from tpuscore.jobs import Spec

    schema = pa.schema([pa.field(n, pa.string()) for n in names])
    with pytest.raises(JobConfigError) as refused:
        Spec(id_columns=id_columns, labels=LABELS).layout(schema)
    assert (refused.value.code, refused.value.param) == ("duplicate_column", param)


def test_a_collision_stops_the_job_before_the_first_row(scorer, tmp_path):
    table = pa.table({"row": [1, 2], "query": ["a b", "c"], "item": ["d", "e"]})
    pq.write_table(table, tmp_path / "pairs.parquet")
    with pytest.raises(JobConfigError, match="'row'"):
        score_table(
            tmp_path / "pairs.parquet", tmp_path / "out", scorer=scorer, labels=LABELS,
            id_columns=["row"],
        )  # fmt: skip
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.manifest.json").exists()


@pytest.mark.parametrize("overwrite", [False, True])
def test_an_output_that_holds_the_input_is_refused(scorer, tmp_path, overwrite):
    """Overwriting an output deletes its directory: one holding the input is refused before
    anything is removed, rather than deleting the input (the refusal without overwrite
    suggests passing it)."""
    (tmp_path / "data").mkdir()
    table = pa.table({"query": ["a b"], "item": ["c"]})
    pq.write_table(table, tmp_path / "data" / "pairs.parquet")
    with pytest.raises(JobConfigError) as refused:
        score_table(
            tmp_path / "data" / "pairs.parquet", tmp_path / "data", scorer=scorer,
            labels=LABELS, overwrite=overwrite,
        )  # fmt: skip
    assert (refused.value.code, refused.value.param) == ("output_holds_input", "output")
    assert pq.read_table(tmp_path / "data" / "pairs.parquet").equals(table)


@pytest.mark.parametrize("output", ["out", "out.jsonl"])
def test_an_empty_input_writes_an_empty_table_with_the_outputs_columns(scorer, tmp_path, output):
    """A reader of the output directory gets the columns (row, ids, scores) with no rows, as for
    a table whose every row failed, not a table of no columns."""
    from tpuscore.jobs import read_output

    schema = pa.schema([("user_id", pa.int64()), ("query", pa.string()), ("item", pa.string())])
    pq.write_table(schema.empty_table(), tmp_path / "none.parquet")
    summary = score_table(
        tmp_path / "none.parquet", tmp_path / output, scorer=scorer, labels=LABELS,
        id_columns=["user_id"],
    )  # fmt: skip
    assert (summary.rows, summary.errors) == (0, 0)
    names = ["row", "user_id", "logprob_a", "logprob_b", "score_a", "score_b"]
    out = read_output(tmp_path / output)
    assert (out.column_names, out.num_rows) == (names, 0)
    if output == "out":
        assert pq.read_table(tmp_path / output).column_names == names
    again = score_table(
        tmp_path / "none.parquet", tmp_path / output, scorer=scorer, labels=LABELS,
        id_columns=["user_id"],
    )  # fmt: skip
    assert (again.rows, again.shards) == (0, 0)  # complete: nothing scored or written again
