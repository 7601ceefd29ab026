"""The `tpuscore` command line: JSON in, JSON out, bad input as one line on stderr and status 2.

Two tests run the command in a subprocess (each loads JAX and a tiny checkpoint, several
seconds); the rest call `cli.main` in this process, which runs the same code.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tpuscore
from helpers import random_tokens
from tpuscore.api.requests import ScoreOptions
from tpuscore.cli import commands as cli

CASE = "qwen3_qknorm"


def run_cli(*args: str, stdin: str = "", timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m tpuscore.cli ARGS` on the tpuscore this test imports, in a fresh process."""
    env = dict(os.environ, PYTHONPATH=str(Path(tpuscore.__file__).parents[1]))
    return subprocess.run(
        [sys.executable, "-m", "tpuscore.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


@pytest.mark.slow  # a subprocess
def test_score_json_lines_from_stdin_equal_the_scorer(scorers, checkpoint_dir, rng):
    scorer = scorers(CASE)
    vocab = scorer.config.vocab_size
    query = random_tokens(rng, 12, vocab)
    requests = [
        {
            "query": query,
            "items": [random_tokens(rng, n, vocab) for n in (3, 5)],
            "label_token_ids": [4, 9],
        },
        {
            "query": query,
            "items": [random_tokens(rng, 2, vocab)],
            "label_token_ids": [4, 9],
            "apply_softmax": True,
        },
        {"query": "the fox", "items": [" jumps", " sleeps"], "labels": ["x", "e"]},
    ]
    stdin = "\n".join(json.dumps(r) for r in requests) + "\n\n"  # a blank line is skipped
    done = run_cli("score", "--model", str(checkpoint_dir(CASE)), stdin=stdin)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == len(requests)
    # The command runs its lines together (they share work), as score_batch does: under auto the
    # pick is priced for the whole call, so one request alone may run on another backend.
    for expected, line in zip(scorer.score_batch(requests), lines, strict=True):
        out = json.loads(line)
        np.testing.assert_allclose(out["logprobs"], expected.logprobs, atol=1e-5, rtol=0)
        np.testing.assert_allclose(out["scores"], expected.scores, rtol=1e-4, atol=1e-7)
        assert out["backend"] == expected.backend and out["num_tokens"] > 0


@pytest.mark.slow  # a subprocess
def test_validation_error_is_one_line_and_status_2(checkpoint_dir, tmp_path):
    path = tmp_path / "requests.json"
    path.write_text(
        json.dumps(
            [
                {"query": "a", "items": ["b"], "label_token_ids": [1]},
                {"query": "a", "items": ["b"], "label_token_ids": [10**6]},
            ]
        )
    )
    done = run_cli("score", "--model", str(checkpoint_dir(CASE)), str(path))
    assert done.returncode == 2
    assert done.stdout == ""  # no result is written unless every request succeeds
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "request 1" in done.stderr and "token_id_exceeds_vocab" in done.stderr


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"query": "x", "items": [', "invalid JSON"),
        ('{"query": "x", "items": []}\n{"query": ', "line 2: invalid JSON"),
        ("[1]", "request 0: a request must be a JSON object, got int"),
        ("   \n", "no input"),
    ],
)
def test_malformed_input_fails_before_the_model_loads(text, message, tmp_path, capsys):
    path = tmp_path / "in.json"
    path.write_text(text)
    # --model names no model: the input is refused before loading is tried.
    assert cli.main(["score", "--model", str(tmp_path / "missing"), str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_missing_file_and_model(tmp_path, checkpoint_dir, capsys):
    assert cli.main(["score", str(tmp_path / "nope.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
    path = tmp_path / "in.json"
    path.write_text('{"query": "a", "items": ["b"], "label_token_ids": [1]}')
    assert cli.main(["score", "--model", str(tmp_path / "missing"), str(path)]) == 2
    assert "cannot load" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("window=0", "chunking.window must be an int >= 1"),
        ("window=4,stride=9", "chunking.stride must be at most window"),
        ("window=4,strid=2", "chunking.strid is unknown"),
        ("window", "'window' is not key=value"),
    ],
)
def test_job_chunking_flag_is_checked_before_the_model_loads(tmp_path, capsys, flag, message):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"query": ["q"], "item": ["a long document"]}), tmp_path / "in.parquet")
    argv = ["job", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "out"), "--labels",
            "a", "b", "--model", str(tmp_path / "missing"), f"--chunking={flag}"]  # fmt: skip
    try:
        status = cli.main(argv)
    except SystemExit as e:  # argparse's own refusal of a flag's value
        status = e.code
    err = capsys.readouterr().err
    assert status == 2 and message in err and "cannot load" not in err, err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--shard-rows", "0"], "shard_rows must be an int >= 1"),
        (["--max-item-tokens", "0"], "max_item_tokens must be an int >= 1"),
    ],
)
def test_job_settings_are_checked_before_the_model_loads(tmp_path, capsys, flags, message):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"query": ["q"], "item": ["a"]}), tmp_path / "in.parquet")
    argv = ["job", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "out"), "--labels",
            "a", "b", "--model", str(tmp_path / "missing"), *flags]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "cannot load" not in err, err


def test_a_bad_cache_size_variable_is_named_not_the_model(tmp_path, capsys, monkeypatch):
    """TPUSCORE_COMPILATION_CACHE_MAX_SIZE that is not a size is the variable's fault: the
    command says so before loading, not "cannot load MODEL"."""
    monkeypatch.setenv("TPUSCORE_COMPILATION_CACHE", str(tmp_path / "cc"))
    monkeypatch.setenv("TPUSCORE_COMPILATION_CACHE_MAX_SIZE", "lots")
    path = tmp_path / "in.json"
    path.write_text('{"query": "a", "items": ["b"], "label_token_ids": [1]}')
    assert cli.main(["score", "--model", str(tmp_path / "missing"), str(path)]) == 2
    err = capsys.readouterr().err
    assert "TPUSCORE_COMPILATION_CACHE_MAX_SIZE='lots'" in err and "cannot load" not in err, err


def test_a_bad_profile_file_is_named_not_the_model(checkpoint_dir, tmp_path, capsys):
    (tmp_path / "profile.json").write_text('{"name": "cut')
    path = tmp_path / "in.json"
    path.write_text('{"query": "a", "items": ["b"], "label_token_ids": [1]}')
    argv = ["score", "--model", str(checkpoint_dir(CASE)), "--profile"]
    assert cli.main([*argv, str(tmp_path / "profile.json"), str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tpuscore: error: --profile: ") and "cannot load" not in err, err
    assert "profile.json cannot be read as JSON" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("mesh", "message"), [("2x4", "needs 8 devices; there are 1"), ("two", "DATAxMODEL")]
)
def test_a_bad_mesh_is_one_line_and_status_2(mesh, message, tmp_path, capsys):
    path = tmp_path / "in.json"
    path.write_text('{"query": "a", "items": ["b"], "label_token_ids": [1]}')
    assert cli.main(["score", "--mesh", mesh, str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_unknown_field_names_the_accepted_ones(checkpoint_dir, tmp_path, capsys):
    path = tmp_path / "in.json"
    path.write_text('{"query": "a", "items": ["b"], "label_token_ids": [1], "lables": [" x"]}')
    assert cli.main(["score", "--model", str(checkpoint_dir(CASE)), str(path)]) == 2
    err = capsys.readouterr().err
    assert "unknown field 'lables'" in err and "label_token_ids" in err


def test_rank_equals_scorer_rank(scorers, checkpoint_dir, tmp_path, capsys):
    scorer = scorers(CASE)
    request = {
        "query": "Which passage is about a fox?",
        "items": ["The quick brown fox.", "The market opens early.", "A lazy dog."],
        "labels": ["y", "n"],  # single tokens in the tiny tokenizer (" yes" is not)
        "top_k": 2,
    }
    path = tmp_path / "rank.json"
    path.write_text(json.dumps(request))
    # On a 1x1 mesh: the sharded path, on the one device there is.
    assert cli.main(["rank", "--model", str(checkpoint_dir(CASE)), "--mesh", "1x1", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = scorer.rank(**request)
    assert [r["index"] for r in out["results"]] == [r.index for r in expected]
    assert [r["item"] for r in out["results"]] == [r.item for r in expected]
    np.testing.assert_allclose(
        [r["score"] for r in out["results"]], [r.score for r in expected], rtol=1e-4, atol=1e-7
    )


def test_score_takes_chunking_per_request_as_score_batch_does(
    scorers, checkpoint_dir, tmp_path, capsys
):
    """A request with `chunking` is scored by its documents' chunks (it was an unknown field),
    beside one without, in one run: each output as `score_batch` gives it."""
    scorer = scorers(CASE)
    requests = [
        {"query": "a fox?", "items": ["The quick brown fox jumps.", "A lazy dog."],
         "labels": ["y", "n"], "chunking": {"window": 3, "stride": 2, "aggregate": "mean"}},
        {"query": "a dog?", "items": ["A lazy dog."], "labels": ["y", "n"]},
    ]  # fmt: skip
    path = tmp_path / "chunked.json"
    path.write_text(json.dumps(requests))
    assert cli.main(["score", "--model", str(checkpoint_dir(CASE)), str(path)]) == 0
    documents, plain = json.loads(capsys.readouterr().out)
    expected, expected_plain = scorer.score_batch(requests)
    np.testing.assert_allclose(documents["scores"], expected.scores, rtol=1e-4, atol=1e-7)
    assert documents["best_chunk"] == expected.best_chunk.tolist()
    assert documents["best_span"] == [list(span) for span in expected.best_span]
    assert documents["spans"] == [list(span) for span in expected.spans]
    for got, want in zip(documents["chunk_scores"], expected.chunk_scores, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(
        documents["chunks"]["logprobs"], expected.chunks.logprobs, rtol=1e-4, atol=1e-5
    )
    np.testing.assert_allclose(plain["logprobs"], expected_plain.logprobs, rtol=1e-4, atol=1e-5)


def test_loglikelihood_equals_scorer(scorers, checkpoint_dir, tmp_path, capsys):
    scorer = scorers(CASE)
    requests = [
        {"context": "The capital of France is", "continuations": [" Paris", " a city"]},
        {"context": "2 + 2 =", "continuations": [" 4"]},
    ]
    path = tmp_path / "ll.json"
    path.write_text(json.dumps(requests))
    assert cli.main(["loglikelihood", "--model", str(checkpoint_dir(CASE)), str(path)]) == 0
    outs = json.loads(capsys.readouterr().out)
    assert len(outs) == len(requests)
    for request, out in zip(requests, outs, strict=True):
        expected = scorer.loglikelihood(**request)
        assert len(out["results"]) == len(expected)
        for got, want in zip(out["results"], expected, strict=True):
            assert got["logprob"] == pytest.approx(float(want.logprob), abs=1e-4)
            assert got["is_greedy"] == bool(want.is_greedy)


def test_bench_finds_the_checkout_script_or_says_why_not(tmp_path, capsys):
    assert cli.bench_script() == Path(tpuscore.__file__).parents[2] / "benchmarks" / "bench.py"
    assert cli.main(["bench", "--script", str(tmp_path / "bench.py")]) == 1
    assert "not in the wheel" in capsys.readouterr().err
    assert cli.main(["bench", "--model", "x"]) == 2


def test_bench_without_torch_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # find_spec then reports it missing
    assert cli.main(["bench"]) == 1
    err = capsys.readouterr().err
    assert "torch is not installed" in err and "pip install" in err


def test_serve_on_a_taken_port_fails_before_loading_the_model(tmp_path, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # A model path that does not exist: loading it first would exit 2, not 1.
        status = cli.main(["serve", "--model", str(tmp_path / "nope"), "--port", str(port)])
    assert status == 1
    assert f"cannot serve on 127.0.0.1:{port}" in capsys.readouterr().err


def test_serve_refuses_an_unknown_template_before_listening(checkpoint_dir, capsys):
    status = cli.main(
        ["serve", "--model", str(checkpoint_dir(CASE)), "--rerank-template", "nope", "--port", "0"]
    )
    assert status == 2
    assert "nope" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "request_", "param"),
    [
        ("score", {"query": "a", "labels": ["x"]}, "items"),
        ("score", {"items": ["b"], "labels": ["x"]}, "query"),
        ("rank", {"query": "a", "labels": ["x", "e"]}, "items"),
        ("loglikelihood", {"context": "a"}, "continuations"),
    ],
)
def test_a_missing_field_is_the_librarys_typed_error(
    command, request_, param, checkpoint_dir, tmp_path, capsys
):
    path = tmp_path / "in.json"
    path.write_text(json.dumps(request_))
    assert cli.main([command, "--model", str(checkpoint_dir(CASE)), str(path)]) == 2
    err = capsys.readouterr().err
    assert f"[code invalid_argument, param {param}]" in err and err.count("\n") == 1
    assert "positional argument" not in err


def test_rank_accepts_its_own_fields_and_every_score_option(checkpoint_dir, tmp_path, capsys):
    path = tmp_path / "in.json"
    path.write_text('{"query": "a", "items": ["b"], "labels": ["x", "e"], "colour": 1}')
    assert cli.main(["rank", "--model", str(checkpoint_dir(CASE)), str(path)]) == 2
    err = capsys.readouterr().err
    assert "unknown field 'colour'" in err
    assert all(name in err for name in ("top_k", "template", *ScoreOptions.names()))


def test_calibrate_is_a_subcommand_with_its_own_flags(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["calibrate", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--out" in out and "--measurements" in out
    for argv in (["calibrate", "--no-such-flag"], ["score", "--no-such-flag"]):
        with pytest.raises(SystemExit) as done:
            cli.main(argv)
        assert done.value.code == 2  # calibrate's parser or ours: an unknown flag is refused


@pytest.mark.parametrize(
    "flag",
    [
        "--max-wait-ms=-1",
        "--max-wait-ms=inf",
        "--max-batch-tokens=0",
        "--max-pending=0",
        "--max-queued-tokens=0",
        "--request-timeout=0",
        "--request-timeout=nan",
        "--max-body-bytes=0",
        "--adapter=no-equals-sign",
        "--max-items=0",
    ],
)
def test_serve_refuses_a_bad_server_flag_before_loading_the_model(tmp_path, capsys, flag):
    """A bad value of the batcher's or the body's flags is named as the flag, before the model
    loads (which takes minutes for a large one)."""
    # A model path that does not exist: loading it first would say it cannot load.
    status = cli.main(["serve", "--model", str(tmp_path / "nope"), "--port", "0", flag])
    err = capsys.readouterr().err
    assert status != 0 and flag.split("=")[0] in err and "cannot load" not in err, err
