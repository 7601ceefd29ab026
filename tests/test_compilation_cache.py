"""The persistent compilation cache as tpuscore turns it on (engine/compilation_cache.py):
bounded, least recently used first; an entry JAX cannot read is written again by the next
compile of its key; what an older JAX or a killed write left is tidied when it is enabled."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest
from jax import monitoring

from tpuscore.api import processes
from tpuscore.engine import compilation_cache

HIT = "/jax/compilation_cache/cache_hits"


@pytest.fixture
def jax_cache_settings(monkeypatch):
    """JAX's cache settings as this run has them, put back after the test (the run's shared
    cache directory too, opened afresh by JAX's own code)."""
    from jax.experimental.compilation_cache import compilation_cache as jax_cache

    names = (
        "jax_compilation_cache_dir",
        "jax_compilation_cache_max_size",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    before = {name: getattr(jax.config, name) for name in names}
    monkeypatch.delenv(compilation_cache.MAX_SIZE_ENV, raising=False)
    yield
    for name, value in before.items():
        jax.config.update(name, value)
    jax_cache.reset_cache()


@pytest.fixture
def hits():
    events = []
    monitoring.register_event_listener(lambda event, **_: events.append(event))
    return events


_constants = iter(range(1000, 10**6))


def _compile_new() -> None:
    """Compile (or load) an executable no other test has: a constant of its own."""
    scale = float(next(_constants)) + os.getpid() % 1000 / 1000
    jax.jit(lambda x: x * scale)(np.ones(3, np.float32)).block_until_ready()


def _total(root) -> int:
    return sum(e.bytes for e in compilation_cache.entries(root))


def test_enable_sets_the_cap_from_the_argument_the_environment_or_the_default(
    tmp_path, monkeypatch, jax_cache_settings
):
    compilation_cache.enable(tmp_path)
    assert jax.config.jax_compilation_cache_max_size == compilation_cache.DEFAULT_MAX_BYTES
    monkeypatch.setenv(compilation_cache.MAX_SIZE_ENV, "64M")
    compilation_cache.enable(tmp_path)
    assert jax.config.jax_compilation_cache_max_size == 64 << 20
    compilation_cache.enable(tmp_path, max_bytes=12345)
    assert jax.config.jax_compilation_cache_max_size == 12345


def test_the_cache_stays_under_its_cap_least_recently_used_first(tmp_path, jax_cache_settings):
    root = tmp_path / "cc"
    compilation_cache.enable(root, max_bytes=1 << 30)
    jax.clear_caches()
    _compile_new()
    (first,) = compilation_cache.entries(root)
    cap = first.bytes * 3 + first.bytes // 2  # about three entries
    compilation_cache.enable(root, max_bytes=cap)
    for _ in range(6):
        _compile_new()
        assert _total(root) <= cap
    kept = compilation_cache.entries(root)
    assert 2 <= len(kept) <= 3 and first.path not in [e.path for e in kept]


def test_enabling_trims_a_directory_over_the_cap(tmp_path, jax_cache_settings):
    root = tmp_path / "cc"
    compilation_cache.enable(root, max_bytes=1 << 30)
    jax.clear_caches()
    for _ in range(4):
        _compile_new()
    found = compilation_cache.entries(root)
    assert len(found) == 4
    compilation_cache.enable(root, max_bytes=found[-1].bytes + found[-2].bytes)
    assert [e.path for e in compilation_cache.entries(root)] == [e.path for e in found[-2:]]


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_an_unreadable_entry_is_written_again(tmp_path, jax_cache_settings, hits, damage):
    """JAX warns on an entry it cannot read and compiles; the compile's put now replaces the
    entry (JAX's own keeps the bad bytes, so every later process warned and compiled again)."""
    root = tmp_path / "cc"
    compilation_cache.enable(root)
    jax.clear_caches()
    f = jax.jit(lambda x: x * 3.25 + 1)
    f(np.ones(3, np.float32))
    (entry,) = compilation_cache.entries(root)
    good = entry.path.read_bytes()
    bad = b"\0not an executable" if damage == "garbage" else good[: len(good) // 2]
    entry.path.write_bytes(bad)
    jax.clear_caches()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f(np.ones(3, np.float32))
    assert any("Error reading persistent compilation cache" in str(w.message) for w in caught)
    assert entry.path.read_bytes() != bad
    jax.clear_caches()
    hits.clear()
    f(np.ones(3, np.float32))
    assert hits.count(HIT) == 1  # loaded from the rewritten entry


def test_enabling_tidies_what_an_older_jax_or_a_killed_write_left(tmp_path, jax_cache_settings):
    """An entry without a last-use time (JAX's eviction fails on it) gets one; a time without
    an entry goes, as does a dead process's temporary file; a live one's stays."""
    root = tmp_path / "cc"
    root.mkdir()
    old = root / "old-cache"
    old.write_bytes(b"x" * (1 << 20))
    os.utime(old, (0, 1000))  # long unused
    (root / "orphan-atime").write_bytes(b"\0" * 8)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          check=True, capture_output=True, text=True)  # fmt: skip
    host = processes.host_tag()
    killed = root / f".tmp-{int(dead.stdout)}-{host}-abc"
    live = root / f".tmp-{os.getpid()}-{host}-abc"
    killed.write_bytes(b"half")
    live.write_bytes(b"half")
    compilation_cache.enable(root, max_bytes=(1 << 20) + 100)
    assert (root / "old-atime").exists() and not (root / "orphan-atime").exists()
    assert not killed.exists() and live.exists()
    # JAX's own cache (what runs after any reset_cache) can now evict the old entry: it reads
    # every entry's time, and failed every put on one without.
    from jax.experimental.compilation_cache import compilation_cache as jax_cache

    jax_cache.reset_cache()
    jax.clear_caches()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _compile_new()
    assert not [w for w in caught if "persistent compilation cache" in str(w.message)]
    assert not old.exists() and len(compilation_cache.entries(root)) == 1


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_folder_others_can_write_is_refused(tmp_path, jax_cache_settings, caplog, mode):
    """JAX runs what it loads: a folder another user could write stays unused, with a
    warning; a missing one is created private."""
    before = jax.config.jax_compilation_cache_dir
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with caplog.at_level(logging.WARNING, logger=compilation_cache.__name__):
        assert compilation_cache.enable(shared) is None
    assert "writable by other users" in caplog.text
    assert jax.config.jax_compilation_cache_dir == before
    created = tmp_path / "new" / "cc"
    assert compilation_cache.enable(created) == str(created)
    assert created.stat().st_mode & 0o077 == 0


def test_a_folder_that_cannot_be_used_leaves_the_cache_off(tmp_path, jax_cache_settings, caplog):
    """A file where the folder should be, or a parent that cannot be created: the cache stays
    off with a warning and the load goes on (it failed the load, so the command blamed the
    model: "cannot load MODEL: FileExistsError")."""
    before = jax.config.jax_compilation_cache_dir
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with caplog.at_level(logging.WARNING, logger=compilation_cache.__name__):
        assert compilation_cache.enable(a_file) is None
        assert compilation_cache.enable(a_file / "cache") is None  # under a file: not creatable
    assert caplog.text.count("Not caching compiled executables") == 2
    assert jax.config.jax_compilation_cache_dir == before
    _compile_new()  # compiling still works


def test_a_folder_that_cannot_be_written_leaves_the_cache_off(
    tmp_path, jax_cache_settings, caplog, monkeypatch
):
    """A read-only folder over its cap: eviction fails (as root, which may write anywhere, the
    failure is made). The cache stays off with a warning, and compiling goes on."""

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path))

    monkeypatch.setattr(compilation_cache, "evict", read_only)
    with caplog.at_level(logging.WARNING, logger=compilation_cache.__name__):
        assert compilation_cache.enable(tmp_path, max_bytes=1) is None
    assert "Not caching compiled executables" in caplog.text
    assert jax.config.jax_compilation_cache_dir is None
    _compile_new()
