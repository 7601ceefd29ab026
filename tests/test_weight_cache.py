"""The GGUF weight cache: a second load reads the dequantized weights back bit for bit; an entry
is keyed by the loader's code and dependencies; a broken entry is removed and written again; a
killed write's leftovers are cleaned; the cache stays under its cap, least recently used first;
"off" writes nothing."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from test_gguf import _tiny_gguf
from tpuscore.api import processes
from tpuscore.models import loaders
from tpuscore.models.loaders import weight_cache


def _load(path, dtype="float32"):
    return loaders.load(path, dtype=np.dtype(dtype))


def _assert_same(a, b):
    (config_a, params_a, tok_a), (config_b, params_b, tok_b) = a, b
    assert config_a == config_b
    leaves_a, tree_a = jax.tree_util.tree_flatten(params_a)
    leaves_b, tree_b = jax.tree_util.tree_flatten(params_b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()  # bit for bit
    text = "a tiny test, ab ba"
    assert tok_a.encode(text).ids == tok_b.encode(text).ids


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(weight_cache.ENV, str(root))
    monkeypatch.delenv(weight_cache.MAX_SIZE_ENV, raising=False)
    return root


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_second_load_reads_the_cache_bit_for_bit(tmp_path, cache, caplog, dtype):
    path, _ = _tiny_gguf(tmp_path, "qwen3")
    first = _load(path, dtype)
    (entry,) = cache.iterdir()
    assert entry.name.endswith(f"-{dtype}-{weight_cache.code_key()}")
    with caplog.at_level(logging.INFO, logger=weight_cache.__name__):
        second = _load(path, dtype)
    assert "from the weight cache" in caplog.text
    _assert_same(first, second)


def test_a_changed_file_is_a_new_entry(tmp_path, cache):
    path, _ = _tiny_gguf(tmp_path, "llama")
    path = Path(path)
    _load(path)
    path.write_bytes(path.read_bytes() + b"\0" * 32)  # GGUF pads tensor data: still readable
    _load(path)
    assert len(_names(cache)) == 2


@pytest.mark.parametrize(
    "changed", ["tpuscore", "gguf", "numpy", "ml_dtypes", "tokenizers", "code"]
)
def test_another_loader_or_dependency_version_is_a_new_entry(
    tmp_path, cache, monkeypatch, caplog, changed
):
    """An entry written by another version of the loader's code or of a package it converts
    with is never read: the load reads the file again into an entry of its own."""
    path, _ = _tiny_gguf(tmp_path, "llama")
    _load(path)
    (old,) = _names(cache)
    if changed == "code":
        source = tmp_path / "gguf.py"
        source.write_text("# the loader, fixed\n")
        monkeypatch.setattr(weight_cache, "CODE", (*weight_cache.CODE, source))
    else:
        real = weight_cache.metadata.version
        monkeypatch.setattr(
            weight_cache.metadata,
            "version",
            lambda name: "999.0" if name == changed else real(name),
        )
    weight_cache.versions.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger=weight_cache.__name__):
            _load(path)
        assert "from the weight cache" not in caplog.text
        assert len(_names(cache)) == 2 and old in _names(cache)
    finally:
        monkeypatch.undo()
        weight_cache.versions.cache_clear()


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(path: Path) -> None:
    """One byte of a weight changed in place, the file's size kept (a disk's or a copy's fault)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


DAMAGE = {
    "index not JSON": lambda e: (e / "params.json").write_text("{not json"),
    "index missing": lambda e: (e / "params.json").unlink(),
    "params.bin short": lambda e: _truncate(e / "params.bin"),
    "params.bin byte flipped": lambda e: _flip(e / "params.bin"),
    "params.bin missing": lambda e: (e / "params.bin").unlink(),
    "config damaged": lambda e: (e / "config.json").write_text('{"vocab_size": "many"}'),
    "tokenizer damaged": lambda e: _truncate(e / "tokenizer.json"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_broken_entry_is_logged_removed_and_written_again(tmp_path, cache, caplog, damage):
    path, _ = _tiny_gguf(tmp_path, "llama")
    first = _load(path)
    (entry,) = cache.iterdir()
    DAMAGE[damage](entry)
    with caplog.at_level(logging.INFO, logger=weight_cache.__name__):
        second = _load(path)  # succeeds, from the file
    assert "is unreadable" in caplog.text and "from the weight cache" not in caplog.text
    _assert_same(first, second)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=weight_cache.__name__):
        third = _load(path)  # the entry was written again: healed
    assert "from the weight cache" in caplog.text and "unreadable" not in caplog.text
    _assert_same(first, third)
    assert _names(cache) == [entry.name]


def test_leftovers_of_killed_writes_are_cleaned(tmp_path, cache):
    """A staging folder whose process is gone goes at the next load, as does one older than a
    day (another host's, or an older tpuscore's); a live process's stays."""
    cache.mkdir()
    host = processes.host_tag()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True)  # fmt: skip
    dead_pid = int(dead.stdout)
    leftovers = {
        "dead": cache / f".staging-{dead_pid}-{host}-abc",
        "old, another host": cache / ".staging-1-0badc0de-abc",
        "old, an older format": cache / ".0123abcd-float32.k2j3l4",
        "trash": cache / f".trash-{dead_pid}-{host}-abc",
    }
    live = cache / f".staging-{os.getpid()}-{host}-abc"
    recent_foreign = cache / ".staging-1-0badc0de-def"
    for folder in (*leftovers.values(), live, recent_foreign):
        folder.mkdir()
        (folder / "params.bin").write_bytes(b"\0" * 100)
    day = weight_cache.STALE_SECONDS
    for name in ("old, another host", "old, an older format"):
        os.utime(leftovers[name], (0, os.stat(leftovers[name]).st_mtime - day - 60))
    path, _ = _tiny_gguf(tmp_path, "llama")
    _load(path)
    remaining = set(_names(cache))
    assert not remaining & {p.name for p in leftovers.values()}
    assert {live.name, recent_foreign.name} <= remaining
    assert len(remaining) == 3  # and the new entry


def _three_models(tmp_path):
    paths = []
    for family in ("llama", "qwen2", "qwen3"):
        folder = tmp_path / family
        folder.mkdir()
        paths.append(_tiny_gguf(folder, family)[0])
    return paths


def test_the_least_recently_used_entries_go_past_the_cap(tmp_path, cache, monkeypatch):
    """With room for two entries: A and B are written, A is read again (so B is the least
    recently used), C is written: B goes, A and C stay. Set by the argument and by
    TPUSCORE_WEIGHTS_CACHE_MAX_SIZE."""
    a, b, c = _three_models(tmp_path)
    _load(a)
    _load(b)
    sizes = {e.path.name: e.bytes for e in weight_cache.entries(cache)}
    entry_a, entry_b = (next(cache.glob(f"{weight_cache.file_hash(p)}-*")) for p in (a, b))
    os.utime(entry_a, (0, 1000))  # A older than B, before A's second use
    os.utime(entry_b, (0, 2000))
    _load(a)
    assert weight_cache.entries(cache)[-1].path == entry_a  # the second use is recorded
    cap = sum(sizes.values()) + max(sizes.values()) // 2  # two entries, not three
    monkeypatch.setenv(weight_cache.MAX_SIZE_ENV, str(cap))
    _load(c)
    entry_c = next(cache.glob(f"{weight_cache.file_hash(c)}-*"))
    assert _names(cache) == sorted([entry_a.name, entry_c.name])
    assert sum(e.bytes for e in weight_cache.entries(cache)) <= cap
    # the argument overrides the variable: a cap of one entry keeps only the newest
    config, params, tokenizer = loaders._read_gguf(Path(a), np.dtype(np.float32))
    weight_cache.remove(entry_a)
    weight_cache.load_cached(Path(a), np.float32, lambda: (config, params, tokenizer),
                             max_bytes=max(sizes.values()) + 1)  # fmt: skip
    assert _names(cache) == [entry_a.name]


def test_an_entry_over_the_cap_is_not_written(tmp_path, cache, monkeypatch, caplog):
    monkeypatch.setenv(weight_cache.MAX_SIZE_ENV, "1K")
    path, _ = _tiny_gguf(tmp_path, "llama")
    with caplog.at_level(logging.INFO, logger=weight_cache.__name__):
        first = _load(path)
    assert "exceed the weight cache's cap" in caplog.text
    assert weight_cache.entries(cache) == []
    _assert_same(first, _load(path))


@pytest.mark.parametrize(
    "text, expected",
    [("4096", 4096), ("1K", 1024), ("512M", 512 << 20), ("1.5GiB", 3 << 29), ("10g", 10 << 30)],
)
def test_parse_size(text, expected):
    assert processes.parse_size(text, "X") == expected


def test_parse_size_refuses_nonsense():
    with pytest.raises(ValueError, match="X='ten' is not a size"):
        processes.parse_size("ten", "X")


def test_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(weight_cache.ENV, "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path, _ = _tiny_gguf(tmp_path, "llama")
    _load(path)
    assert weight_cache.cache_dir() is None
    assert not (tmp_path / "xdg").exists()
