"""Score calibration (docs/calibration.md): the methods recover known probabilities on synthetic
data; `tpuscore fit-calibration` writes a file the scorer and the server apply, and refuse for
another model, template or labels."""

import json

import httpx
import numpy as np
import pytest
import scipy.special

from helpers import ServerThread, seeded_rng
from tpuscore import Scorer
from tpuscore.api import calibration, templates
from tpuscore.api.calibration import Calibration, CalibrationMismatch
from tpuscore.api.errors import ValidationError
from tpuscore.cli import commands as cli

# On N_SYNTHETIC examples (a quarter held out), 15 bins: the sampling noise of a perfectly
# calibrated predictor's ECE is about 0.015 (the true probabilities' is checked below), so a
# fitted map must come within ECE_BOUND, and the raw scores, distorted by RAW_SCALE and
# RAW_SHIFT, stay far above it.
N_SYNTHETIC = 40_000
ECE_BOUND = 0.03
RAW_SCALE, RAW_SHIFT = 3.0, 1.5


def synthetic(rng, n=N_SYNTHETIC, scale=RAW_SCALE, shift=RAW_SHIFT):
    """(raw log-odds, labels, true probabilities): labels drawn from the true probabilities,
    the raw log-odds an overconfident, shifted view of the true ones."""
    true_z = rng.normal(0.0, 1.5, n)
    truth = scipy.special.expit(true_z)
    labels = (rng.random(n) < truth).astype(np.int64)
    return scale * true_z + shift, labels, truth


@pytest.mark.parametrize("method", ["temperature", "platt", "isotonic", "auto"])
def test_calibrated_ece_falls_below_the_bound_and_the_raw_does_not(method, rng):
    z, y, truth = synthetic(rng)
    seed = int(rng.integers(1 << 30))
    fitted = calibration.fit(z, y, method=method, seed=seed, model="m", template=None,
                             label_token_ids=[1, 2])  # fmt: skip
    held = fitted.metrics["held_out"]
    _, test = calibration.split(len(y), 0.25, seed)
    assert calibration.expected_calibration_error(truth[test], y[test]) < 0.8 * ECE_BOUND
    assert held["raw_ece"] > 4 * ECE_BOUND
    if method == "temperature":  # one parameter cannot undo the shift: better, not calibrated
        assert held["ece"] < held["raw_ece"] / 2
    else:
        assert held["ece"] < ECE_BOUND
        assert held["brier"] < held["raw_brier"]
    assert fitted.method == (method if method != "auto" else fitted.method)


def test_auto_picks_platt_where_temperature_cannot_fit_and_temperature_where_it_can(rng):
    z, y, _ = synthetic(rng)
    assert calibration.fit(z, y, model="m", template=None, label_token_ids=[1]).method in (
        "platt",
        "isotonic",
    )
    z, y, _ = synthetic(rng, shift=0.0)
    fitted = calibration.fit(z, y, method="temperature", model="m", template=None,
                             label_token_ids=[1])  # fmt: skip
    assert fitted.parameters["temperature"] == pytest.approx(RAW_SCALE, rel=0.1)


def test_log_odds_is_the_rank_score_logit():
    logprobs = np.log(np.array([[0.2, 0.05, 0.1], [0.01, 0.3, 0.3]]))
    z = calibration.log_odds(logprobs, positive=0)
    within = np.exp(logprobs)[:, 0] / np.exp(logprobs).sum(axis=1)
    np.testing.assert_allclose(scipy.special.expit(z), within, rtol=1e-12)
    np.testing.assert_allclose(calibration.log_odds(np.array([[2.5]]), 0, True), [2.5])


def test_isotonic_is_monotone_and_interpolates_between_knots(rng):
    z, y, _ = synthetic(rng, n=2000)
    fitted = calibration._fit_isotonic(z, y.astype(float))
    grid = np.linspace(z.min() - 1, z.max() + 1, 500)
    p = calibration.apply_method("isotonic", fitted, grid)
    assert (np.diff(p) >= 0).all() and p.min() >= 0 and p.max() <= 1
    assert len(fitted["z"]) < len(z) / 4  # knots, not every example


@pytest.mark.parametrize(
    "labels", [[0, 1, 2] * 10, [1] * 30, [0, 1] * 3], ids=["not_binary", "one_class", "too_few"]
)
def test_bad_labels_are_refused(labels):
    with pytest.raises(ValidationError) as e:
        calibration.fit(
            np.zeros(len(labels)), labels, model="m", template=None, label_token_ids=[1]
        )
    assert e.value.code == "invalid_argument"


def test_a_file_round_trips_and_a_malformed_one_is_refused(tmp_path, rng):
    z, y, _ = synthetic(rng, n=500)
    fitted = calibration.fit(z, y, method="platt", model="m", template="plain",
                             label_token_ids=[5, 6], labels=[" yes", " no"])  # fmt: skip
    fitted.save(tmp_path / "c.json")
    loaded = Calibration.load(tmp_path / "c.json")
    assert loaded == fitted
    (tmp_path / "bad.json").write_text(json.dumps({"format": calibration.FORMAT, "model": "m"}))
    for path in (tmp_path / "bad.json", tmp_path / "missing.json"):
        with pytest.raises(ValidationError) as e:
            Calibration.load(path)
        assert e.value.code == "invalid_calibration"
    # Fields no fit writes: they loaded, then failed every covered request with a raw
    # IndexError or ValueError, or calibrated it to NaN.
    for change in (
        {"positive": 1.5},
        {"positive": 1, "label_token_ids": [5], "labels": None},
        {"positive": True},
        {"label_token_ids": [5.0, 6.0]},
        {"label_token_ids": []},
        {"classification": "no"},
        {"parameters": {"a": float("nan"), "b": 0.0}},
    ):
        (tmp_path / "bad.json").write_text(json.dumps(fitted.to_json() | change))
        with pytest.raises(ValidationError) as e:
            Calibration.load(tmp_path / "bad.json")
        assert e.value.code == "invalid_calibration", change
    with pytest.raises(CalibrationMismatch, match="template 'plain'"):
        loaded.check(template="qwen3-reranker")
    with pytest.raises(CalibrationMismatch) as e:
        loaded.check(template="plain", label_token_ids=[6, 5])
    assert (e.value.code, e.value.param) == ("calibration_mismatch", "labels")


# -- end to end on a tiny checkpoint --------------------------------------------------------------

CASE = "llama_gqa_untied"
LABELS = ["y", "n"]  # single bytes in the tests' tokenizer (the shipped templates' are not)
TEMPLATE = templates.Template(
    name="test", query="{instruction}\nQuery: {query}\n", item="Document: {item}",
    item_suffix="\nRelevant:", labels=("y", "n"), default_instruction="Judge relevance.",
)  # fmt: skip


@pytest.fixture(scope="module")
def fitted_file(checkpoint_dir, tmp_path_factory):
    """`tpuscore fit-calibration` on 60 random labelled pairs (the tiny model's scores are noise;
    the fit's arithmetic is what is checked)."""
    rng = seeded_rng("test_calibration.fitted_file")
    words = ["fox", "river", "mill", "park", "rope", "key", "moon", "salt"]
    path = tmp_path_factory.mktemp("cal") / "pairs.jsonl"
    rows = [
        {
            "query": f"about the {words[i % 3]}?",
            "item": " ".join(rng.choice(words, int(rng.integers(1, 6)))),
            "label": bool(rng.integers(0, 2)),
        }
        for i in range(60)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = path.with_name("cal.json")
    status = cli.main(["fit-calibration", str(path), "--model", str(checkpoint_dir(CASE)),
                       "--labels", *LABELS, "--method", "platt", "--out", str(out)])  # fmt: skip
    assert status == 0
    return out, rows


def test_fit_calibration_writes_what_the_scorer_applies(fitted_file, checkpoint_dir, scorers):
    out, rows = fitted_file
    data = json.loads(out.read_text())
    assert data["method"] == "platt" and data["labels"] == LABELS and data["template"] is None
    assert data["metrics"]["held_out"]["examples"] == 15
    scorer = Scorer.from_pretrained(checkpoint_dir(CASE), dtype="float32", score_calibration=out)
    query, items = rows[0]["query"], [r["item"] for r in rows[:4]]
    result = scorer.score(query, items, labels=LABELS)
    plain = scorers(CASE).score(query, items, labels=LABELS)
    assert plain.calibrated is None
    np.testing.assert_array_equal(result.logprobs, plain.logprobs)
    lp = plain.logprobs.astype(np.float64)
    z = lp[:, 0] - lp[:, 1]  # two labels: the positive's log-odds within them
    a, b = data["parameters"]["a"], data["parameters"]["b"]
    np.testing.assert_allclose(result.calibrated, scipy.special.expit(a * z + b), rtol=1e-5)
    # Other labels: not what it was fitted for, so no calibrated probability.
    assert scorer.score(query, items, labels=["n", "y"]).calibrated is None
    batch = scorer.score_batch([{"query": query, "items": items, "labels": LABELS}])
    np.testing.assert_array_equal(batch[0].calibrated, result.calibrated)


def test_a_chunked_documents_chunks_carry_calibrated_as_items_would(fitted_file, checkpoint_dir):
    out, rows = fitted_file
    scorer = Scorer.from_pretrained(checkpoint_dir(CASE), dtype="float32", score_calibration=out)
    query = rows[0]["query"]
    document = " ".join(r["item"] for r in rows[:12])
    chunked = scorer.score(query, [document], labels=LABELS, chunking={"window": 8})
    assert len(chunked.spans) > 1
    z = chunked.chunks.logprobs[:, 0].astype(np.float64) - chunked.chunks.logprobs[:, 1]
    data = json.loads(out.read_text())
    a, b = data["parameters"]["a"], data["parameters"]["b"]
    np.testing.assert_allclose(chunked.chunks.calibrated, scipy.special.expit(a * z + b), rtol=1e-5)


def test_a_request_under_a_lora_adapter_gets_no_base_calibration(
    fitted_file, checkpoint_dir, tmp_path
):
    from lora_reference import ADAPTERS, save_adapter

    out, rows = fitted_file
    base = checkpoint_dir(CASE)
    adapter = save_adapter(base, tmp_path / "adapter", seed=5, **ADAPTERS["attn_mlp"])
    scorer = Scorer.from_pretrained(
        base, dtype="float32", score_calibration=out, adapters={"tuned": adapter}
    )
    query, items = rows[0]["query"], [r["item"] for r in rows[:3]]
    assert scorer.score(query, items, labels=LABELS).calibrated is not None
    tuned = scorer.score(query, items, labels=LABELS, adapter="tuned")
    assert tuned.calibrated is None
    batch = scorer.score_batch(
        [{"query": query, "items": items, "labels": LABELS, "adapter": a} for a in (None, "tuned")]
    )
    assert batch[0].calibrated is not None and batch[1].calibrated is None


def test_a_calibration_for_another_model_is_refused(fitted_file, checkpoint_dir, scorers):
    out, _ = fitted_file
    with pytest.raises(CalibrationMismatch) as e:
        Scorer.from_pretrained(checkpoint_dir("qwen2_bias"), score_calibration=out)
    assert (e.value.code, e.value.param) == ("calibration_mismatch", "score_calibration")
    # Set later, it is checked too: unchecked, another model's fit was applied silently and a
    # path failed every later score with AttributeError.
    other = scorers("qwen2_bias")
    for value in (out, Calibration.load(out)):
        with pytest.raises(CalibrationMismatch):
            other.score_calibration = value
    with pytest.raises(ValidationError) as e:
        other.score_calibration = 3
    assert (e.value.code, e.value.param) == ("invalid_calibration", "score_calibration")
    assert other.score_calibration is None
    own = scorers(CASE)
    own.score_calibration = out  # a path, loaded
    try:
        assert own.score_calibration == Calibration.load(out)
    finally:
        own.score_calibration = None


def test_the_server_returns_calibrated_scores_and_refuses_another_template(fitted_file, scorers):
    from tpuscore.serving import app as server

    out, rows = fitted_file
    base = scorers(CASE)
    fitted = Calibration.load(out)
    base.score_calibration = fitted
    try:
        running = ServerThread(server.create_app(base, rerank_template=TEMPLATE))
        query, items = rows[0]["query"], [r["item"] for r in rows[:3]]
        with httpx.Client(base_url=running.url, timeout=60) as client:
            body = client.post("/v1/score", json={"query": query, "items": items, "labels": LABELS})
            other = client.post(
                "/v1/score", json={"query": query, "items": items, "labels": LABELS[::-1]}
            )
        running.stop()
        expected = fitted.probabilities(base.score(query, items, labels=LABELS).logprobs)
        np.testing.assert_allclose(body.json()["calibrated"], expected, rtol=1e-5)
        assert other.status_code == 200 and "calibrated" not in other.json()
        fields = {k: v for k, v in fitted.to_json().items() if k != "format"}
        base.score_calibration = Calibration(**fields | {"template": "qwen3-reranker"})
        with pytest.raises(CalibrationMismatch, match="template 'qwen3-reranker'"):
            server.create_app(base, rerank_template=TEMPLATE)
    finally:
        base.score_calibration = None


def test_the_batcher_keeps_calibrated_across_a_split_request(fitted_file, scorers):
    from tpuscore import Batcher

    out, rows = fitted_file
    base = scorers(CASE)
    base.score_calibration = Calibration.load(out)
    try:
        query, items = rows[0]["query"], [r["item"] for r in rows[:8]]
        # A budget below the request's tokens: it runs over several batches and is joined.
        with Batcher(base, max_batch_tokens=24) as batcher:
            result = batcher.score(query=query, items=items, labels=LABELS)
        expected = base.score(query, items, labels=LABELS).calibrated
        np.testing.assert_allclose(result.calibrated, expected, rtol=1e-5)
    finally:
        base.score_calibration = None
