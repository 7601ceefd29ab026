"""The command-line examples in docs/cli.md give the output the doc shows: each `$ echo '...' |
tpuscore CMD` line is run on the default model and its result compared with the line after it
(numbers to 1e-4; `backend` is what auto picks on the machine, so it may differ); an error
example's line is the exact stderr line."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

from tpuscore.cli import commands as cli

DOC = Path(__file__).parents[1] / "docs" / "cli.md"
EXAMPLE = re.compile(
    r"^    \$ echo '(?P<input>.*)' \| tpuscore (?P<command>\w+)\n    (?P<output>.*)$", re.M
)
EXAMPLES = [m.groupdict() for m in EXAMPLE.finditer(DOC.read_text())]


def _close(got, want, where="") -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            if key != "backend":
                _close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _close(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-4), where
    else:
        assert got == want, where


def test_the_doc_has_examples():
    assert {e["command"] for e in EXAMPLES} >= {"score", "rank"}


@pytest.mark.default_model
@pytest.mark.parametrize("example", EXAMPLES, ids=[e["command"] for e in EXAMPLES])
def test_cli_doc_example(example, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(example["input"].encode())))
    status = cli.main([example["command"]])
    out, err = capsys.readouterr()
    if example["output"].startswith("tpuscore: error:"):  # an error example: stderr, status 2
        assert (status, err.strip()) == (2, example["output"])
    else:
        assert status == 0, err
        _close(json.loads(out), json.loads(example["output"]))
