"""`tpuscore cache list|size|clear [--kind ...]` (cli/cache.py), through the command's own entry
point in this process, over caches in a temporary folder: a tiny GGUF's weight entry, stand-in
kernel builds and compilation entries."""

from __future__ import annotations

import os

import numpy as np
import pytest

from test_gguf import _tiny_gguf
from tpuscore.cli import cache as cache_command
from tpuscore.cli import commands as cli
from tpuscore.engine import compilation_cache
from tpuscore.kernels.cpu_attention import library
from tpuscore.models import loaders
from tpuscore.models.loaders import weight_cache


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """The three caches under tmp_path, each holding entries of known sizes."""
    folders = {kind: tmp_path / kind for kind in cache_command.KINDS}
    monkeypatch.setenv(weight_cache.ENV, str(folders["weights"]))
    monkeypatch.setenv(library.CACHE_ENV, str(folders["kernels"]))
    monkeypatch.setenv(compilation_cache.ENV, str(folders["compilation"]))
    for name in (weight_cache.MAX_SIZE_ENV, compilation_cache.MAX_SIZE_ENV):
        monkeypatch.delenv(name, raising=False)
    path, _ = _tiny_gguf(tmp_path, "llama")
    loaders.load(path, dtype=np.dtype(np.float32))
    folders["kernels"].mkdir()
    for n, size in ((1, 1000), (2, 3000)):
        built = folders["kernels"] / f"prefix_attention-{n}.so"
        built.write_bytes(b"\0" * size)
        os.utime(built, (0, 1000 * n))  # last loaded in this order
    folders["compilation"].mkdir()
    for n, size in ((1, 512), (2, 512), (3, 1024)):
        (folders["compilation"] / f"jit_f-{n}-cache").write_bytes(b"\0" * size)
        (folders["compilation"] / f"jit_f-{n}-atime").write_bytes(n.to_bytes(8, "little"))
    return folders


def _run(capsys, *argv) -> list[str]:
    assert cli.main(["cache", *argv]) == 0
    return capsys.readouterr().out.splitlines()


def test_list_shows_every_entry_with_its_size(caches, capsys):
    lines = _run(capsys, "list")
    (weights,) = weight_cache.entries(caches["weights"])
    assert any(str(weights.path) in line and line.startswith("weights") for line in lines)
    assert f"weights: 1 entry, {cache_command.human(weights.bytes)} in {caches['weights']}" in lines
    kernels = [line for line in lines if line.startswith("kernels ")]
    assert len(kernels) == 2 and "2.9 KiB" in kernels[-1]  # least recently used first
    assert "kernels: 2 entries, 3.9 KiB in " + str(caches["kernels"]) in lines
    assert "compilation: 3 entries, 2.0 KiB in " + str(caches["compilation"]) in lines
    compiled = [line for line in lines if line.startswith("compilation ")]
    assert [line.split()[-1].rsplit("/", 1)[-1] for line in compiled] == [
        "jit_f-1-cache", "jit_f-2-cache", "jit_f-3-cache"
    ]  # fmt: skip


def test_size_gives_totals_and_caps(caches, capsys):
    lines = _run(capsys, "size")
    (weights,) = weight_cache.entries(caches["weights"])
    assert lines[0].split()[:3] == ["weights", "1", "entry"]
    assert cache_command.human(weights.bytes) in lines[0] and "(cap 10.0 GiB)" in lines[0]
    assert lines[1].split()[:5] == ["kernels", "2", "entries", "3.9", "KiB"]
    assert "(cap 8 builds)" in lines[1]
    assert lines[2].split()[:5] == ["compilation", "3", "entries", "2.0", "KiB"]
    assert "(cap 2.0 GiB)" in lines[2]
    assert lines[3].split()[0] == "total"
    assert _run(capsys, "size", "--kind", "kernels")[0].split()[:3] == ["kernels", "2", "entries"]


def test_clear_one_kind_then_all(caches, capsys):
    assert _run(capsys, "clear", "--kind", "compilation") == [
        f"compilation: removed 3 entries, 2.0 KiB, from {caches['compilation']}"
    ]
    assert list(caches["compilation"].iterdir()) == []  # the last-use files too
    assert len(weight_cache.entries(caches["weights"])) == 1
    assert len(library.entries(caches["kernels"])) == 2
    lines = _run(capsys, "clear")
    assert lines[0].startswith("weights: removed 1 entry") and "kernels: removed 2" in lines[1]
    assert lines[2].startswith("compilation: removed 0 entries")
    assert not any(caches["weights"].iterdir()) and not any(caches["kernels"].iterdir())


def test_a_cache_turned_off_says_so(caches, capsys, monkeypatch):
    monkeypatch.setenv(weight_cache.ENV, "off")
    monkeypatch.setenv(compilation_cache.ENV, "off")
    lines = _run(capsys, "size")
    assert "off (TPUSCORE_WEIGHTS_CACHE)" in lines[0]
    assert "off (TPUSCORE_COMPILATION_CACHE)" in lines[2]
    assert _run(capsys, "clear", "--kind", "weights") == [
        "weights: removed 0 entries, 0 B, from off (TPUSCORE_WEIGHTS_CACHE)"
    ]


def test_a_malformed_cap_is_bad_input(caches, capsys, monkeypatch):
    monkeypatch.setenv(weight_cache.MAX_SIZE_ENV, "lots")
    assert cli.main(["cache", "size"]) == cli.USAGE_ERROR
    assert "TPUSCORE_WEIGHTS_CACHE_MAX_SIZE='lots' is not a size" in capsys.readouterr().err


def test_an_unknown_kind_is_refused(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["cache", "list", "--kind", "everything"])
    assert exit.value.code == cli.USAGE_ERROR
    assert "invalid choice: 'everything'" in capsys.readouterr().err
