"""Long documents in a job (`chunking=`, `--chunking`): each row's item (or each item of a
request row) scored by its chunks, the row holding its best chunk's scores and the document's
aggregated score, best chunk and span, as `Scorer.score(chunking=)` gives them for the row alone;
Ray Data writes the same through the same `score_rows`."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from test_jobs import LABELS, _text
from tpuscore.integrations.ray import ScoreRows
from tpuscore.jobs import JobConfigError, ResumeRefused, load_scorer, read_output, score_table

CASE = "llama_gqa_untied"
CHUNKING = {"window": 4, "stride": 3, "aggregate": "mean"}


@pytest.fixture(scope="module")
def scorer(checkpoint_dir):
    return load_scorer(checkpoint_dir(CASE), dtype="float32")


def expected(scorer, query, documents, chunking=CHUNKING):
    """`Scorer.score(chunking=)` of the documents alone: per document (best chunk's logprobs,
    its softmax over the labels, the aggregated score, best chunk, start, end)."""
    result = scorer.score(query, documents, labels=LABELS, chunking=chunking, backend="reference")
    first = np.searchsorted(result.document, np.arange(len(documents)))
    best = first + result.best_chunk
    spans = np.array(result.best_span).reshape(-1, 2)
    return (
        result.chunks.logprobs[best],
        result.chunks.label_probs[best],
        result.scores,
        result.best_chunk,
        spans[:, 0],
        spans[:, 1],
    )


def test_pair_rows_hold_each_documents_chunked_score(scorer, checkpoint_dir, rng, tmp_path):
    users = [_text(rng, 2, 6) for _ in range(2)]
    rows = [(u, _text(rng, 1, 14)) for u in (0, 0, 1, 0, 1, 1, 0)]  # some of one chunk, some of 4
    table = pa.table({"query": [users[u] for u, _ in rows], "item": [d for _, d in rows]})
    pq.write_table(table, tmp_path / "pairs.parquet")
    score_table(
        tmp_path / "pairs.parquet", tmp_path / "out", scorer=scorer, labels=LABELS,
        chunking=CHUNKING, shard_rows=4,
    )  # fmt: skip
    out = read_output(tmp_path / "out").sort_by("row")
    assert out.column_names == [
        "row", "logprob_a", "logprob_b", "score_a", "score_b",
        "chunk_score", "best_chunk", "chunk_start", "chunk_end",
    ]  # fmt: skip
    assert out.schema.field("best_chunk").type == pa.int32()
    for r, (u, document) in enumerate(rows):
        raw, scores, score, best, start, end = expected(scorer, users[u], [document])
        got = out.slice(r, 1).to_pylist()[0]
        np.testing.assert_allclose([got["logprob_a"], got["logprob_b"]], raw[0], atol=1e-5)
        np.testing.assert_allclose([got["score_a"], got["score_b"]], scores[0], atol=1e-5)
        assert got["chunk_score"] == pytest.approx(score[0], abs=1e-5)
        assert (got["best_chunk"], got["chunk_start"], got["chunk_end"]) == (
            best[0],
            start[0],
            end[0],
        )
    assert max(out["best_chunk"].to_pylist()) > 0  # documents of several chunks were scored
    # Ray Data's batch function writes the same columns through the same score_rows.
    rows_fn = ScoreRows(str(checkpoint_dir(CASE)), dtype="float32", labels=LABELS,
                        chunking=CHUNKING, backend="reference")  # fmt: skip
    by_ray = rows_fn(table)
    for name in out.column_names[1:]:
        np.testing.assert_allclose(by_ray[name].to_numpy(), out[name].to_numpy(), atol=1e-5)


def test_request_rows_hold_a_list_per_document_and_bad_rows_are_their_own(scorer, rng, tmp_path):
    documents = [[_text(rng, 1, 12) for _ in range(1 + i % 3)] for i in range(4)]
    queries = [_text(rng, 2, 5) for _ in documents]
    # Row 2 has no items: its own error, the other rows scored.
    items = pa.array(
        [d if r != 2 else None for r, d in enumerate(documents)], pa.list_(pa.string())
    )
    table = pa.table({"query": queries, "items": items})
    pq.write_table(table, tmp_path / "requests.parquet")
    summary = score_table(
        tmp_path / "requests.parquet", tmp_path / "out.jsonl", scorer=scorer, labels=LABELS,
        chunking=CHUNKING,
    )  # fmt: skip
    assert summary.errors == 1
    out = read_output(tmp_path / "out.jsonl").sort_by("row")
    assert out.schema.field("chunk_score").type == pa.list_(pa.float32())
    for r in (0, 1, 3):
        raw, scores, score, best, start, end = expected(scorer, queries[r], documents[r])
        got = out.slice([0, 1, None, 2][r], 1).to_pylist()[0]
        np.testing.assert_allclose(np.array([got["logprob_a"], got["logprob_b"]]).T, raw, atol=1e-5)
        np.testing.assert_allclose(got["chunk_score"], score, atol=1e-5)
        assert got["best_chunk"] == best.tolist()
        assert (got["chunk_start"], got["chunk_end"]) == (start.tolist(), end.tolist())


def test_chunking_settings_are_checked_and_a_resume_under_others_is_refused(scorer, rng, tmp_path):
    table = pa.table({"query": ["a b"] * 3, "item": [_text(rng, 5, 9) for _ in range(3)]})
    pq.write_table(table, tmp_path / "in.parquet")
    run = dict(scorer=scorer, labels=LABELS, shard_rows=2)
    for bad, code, param in [
        ({"window": 0}, "invalid_chunking", "chunking.window"),
        ({"window": 4, "stride": 5}, "invalid_chunking", "chunking.stride"),
        ({"stride": 2}, "invalid_chunking", "chunking.window"),
    ]:
        with pytest.raises(JobConfigError) as e:
            score_table(tmp_path / "in.parquet", tmp_path / "bad", chunking=bad, **run)
        assert (e.value.code, e.value.param) == (code, param)
    with pytest.raises(JobConfigError) as e:  # one label: a chunk's score would always be 1
        score_table(tmp_path / "in.parquet", tmp_path / "bad", chunking=CHUNKING,
                    **{**run, "labels": LABELS[:1]})  # fmt: skip
    assert e.value.param == "labels"
    with pytest.raises(JobConfigError) as e:  # max_item_tokens would cut every chunk
        score_table(tmp_path / "in.parquet", tmp_path / "bad", chunking=CHUNKING,
                    max_item_tokens=2, **run)  # fmt: skip
    assert e.value.param == "max_item_tokens"
    score_table(tmp_path / "in.parquet", tmp_path / "out", chunking=CHUNKING, **run)
    with pytest.raises(ResumeRefused):
        score_table(tmp_path / "in.parquet", tmp_path / "out", chunking={"window": 5}, **run)
    with pytest.raises(ResumeRefused):
        score_table(tmp_path / "in.parquet", tmp_path / "out", **run)
    # A job without chunking records its spec as versions before chunking did, so an output
    # they started resumes.
    score_table(tmp_path / "in.parquet", tmp_path / "plain", **run)
    manifest = json.loads((tmp_path / "plain.manifest.json").read_text())
    assert "chunking" not in manifest["settings"]["spec"]


def test_a_template_renders_each_chunk_as_rank_does(checkpoint_dir, rng, tmp_path):
    """Under a template each chunk is rendered as a document (not the document once, cut
    through its rendering): a classifier's rows hold `Scorer.rank(template=, chunking=)`'s."""
    scorer = load_scorer(checkpoint_dir("qwen2_seq_cls"), dtype="float32")
    queries = [_text(rng, 2, 5) for _ in range(3)]
    documents = [_text(rng, 6, 14) for _ in range(3)]
    pq.write_table(pa.table({"query": queries, "item": documents}), tmp_path / "in.parquet")
    score_table(tmp_path / "in.parquet", tmp_path / "out", scorer=scorer, template="plain",
                chunking=CHUNKING)  # fmt: skip
    out = read_output(tmp_path / "out").sort_by("row").to_pylist()
    for row, query, document in zip(out, queries, documents, strict=True):
        (ranked,) = scorer.rank(query, [document], template="plain", chunking=CHUNKING)
        assert row["chunk_score"] == pytest.approx(ranked.score, abs=1e-5)
        assert (row["best_chunk"], (row["chunk_start"], row["chunk_end"])) == (
            ranked.best_chunk,
            ranked.best_span,
        )
