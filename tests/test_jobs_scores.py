"""A job and Ray Data write what `Scorer.score` returns for the same rows, and name it: for a
causal LM the label log-probabilities and their softmax over the labels; for a classification
head (one logit, three classes) its logits and its class probabilities (the sigmoid of a single
logit, else the softmax), never a softmax over one class."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from test_jobs import LABELS, _text, pairs_table
from tpuscore.jobs import JobConfigError, load_scorer, score_table

CASES = {  # case -> (job labels, output columns after the ids)
    "llama_gqa_untied": (LABELS, ["logprob_a", "logprob_b", "score_a", "score_b"]),
    "llama_seq_cls": (None, ["logit_LABEL_0", "score_LABEL_0"]),
    "qwen2_seq_cls": (
        None,
        [f"{kind}_{c}" for kind in ("logit", "score") for c in ("negative", "neutral", "positive")],
    ),
}


@pytest.fixture(scope="module")
def job_scorers(checkpoint_dir):
    built = {}

    def get(case):
        if case not in built:
            built[case] = load_scorer(checkpoint_dir(case), dtype="float32")
        return built[case]

    return get


def expected_rows(scorer, queries, items, labels):
    """`Scorer.score`'s (logprobs, scores) of each (query, item) pair on its own, its softmax
    applied (the softmax over the labels, or a classification model's class probabilities), as
    [rows, labels] arrays: one `score_batch` call, which returns `score`'s result per request."""
    requests = [
        {"query": q, "items": [it], "labels": labels, "apply_softmax": True}
        for q, it in zip(queries, items, strict=True)
    ]
    results = scorer.score_batch(requests, backend="reference")
    return np.stack([r.logprobs[0] for r in results]), np.stack([r.scores[0] for r in results])


def columns(table, names):
    """[rows, len(names)] float values of the columns named."""
    return np.stack([table.column(n).to_numpy(zero_copy_only=False) for n in names], 1)


@pytest.mark.parametrize("case", CASES)
def test_pair_rows_hold_what_score_returns(case, job_scorers, rng, tmp_path):
    scorer, (labels, names) = job_scorers(case), CASES[case]
    table = pairs_table(rng, 14, users=3)
    pq.write_table(table, tmp_path / "pairs.parquet")
    score_table(
        tmp_path / "pairs.parquet", tmp_path / "out", scorer=scorer, labels=labels,
        query_column="user_text", item_column="item_text", id_columns=["item_id"], shard_rows=7,
    )  # fmt: skip
    out = pq.read_table(tmp_path / "out").sort_by("row")
    assert out.column_names == ["row", "item_id", *names]
    half = len(names) // 2
    raw, scores = expected_rows(
        scorer, table["user_text"].to_pylist(), table["item_text"].to_pylist(), labels
    )
    np.testing.assert_allclose(columns(out, names[:half]), raw, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(columns(out, names[half:]), scores, atol=1e-5, rtol=1e-5)
    if half == 1:  # one logit: its sigmoid, not a softmax over one class (1.0)
        assert not np.allclose(columns(out, names[half:]), 1.0)


@pytest.mark.parametrize("case", CASES)
def test_request_rows_hold_what_score_returns(case, job_scorers, rng, tmp_path):
    scorer, (labels, names) = job_scorers(case), CASES[case]
    rows = [
        {"qid": i, "query": _text(rng, 2, 9), "items": [_text(rng, 1, 5) for _ in range(1 + i % 3)]}
        for i in range(5)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "requests.parquet")
    score_table(
        tmp_path / "requests.parquet", tmp_path / "out", scorer=scorer, labels=labels,
        id_columns=["qid"], shard_rows=3,
    )  # fmt: skip
    out = pq.read_table(tmp_path / "out").sort_by("row")
    assert out.column_names == ["row", "qid", *names]
    half = len(names) // 2
    requests = [{**r, "labels": labels, "apply_softmax": True} for r in rows]
    requests = [{k: v for k, v in r.items() if k != "qid"} for r in requests]
    results = scorer.score_batch(requests, backend="reference")  # each as `score` returns it
    for result, got in zip(results, out.to_pylist(), strict=True):
        raw, scores = result.logprobs, result.scores
        np.testing.assert_allclose([got[n] for n in names[:half]], raw.T, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose([got[n] for n in names[half:]], scores.T, atol=1e-5, rtol=1e-5)


def test_ray_rows_hold_what_score_returns(job_scorers, checkpoint_dir, rng):
    """`ScoreRows` (what each Ray actor runs) on a one-logit model: its logits and sigmoid."""
    from tpuscore.integrations.ray import ScoreRows

    table = pairs_table(rng, 6, users=2)
    score = ScoreRows(
        str(checkpoint_dir("llama_seq_cls")), dtype="float32", query_column="user_text",
        item_column="item_text", id_columns=["item_id"],
    )  # fmt: skip
    out = score(table)
    names = CASES["llama_seq_cls"][1]
    assert out.column_names == ["item_id", *names, "error_code", "error"]
    raw, scores = expected_rows(
        job_scorers("llama_seq_cls"),
        table["user_text"].to_pylist(),
        table["item_text"].to_pylist(),
        None,
    )
    np.testing.assert_allclose(columns(out, names), np.concatenate([raw, scores], 1), atol=1e-5)


def test_labels_on_a_classification_model_stop_the_job(job_scorers, rng, tmp_path):
    pq.write_table(pairs_table(rng, 3), tmp_path / "pairs.parquet")
    with pytest.raises(JobConfigError) as refused:
        score_table(
            tmp_path / "pairs.parquet", tmp_path / "out", scorer=job_scorers("qwen2_seq_cls"),
            labels=LABELS, query_column="user_text", item_column="item_text",
        )  # fmt: skip
    assert (refused.value.code, refused.value.param) == ("labels_on_classification_model", "labels")
