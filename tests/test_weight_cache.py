"""The GGUF weight cache: a second load reads the dequantized weights back bit for bit, a broken
entry is read around, and "off" writes nothing."""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import numpy as np
import pytest

from test_gguf import _tiny_gguf
from tpuscore.models import loaders
from tpuscore.models.loaders import weight_cache


def _load(path, dtype):
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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_second_load_reads_the_cache_bit_for_bit(tmp_path, monkeypatch, caplog, dtype):
    monkeypatch.setenv(weight_cache.ENV, str(tmp_path / "cache"))
    path, _ = _tiny_gguf(tmp_path, "qwen3")
    first = _load(path, dtype)
    (entry,) = (tmp_path / "cache").iterdir()
    assert entry.name.endswith(f"-{dtype}")
    with caplog.at_level(logging.INFO, logger=weight_cache.__name__):
        second = _load(path, dtype)
    assert "from the weight cache" in caplog.text
    _assert_same(first, second)


def test_a_changed_file_is_a_new_entry(tmp_path, monkeypatch):
    monkeypatch.setenv(weight_cache.ENV, str(tmp_path / "cache"))
    path, _ = _tiny_gguf(tmp_path, "llama")
    path = Path(path)
    _load(path, "float32")
    path.write_bytes(path.read_bytes() + b"\0" * 32)  # GGUF pads tensor data: still readable
    _load(path, "float32")
    assert len(list((tmp_path / "cache").iterdir())) == 2


def test_a_broken_entry_is_read_around(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(weight_cache.ENV, str(tmp_path / "cache"))
    path, _ = _tiny_gguf(tmp_path, "llama")
    first = _load(path, "float32")
    (entry,) = (tmp_path / "cache").iterdir()
    (entry / "params.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger=weight_cache.__name__):
        second = _load(path, "float32")
    assert "unreadable weight cache entry" in caplog.text
    _assert_same(first, second)


def test_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(weight_cache.ENV, "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path, _ = _tiny_gguf(tmp_path, "llama")
    _load(path, "float32")
    assert weight_cache.cache_dir() is None
    assert not (tmp_path / "xdg").exists()
