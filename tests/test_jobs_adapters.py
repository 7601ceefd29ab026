"""A row's `adapter` column picks the LoRA adapter it is scored with, in a job and through Ray's
`ScoreRows`, as `score(..., adapter=)` does; the adapters' weights are part of the model's
fingerprint, so a resume with other adapter weights under the same name is refused."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hf_reference import make_checkpoint
from lora_reference import ADAPTERS, save_adapter
from test_jobs import LABELS, _text
from tpuscore.jobs import ResumeRefused, load_scorer, read_errors, score_table

NAME = "attn_mlp"


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """(base path, a scorer with one adapter, one with other weights under the same name)."""
    root = tmp_path_factory.mktemp("jobs_adapters")
    base = make_checkpoint(root / "base", "llama_gqa_untied", seed=3)
    scorers = [
        load_scorer(
            base,
            dtype="float32",
            adapters={NAME: save_adapter(base, root / f"a{seed}", seed=seed, **ADAPTERS[NAME])},
        )
        for seed in (10, 11)
    ]
    return base, *scorers


def test_the_adapter_column_picks_each_rows_adapter(lora, rng, tmp_path):
    _, scorer, _ = lora
    query = _text(rng, 3, 8)
    items = [_text(rng, 1, 5) for _ in range(6)]
    adapters = [None, NAME, NAME, None, "missing", NAME]
    table = pa.table({"id": range(6), "query": [query] * 6, "item": items, "adapter": adapters})
    pq.write_table(table, tmp_path / "pairs.parquet")
    score_table(
        tmp_path / "pairs.parquet", tmp_path / "out", scorer=scorer, labels=LABELS,
        id_columns=["id"],
    )  # fmt: skip
    out = pq.read_table(tmp_path / "out").sort_by("row")
    assert out["row"].to_pylist() == [0, 1, 2, 3, 5]
    [error] = read_errors(str(tmp_path / "out")).to_pylist()
    assert (error["row"], error["code"]) == (4, "unknown_adapter")
    got = np.stack([out[f"logprob_{label}"].to_numpy() for label in LABELS], 1)
    want = np.stack(
        [
            scorer.score(query, [items[r]], labels=LABELS, adapter=adapters[r]).logprobs[0]
            for r in out["row"].to_pylist()
        ]
    )
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    base = scorer.score(query, [items[1]], labels=LABELS).logprobs[0]
    assert not np.allclose(got[1], base, atol=1e-3)  # the adapter moved the row


KWARGS = dict(labels=LABELS, shard_rows=2)


def _write_adapter_table(rng, tmp_path) -> None:
    """pairs.parquet: four rows, each under the adapter."""
    table = pa.table({"query": [_text(rng, 3, 8)] * 4, "item": ["a b", "c", "d", "e"]})
    table = table.append_column("adapter", pa.array([NAME] * 4))
    pq.write_table(table, tmp_path / "pairs.parquet")


def test_a_resume_with_other_adapter_weights_is_refused(lora, rng, tmp_path):
    _, scorer, other = lora
    _write_adapter_table(rng, tmp_path)
    score_table(tmp_path / "pairs.parquet", tmp_path / "out", scorer=scorer, **KWARGS)
    with pytest.raises(ResumeRefused) as refused:
        score_table(tmp_path / "pairs.parquet", tmp_path / "out", scorer=other, **KWARGS)
    assert [c[0] for c in refused.value.changed] == ["model.adapters.sha256"]


def test_an_output_that_read_other_row_option_columns_is_not_resumed(lora, rng, tmp_path):
    """The columns rows took their options from are the job's settings: an output written by a
    version that did not read the adapter column (its manifest without them) is not resumed
    with rows that now pick adapters."""
    import json

    _, scorer, _ = lora
    _write_adapter_table(rng, tmp_path)
    score_table(tmp_path / "pairs.parquet", tmp_path / "out", scorer=scorer, **KWARGS)
    manifest = tmp_path / "out.manifest.json"
    written = json.loads(manifest.read_text())
    assert written["settings"]["row_options"] == ["adapter"]
    del written["settings"]["row_options"]
    manifest.write_text(json.dumps(written))
    with pytest.raises(ResumeRefused) as refused:
        score_table(tmp_path / "pairs.parquet", tmp_path / "out", scorer=scorer, **KWARGS)
    assert [c[0] for c in refused.value.changed] == ["row_options"]


def test_an_adapter_row_on_a_backend_without_adapters_is_that_rows_error(lora, rng, tmp_path):
    """As `score_batch` refuses such a request before anything runs: the row, not the job."""
    _, scorer, _ = lora
    table = pa.table(
        {"query": ["the mill"] * 3, "item": ["a", "b c", "d"], "adapter": [None, NAME, None]}
    )
    pq.write_table(table, tmp_path / "pairs.parquet")
    summary = score_table(
        tmp_path / "pairs.parquet", tmp_path / "out", scorer=scorer, labels=LABELS,
        backend="reference",
    )  # fmt: skip
    assert (summary.rows, summary.errors) == (3, 1)
    [error] = read_errors(str(tmp_path / "out")).to_pylist()
    assert (error["row"], error["code"]) == (1, "adapter_unsupported")
