"""A job under a score calibration (docs/jobs.md, docs/calibration.md): its output has a
`calibrated` column equal to the fitted map applied to the reference backend's scores, a
calibration for another model, template or labels is refused as `tpuscore serve` refuses it,
and a resume under another calibration, or none, is refused like a resume on another input."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import scipy.special

from test_jobs import CASE, LABELS, pairs_table, read, reference
from tpuscore.api.calibration import Calibration, CalibrationMismatch
from tpuscore.engine.calibration import model_fingerprint
from tpuscore.jobs import JobConfigError, ResumeRefused, load_scorer, score_table

PAIRS = dict(
    labels=LABELS, query_column="user_text", item_column="item_text", id_columns=["item_id"]
)
A, B = 0.7, -0.4  # a Platt map: calibrated = sigmoid(A * z + B)


@pytest.fixture(scope="module")
def scorer(checkpoint_dir):
    return load_scorer(checkpoint_dir(CASE), dtype="float32")


def platt_file(path, scorer, labels=LABELS, template=None, b=B, classification=False):
    """A calibration for `scorer`'s model, written as `tpuscore fit-calibration` writes one."""
    ids = [0] if classification else [scorer.tokenizer.token_to_id(label) for label in labels]
    fitted = Calibration(
        model=model_fingerprint(scorer.engine.model),
        template=template,
        label_token_ids=ids,
        labels=None if classification else labels,
        classification=classification,
        method="platt",
        parameters={"a": A, "b": b},
    )
    fitted.save(path)
    return path


def expected(logprobs):
    """sigmoid(A * z + B), z the first label's log-odds against the second."""
    lp = np.asarray(logprobs, np.float64)
    return scipy.special.expit(A * (lp[:, 0] - lp[:, 1]) + B)


def test_pair_rows_carry_calibrated_as_the_fitted_map_gives_it(
    scorer, checkpoint_dir, rng, tmp_path
):
    table = pairs_table(rng, 11).to_pydict()
    table["item_text"][4] = None  # a bad row: null scores, null calibrated
    pq.write_table(pa.table(table), tmp_path / "pairs.parquet")
    cal = platt_file(tmp_path / "cal.json", scorer)
    summary = score_table(
        tmp_path / "pairs.parquet",
        tmp_path / "out",
        model=checkpoint_dir(CASE),
        dtype="float32",
        score_calibration=cal,
        shard_rows=4,
        **PAIRS,
    )
    assert summary.errors == 1
    out = read(tmp_path / "out")
    assert out.column_names[-1] == "calibrated" and out.schema.field("calibrated").type == "float"
    good = [r for r in range(11) if r != 4]
    lp = reference(
        scorer, [table["user_text"][r] for r in good], [table["item_text"][r] for r in good]
    )
    np.testing.assert_allclose(out.column("calibrated").to_numpy(), expected(lp), atol=2e-5)
    # Without a calibration the output is as before: no calibrated column.
    score_table(tmp_path / "pairs.parquet", tmp_path / "plain", scorer=scorer, **PAIRS)
    assert "calibrated" not in read(tmp_path / "plain").column_names


def test_request_rows_with_labels_the_calibration_does_not_cover_get_null(
    scorer, checkpoint_dir, rng, tmp_path
):
    rows = [
        {"query": "the old mill", "items": ["river", "stone bridge"], "labels": LABELS},
        {"query": "the old mill", "items": ["park"], "labels": LABELS[::-1]},
    ]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cal = platt_file(tmp_path / "cal.json", scorer)
    score_table(
        tmp_path / "requests.jsonl",
        tmp_path / "out.jsonl",
        model=checkpoint_dir(CASE),
        dtype="float32",
        score_calibration=cal,
    )
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl" / "part-00000.jsonl").open()]
    lp = scorer.score_batch([rows[0]], backend="reference")[0].logprobs
    np.testing.assert_allclose(lines[0]["calibrated"], expected(lp), atol=2e-5)
    assert lines[1]["calibrated"] is None  # other labels: not what it was fitted for


def test_a_resume_under_another_calibration_or_none_is_refused(
    scorer, checkpoint_dir, rng, tmp_path
):
    pq.write_table(pairs_table(rng, 6), tmp_path / "pairs.parquet")
    cal = platt_file(tmp_path / "cal.json", scorer)
    other = platt_file(tmp_path / "other.json", scorer, b=B + 1)
    model = checkpoint_dir(CASE)
    with_cal = load_scorer(model, dtype="float32", score_calibration=cal)
    run = dict(input=tmp_path / "pairs.parquet", output=tmp_path / "out", **PAIRS)
    score_table(**run, scorer=with_cal)
    assert score_table(**run, scorer=with_cal).line().startswith("tpuscore job: already complete")
    with pytest.raises(ResumeRefused) as e:
        score_table(**run, scorer=scorer)  # the calibration removed
    assert e.value.code == "output_mismatch" and "score_calibration" in str(e.value)
    assert ("score_calibration", Calibration.load(cal).to_json(), None) in e.value.changed
    with_other = load_scorer(model, dtype="float32", score_calibration=other)
    with pytest.raises(ResumeRefused) as e:
        score_table(**run, scorer=with_other)
    assert [c[0] for c in e.value.changed] == ["score_calibration.parameters.b"]
    score_table(**{**run, "output": tmp_path / "plain"}, scorer=scorer)
    with pytest.raises(ResumeRefused):  # a calibration added to an output written without one
        score_table(**{**run, "output": tmp_path / "plain"}, scorer=with_cal)
    with pytest.raises(JobConfigError) as e:  # a scorer and a file: which one is meant?
        score_table(**run, scorer=scorer, score_calibration=cal)
    assert e.value.param == "score_calibration"


def test_a_calibration_for_another_model_template_or_labels_is_refused(
    scorer, checkpoint_dir, scorers, rng, tmp_path, capsys
):
    from tpuscore.cli import main

    pq.write_table(pairs_table(rng, 3), tmp_path / "pairs.parquet")
    model = str(checkpoint_dir(CASE))
    foreign = platt_file(tmp_path / "foreign.json", scorers("qwen2_bias"))
    with pytest.raises(CalibrationMismatch) as e:
        score_table(
            tmp_path / "pairs.parquet", tmp_path / "o1", model=model, score_calibration=foreign,
            **PAIRS,
        )  # fmt: skip
    assert (e.value.code, e.value.param) == ("calibration_mismatch", "score_calibration")
    under_plain = platt_file(tmp_path / "plain.json", scorer, template="plain")
    args = ["job", str(tmp_path / "pairs.parquet"), "--model", model, "--dtype", "float32",
            "--query-column", "user_text", "--item-column", "item_text"]  # fmt: skip
    for cal, labels, param, said in [
        (foreign, LABELS, "score_calibration", "another model"),
        (under_plain, LABELS, "template", "fitted for template 'plain', not None"),
        (platt_file(tmp_path / "cal.json", scorer), LABELS[::-1], "labels", "fitted for labels"),
    ]:
        out = tmp_path / f"out-{param}"
        status = main([*args, "--labels", *labels, "--score-calibration", str(cal),
                       "--output", str(out)])  # fmt: skip
        err = capsys.readouterr().err
        assert status == 2 and not out.exists()  # refused before any row
        assert err.startswith("tpuscore: error: --score-calibration: ") and said in err
        assert f"[code calibration_mismatch, param {param}]" in err


def test_a_classification_model_and_ray_score_rows_carry_calibrated(checkpoint_dir, rng, tmp_path):
    from tpuscore.integrations.ray import ScoreRows

    case = "llama_seq_cls"  # one logit: z is the logit itself
    classifier = load_scorer(checkpoint_dir(case), dtype="float32")
    cal = platt_file(tmp_path / "cls.json", classifier, classification=True)
    table = pairs_table(rng, 5)
    rows = ScoreRows(
        checkpoint_dir(case),
        dtype="float32",
        score_calibration=cal,
        query_column="user_text",
        item_column="item_text",
        id_columns=["item_id"],
    )(table)
    assert rows.column_names[-3:] == ["calibrated", "error_code", "error"]
    logits = np.stack(
        [
            r.logprobs[0, 0]
            for r in classifier.score_batch(
                [
                    {"query": q, "items": [it]}
                    for q, it in zip(
                        table["user_text"].to_pylist(), table["item_text"].to_pylist(), strict=True
                    )
                ],
                backend="reference",
            )
        ]
    )
    np.testing.assert_allclose(
        rows.column("calibrated").to_numpy(), scipy.special.expit(A * logits + B), atol=2e-5
    )
    causal = platt_file(tmp_path / "causal.json", load_scorer(checkpoint_dir(CASE)))
    with pytest.raises(CalibrationMismatch):
        ScoreRows(checkpoint_dir(case), score_calibration=causal)
